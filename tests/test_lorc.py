"""LoRC: exactness at full rank, theorem 1, the rank schedules, and the budget really reached."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvconvert import linalg
from kvconvert.errors import KVConvertError
from kvconvert.methods.lorc.method import LorcConfig, plan_ranks, progressive_ranks, uniform_ranks
from tests.helpers import (
    assert_equivalent,
    convert,
    kv_budget,
    left_padded,
    load_converted,
    load_reference,
    run_cli,
)


def convert_lorc(src, dst, *extra: str) -> dict:
    return convert("lorc", src, dst, *extra)


@pytest.mark.parametrize("kind", ["llama", "llama_gqa", "qwen2_gqa", "gpt_neox", "gpt2", "qwen3", "olmo2"])
@pytest.mark.parametrize("compress", ["kv", "k", "v"])
def test_full_rank_reproduces_transformers(kind, compress, tiny_model_dir, tmp_path):
    """Budget 1.0 factors every layer at full rank: the SVD/folding path runs and must be exact (QK-norm,
    per head in Qwen3 and over all heads in OLMo 2, applied to the rebuilt or the kept keys)."""
    src = tiny_model_dir(kind)
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "1.0", "--compress", compress)
    assert all(r["rank_k" if compress != "v" else "rank_v"] is not None for r in report["layers"])
    reference, converted = load_reference(src), load_converted(tmp_path / "lorc")
    assert_equivalent(reference, converted, *left_padded(length=20, pad=6, seed=3, high=reference.config.vocab_size))


def test_theorem1_error_bound_per_layer():
    """‖Wx − W̃x‖ ≤ σ_{k+1}‖x‖ for the factors LoRC stores, on random inputs."""
    torch.manual_seed(0)
    for shape in [(64, 64), (32, 64), (96, 48)]:
        weight = torch.randn(*shape, dtype=torch.float64)
        sigma = torch.linalg.svdvals(weight)
        x = torch.randn(shape[1], 200, dtype=torch.float64)
        for rank in (1, shape[0] // 3, min(shape) - 1):
            up, down, _ = linalg.weighted_truncation(weight, rank)
            err = torch.linalg.norm(weight @ x - up @ (down @ x), dim=0)
            assert (err <= sigma[rank] * torch.linalg.norm(x, dim=0) * (1 + 1e-12)).all()


def test_eq13_on_hand_made_condition_numbers():
    """ln κ̃ = [9, 6, 3, 0]: f = [0, 1/3, 2/3, 1]; with d_max 12 and total 30, d_min = 12 − 18/2 = 3,
    so d = [12, 9, 6, 3] exactly."""
    assert progressive_ranks([9.0, 6.0, 3.0, 0.0], [True] * 4, 12, 30) == [12, 9, 6, 3]
    # a total between grid points is met exactly by largest-remainder rounding
    ranks = progressive_ranks([9.0, 6.0, 3.0, 0.0], [True] * 4, 12, 31)
    assert sum(ranks) == 31 and ranks == sorted(ranks, reverse=True)
    assert uniform_ranks([True, False, True], 10, 11) == [6, 10, 5]


def test_plan_reaches_budget_and_skips_sensitive_layers():
    kappa = [100.0, 50.0, 20.0, 10.0]  # log10 κ̃ (K and V equal): [8.0, 6.0, 4.6, 2.0]
    plan = plan_ranks(LorcConfig(kv_budget=0.75, threshold=5.0), kappa, kappa, width=16)
    assert plan.compressed == [False, False, True, True]
    assert plan.rank_k[:2] == [None, None]
    cached = sum((k or 16) + (v or 16) for k, v in zip(plan.rank_k, plan.rank_v, strict=True))
    assert cached == round(0.75 * 2 * 4 * 16) and plan.budget == pytest.approx(0.75)
    with pytest.raises(KVConvertError, match="below what this plan can reach"):
        plan_ranks(LorcConfig(kv_budget=0.4, threshold=5.0), kappa, kappa, width=16)
    assert math.isclose(plan.log10_kappa_cum[3], 2 * math.log10(10.0))


def test_progressive_cannot_go_below_its_floor():
    with pytest.raises(KVConvertError, match="use --schedule uniform"):
        plan_ranks(LorcConfig(kv_budget=0.3), [10.0] * 3 + [5.0], [10.0] * 3 + [5.0], width=16)
    plan = plan_ranks(LorcConfig(kv_budget=0.3, schedule="uniform"), [10.0] * 4, [10.0] * 4, width=16)
    assert plan.budget == pytest.approx(0.3, abs=1 / 64)


@pytest.mark.parametrize(("kind", "schedule"), [("llama_gqa", "progressive"), ("gpt2", "uniform")])
def test_measured_budget_matches_request(kind, schedule, tiny_model_dir, tmp_path):
    src = tiny_model_dir(kind)
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "0.6", "--schedule", schedule)
    reference, converted = load_reference(src), load_converted(tmp_path / "lorc")
    measured = kv_budget(reference, converted, torch.randint(3, 90, (2, 64)))
    layout = json.loads((tmp_path / "lorc" / "config.json").read_text())["kvconvert"]
    one_rank_step = 1 / (len(report["layers"]) * layout["num_kv_heads"] * layout["head_dim"])
    assert abs(measured - 0.6) <= one_rank_step, (measured, one_rank_step)
    out = converted.generate(torch.randint(3, 90, (2, 8)), max_new_tokens=6, do_sample=False)
    assert out.shape == (2, 14)


def test_threshold_mixes_stock_and_latent_layers_exactly(tiny_model_dir, tmp_path):
    """Layer 0 (largest κ̃) stays stock; the cache then mixes a stock layer with latent layers."""
    src = tiny_model_dir("llama_gqa")
    first = convert_lorc(src, tmp_path / "probe", "--kv-budget", "1.0")
    threshold = str(first["layers"][1]["log10_kappa_cum"])  # compress layers 1.., skip layer 0
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "1.0", "--threshold", threshold)
    assert [r["rank_k"] is None for r in report["layers"]] == [True, False, False]
    converted = load_converted(tmp_path / "lorc")
    assert type(converted.model.layers[0].self_attn).__name__ == "LlamaAttention"
    assert type(converted.model.layers[1].self_attn).__name__ == "LorcAttention"
    assert_equivalent(load_reference(src), converted, *left_padded(length=20, pad=6, seed=3, high=97))


def test_lorc_user_errors(tiny_model_dir, tmp_path):
    for args, fragment in [
        (["--kv-budget", "1.5"], "kv_budget must be in (0, 1]"),
        (["--kv-budget", "0.05"], "cannot reach this budget"),
    ]:
        result = run_cli("lorc", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "o"), *args)
        assert result.exit_code == 2 and fragment in result.stderr, result.stderr
        assert not (tmp_path / "o").exists()


CALIB = ("--calib-tokens", "2048")  # tiny models: 8 chunks of 256 tokens of calib_data/


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_gqa", "gpt_neox", "gpt2"])
def test_calibrated_full_rank_reproduces_transformers(kind, tokenized_model_dir, tmp_path):
    """--calib at budget 1.0: the whitened factors (and W_O's weighting of V) at full rank are exact."""
    src = tokenized_model_dir(kind)
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "1.0", "--calib", *CALIB)
    assert report["params"]["calibrate"] and report["plan"]["calibration"]["tokens"] == 2048
    assert all(r["k_rel_output_error"] < 1e-6 for r in report["layers"])
    reference, converted = load_reference(src), load_converted(tmp_path / "lorc")
    assert_equivalent(reference, converted, *left_padded(length=20, pad=6, seed=3, high=97))


@pytest.mark.parametrize(("kind", "compress"), [("llama_gqa", "kv"), ("gpt_neox", "k"), ("qwen2_gqa", "v"),
                                               ("qwen3", "kv"), ("olmo2", "k")])  # fmt: skip
def test_projected_kv_simulates_the_calibrated_checkpoint(kind, compress, tokenized_model_dir, tmp_path):
    """The auto schedule's probes score a simulation inside the source (keys un-rotated, projected,
    re-rotated; partial rotary on NeoX; biases on Qwen2; on QK-norm models the key projection's output
    projected, then normalised): it must compute what the checkpoint does."""
    from kvconvert.arch import adapter_for
    from kvconvert.calib.projection import projected_kv
    from kvconvert.io.source import open_source
    from kvconvert.methods.lorc.method import LorcMethod, _affine
    from kvconvert.pipeline import convert as convert_checkpoint

    src = tokenized_model_dir(kind)
    method = LorcMethod(LorcConfig(kv_budget=0.7, schedule="uniform", compress=compress, calibrate=True,
                                   calib_tokens=2048))  # fmt: skip
    plan = convert_checkpoint(open_source(str(src)), method, tmp_path / "lorc", progress=False).plan
    source = open_source(str(src))
    adapter = adapter_for(source.config)
    names = adapter.attention_names_by_layer(source.tensor_names())
    projectors = {}
    for layer in range(plan.layout.num_layers):
        weights = adapter.read_attention({local: source.get(name) for local, name in names[layer].items()})
        for side, (weight, right, left) in method._targets(plan.weighting, plan.layout, layer, weights).items():
            rank = getattr(plan.ranks, f"rank_{side}")[layer]
            if rank is not None:
                bias = weights.k_bias if side == "k" else weights.v_bias
                projectors[layer, side] = _affine(weight, rank, right, left, bias)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    reference = load_reference(src)
    with torch.no_grad(), projected_kv(reference, lambda: projectors, plan.layout.rotary_module):
        simulated = reference(ids).logits
    plain = reference(ids).logits
    converted = load_converted(tmp_path / "lorc")(ids).logits
    assert torch.allclose(simulated, converted, atol=2e-4, rtol=1e-4), (simulated - converted).abs().max()
    assert (plain - converted).abs().max() > 1e-2  # budget 0.7 really truncates


def test_auto_schedule_allocates_by_measured_loss(tokenized_model_dir, tmp_path):
    """--schedule auto: the budget is met to one rank, K and V ranks are chosen separately per layer,
    every side's probe KL is recorded, and the checkpoint generates in every mode."""
    from tests.helpers import generate_in_every_mode

    src = tokenized_model_dir("llama_gqa")
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "0.6", "--schedule", "auto", *CALIB)
    layers = report["layers"]
    width = 2 * 16  # Hkv · dk
    cached = sum(r["rank_k"] + r["rank_v"] for r in layers)
    assert cached == round(0.6 * 2 * len(layers) * width)
    assert report["params"]["calibrate"] and report["plan"]["calibration"]["probe"]["rank"] == round(0.6 * width)
    assert all(r["k_probe_kl"] >= 0 and r["v_probe_kl"] >= 0 for r in layers)
    assert len({(r["rank_k"], r["rank_v"]) for r in layers}) > 1  # not one uniform ratio
    converted = load_converted(tmp_path / "lorc")
    measured = kv_budget(load_reference(src), converted, torch.randint(3, 90, (2, 64)))
    assert abs(measured - 0.6) <= 1 / (len(layers) * width)
    generate_in_every_mode(converted)


def test_auto_schedule_refuses_a_threshold(tokenized_model_dir, tmp_path):
    result = run_cli("lorc", "--model", str(tokenized_model_dir("llama")), "--out", str(tmp_path / "o"),
                     "--kv-budget", "0.6", "--schedule", "auto", "--threshold", "3")  # fmt: skip
    assert result.exit_code == 2 and "--threshold belongs to the condition-number schedules" in result.stderr
    assert not (tmp_path / "o").exists()


def test_refinement_at_full_budget_reproduces_transformers(tokenized_model_dir, tmp_path):
    """Nothing to fit at full rank: --refine-steps keeps the exact closed form."""
    src = tokenized_model_dir("llama_gqa")
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "1.0", "--refine-steps", "5", *CALIB)
    assert all(r["refine_loss_after"] == r["refine_loss_before"] < 1e-10 for r in report["layers"])
    reference, converted = load_reference(src), load_converted(tmp_path / "lorc")
    assert_equivalent(reference, converted, *left_padded(length=20, pad=6, seed=3, high=97))


UNIFORM = {"kv_budget": 0.6, "schedule": "uniform"}
JOINT = {"kv_budget": 0.5, "schedule": "auto", "latent": "joint"}


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "options"), [
    ("llama_gqa", {**UNIFORM, "compress": "kv"}), ("qwen2_gqa", {**UNIFORM, "compress": "k"}),
    ("gpt_neox", {**UNIFORM, "compress": "v"}), ("llama_gqa", JOINT), ("qwen2_gqa", JOINT),
    ("qwen3", JOINT), ("olmo2", {**UNIFORM, "compress": "k"}),
])  # fmt: skip
def test_refinement_lowers_the_output_error_and_the_checkpoint_computes_it(kind, options, tokenized_model_dir,
                                                                          tmp_path):  # fmt: skip
    """--refine-steps: every refined layer's attention-output loss on its calibration chunks is below the
    closed form's (never above: the better is kept), the factors really moved, and the checkpoint computes
    what the refined truncation does inside the source (``projected_kv`` with Π = A·B; RoPE, partial
    rotary and biases included; QK-norm models fitted on the key projection's output, normalised after Π).
    ``--latent joint``: one Π on the stacked [k; v] (side "kv": keys un-rotated, stacked with the values,
    projected, split, re-rotated)."""
    from kvconvert.arch import adapter_for
    from kvconvert.calib.projection import projected_kv
    from kvconvert.io.source import open_source
    from kvconvert.methods.lorc.method import LorcMethod
    from kvconvert.pipeline import convert as convert_checkpoint

    src = tokenized_model_dir(kind)
    config = LorcConfig(**options, calib_tokens=2048, refine_steps=40)
    method = LorcMethod(config)
    result = convert_checkpoint(open_source(str(src)), method, tmp_path / "lorc", progress=False)
    report, plan = result.report, result.plan
    assert config.calibrate and report["plan"]["calibration"]["refine"]["steps"] == 40
    layers = report["layers"]
    sides = {"kv"} if "latent" in options else set(options["compress"])
    assert all(set(plan.refined[r["layer"]]) == sides for r in layers)
    assert all(r["refine_loss_after"] <= r["refine_loss_before"] for r in layers)
    assert sum(r["refine_loss_after"] for r in layers) < 0.9 * sum(r["refine_loss_before"] for r in layers)
    source = open_source(str(src))
    adapter = adapter_for(source.config)
    names = adapter.attention_names_by_layer(source.tensor_names())
    projectors = {}
    for layer, refined in plan.refined.items():
        weights = adapter.read_attention({local: source.get(name) for local, name in names[layer].items()})
        for side, (a, b) in refined.items():
            projector = (a @ b).float()
            width = projector.shape[0] // len(side)  # "kv": keys and values stacked, each side's bias kept
            bias = torch.cat([torch.zeros(width) if x is None else x.float()
                              for x in (getattr(weights, f"{one}_bias") for one in side)])  # fmt: skip
            projectors[layer, side] = (projector, bias - projector @ bias)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    reference = load_reference(src)
    with torch.no_grad(), projected_kv(reference, lambda: projectors, plan.layout.rotary_module):
        simulated = reference(ids).logits
    converted = load_converted(tmp_path / "lorc")(ids).logits
    assert torch.allclose(simulated, converted, atol=2e-4, rtol=1e-4), (simulated - converted).abs().max()
    assert (reference(ids).logits - converted).abs().max() > 1e-2  # the budget really truncates


def test_second_probe_round_measures_each_side_where_the_first_allocation_put_it(tokenized_model_dir, tmp_path):
    """--probe-rounds 2: every factored side below full width is probed a second time, at the rank the
    first allocation gave it (not the first probe's rank), with a positive KL that grows as the rank
    shrinks; the final plan still meets the budget and the checkpoint matches it."""
    src = tokenized_model_dir("llama_gqa")
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "0.5", "--schedule", "auto", "--probe-rounds", "2",
                          *CALIB)  # fmt: skip
    layers, width = report["layers"], 2 * 16
    r0 = report["plan"]["calibration"]["probe"]["rank"]
    assert report["params"]["probe_rounds"] == 2 and report["plan"]["calibration"]["probe"]["rounds"] == 2
    seconds = [p for r in layers for side in "kv" for p in r[f"{side}_probes"][1:]]
    assert len(seconds) == 2 * len(layers) and any(rank != r0 for rank, _ in seconds)
    for r in layers:
        for side in "kv":
            (rank0, kl0), (rank1, kl1) = r[f"{side}_probes"]
            assert rank0 == r0 and kl0 == r[f"{side}_probe_kl"]
            if rank1 != rank0 and rank1 < width:
                assert kl1 > 0 and (kl1 - kl0) * (rank0 - rank1) >= 0, (r["layer"], side, r[f"{side}_probes"])
    assert sum(r["rank_k"] + r["rank_v"] for r in layers) == round(0.5 * 2 * len(layers) * width)
    measured = kv_budget(load_reference(src), load_converted(tmp_path / "lorc"), torch.randint(3, 90, (2, 64)))
    assert abs(measured - 0.5) <= 1 / (len(layers) * width)


def test_probe_rounds_need_the_auto_schedule(tokenized_model_dir, tmp_path):
    result = run_cli("lorc", "--model", str(tokenized_model_dir("llama")), "--out", str(tmp_path / "o"),
                     "--kv-budget", "0.6", "--probe-rounds", "2")  # fmt: skip
    assert result.exit_code == 2 and "--probe-rounds belongs to --schedule auto" in result.stderr
    assert not (tmp_path / "o").exists()


def test_joint_truncation_is_the_least_squares_optimum_and_beats_every_split():
    """``linalg.joint_truncation``: its weighted output error on the calibration inputs equals the
    Eckart–Young optimum of the stacked matrix, each ``up`` is the explicit least-squares solve for the
    shared ``down``, and no split of the rank into separate K and V latents does better."""
    torch.manual_seed(0)
    f64 = torch.float64
    weights = [torch.randn(12, 20, dtype=f64), torch.randn(12, 20, dtype=f64)]
    x = torch.randn(300, 20, dtype=f64) @ torch.randn(20, 20, dtype=f64)  # correlated inputs [N, D]
    right = linalg.gram_factor(x.T @ x)
    lefts = [torch.linalg.cholesky(a @ a.T + torch.eye(12, dtype=f64)) for a in torch.randn(2, 12, 12, dtype=f64)]
    scales = [0.3, 2.0]

    def error(side: int, approx: torch.Tensor) -> float:  # scale·‖Lᵀ(W − Ŵ)Xᵀ‖²
        return scales[side] * float(torch.linalg.norm(lefts[side].T @ (weights[side] - approx) @ x.T) ** 2)

    for rank in (3, 9, 16):
        ups, down, sigma = linalg.joint_truncation(weights, scales, rank, right, lefts)
        joint = sum(error(i, ups[i] @ down) for i in range(2))
        assert math.isclose(joint, float((sigma[rank:] ** 2).sum()), rel_tol=1e-9)
        z = down @ x.T  # the latent on the inputs [r, N]
        for i in range(2):  # up_i = argmin ‖W_i Xᵀ − U Z‖: (W_i Xᵀ Zᵀ)(Z Zᵀ)⁻¹
            solved = torch.linalg.solve(z @ z.T, z @ (weights[i] @ x.T).T).T
            assert torch.allclose(ups[i], solved, atol=1e-8), (ups[i] - solved).abs().max()
        for rank_k in range(1, rank):
            separate = 0.0
            for i, r in enumerate((rank_k, rank - rank_k)):
                if r <= 12:
                    up, dn, _ = linalg.weighted_truncation(weights[i], r, right, lefts[i])
                    separate += error(i, up @ dn)
                else:  # a side cannot use more than its width: the split is not feasible
                    separate = math.inf
            assert joint <= separate * (1 + 1e-9), (rank, rank_k, joint, separate)


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_gqa", "gpt2", "qwen3"])
def test_joint_latent_at_full_budget_reproduces_transformers(kind, tokenized_model_dir, tmp_path):
    """--latent joint at budget 1.0: the shared latent at full rank (2·Hkv·dk, or the hidden width when
    that is smaller) rebuilds K and V exactly — with RoPE (keys re-rotated), biases (Qwen2) and absorbed
    keys (GPT-2, no RoPE). Its cache holds the one latent."""
    src = tokenized_model_dir(kind)
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "1.0", "--schedule", "auto", "--latent", "joint",
                          *CALIB)  # fmt: skip
    config = json.loads((tmp_path / "lorc" / "config.json").read_text())["kvconvert"]
    width, hidden = config["num_kv_heads"] * config["head_dim"], 64
    for layer in report["layers"]:
        assert layer["rank_k"] == layer["rank_v"] == min(2 * width, hidden) and layer["kv_rel_output_error"] < 1e-9
    assert all(layer["joint"] for layer in config["lorc_layers"])
    reference, converted = load_reference(src), load_converted(tmp_path / "lorc")
    assert_equivalent(reference, converted, *left_padded(length=20, pad=6, seed=3, high=97))
    measured = kv_budget(reference, converted, torch.randint(3, 90, (2, 64)))
    # (a RoPE model's cache also keeps each token's position: a few bytes, less than one rank step)
    assert abs(measured - min(2 * width, hidden) / (2 * width)) <= 1 / (len(report["layers"]) * width)


def test_joint_latent_meets_the_budget_and_generates(tokenized_model_dir, tmp_path):
    """--latent joint at 0.5: one rank per layer, allocated by loss (not uniform), summing to the budget
    in latent columns that each replace a K and a V column; the cache measurably holds that, every
    layer reports its weighted error and the two sides' loss weights, and generate works in every mode."""
    from tests.helpers import generate_in_every_mode

    src = tokenized_model_dir("llama_gqa")
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "0.5", "--schedule", "auto", "--latent", "joint",
                          *CALIB)  # fmt: skip
    layers, width = report["layers"], 2 * 16
    assert sum(r["rank_k"] for r in layers) == round(0.5 * 2 * len(layers) * width)
    assert all(r["rank_k"] == r["rank_v"] for r in layers) and len({r["rank_k"] for r in layers}) > 1
    assert all(0 < r["kv_rel_output_error"] < 1 and min(r["kv_scales"]) > 0 for r in layers)
    converted = load_converted(tmp_path / "lorc")
    assert abs(kv_budget(load_reference(src), converted, torch.randint(3, 90, (2, 64))) - 0.5) <= 1 / (
        len(layers) * 2 * width)  # fmt: skip
    generate_in_every_mode(converted)


def test_bf16_rebuild_stays_within_its_rounding_and_is_chosen_by_the_cpu(tiny_model_dir, tmp_path, monkeypatch):
    """KVCONVERT_REBUILD=bf16: keys rebuilt from bfloat16 operands change a LoRC model's logits by bfloat16's rounding
    of the keys (well under 1 % of their scale here, where the latent's own truncation moves them by far more),
    and every generate mode runs; ``auto`` picks it only for a float32 latent on a CPU that multiplies bfloat16 in
    hardware; a bfloat16 latent is rebuilt as it is, or in float32 where oneDNN has no bfloat16 products (AVX2);
    a misspelt value is one line."""
    from kvconvert.runtime import kvconvert_products as products
    from tests.helpers import generate_in_every_mode

    src = tiny_model_dir("llama_gqa")
    convert_lorc(src, tmp_path / "lorc", "--kv-budget", "0.5", "--schedule", "uniform")
    converted, reference = load_converted(tmp_path / "lorc"), load_reference(src)
    ids, mask = left_padded(length=24, pad=5, seed=4, high=97)
    with torch.no_grad():
        exact = converted(input_ids=ids, attention_mask=mask).logits
        monkeypatch.setenv("KVCONVERT_REBUILD", "bf16")
        low = converted(input_ids=ids, attention_mask=mask).logits
        truncated = reference(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    rounding = (low - exact)[valid].abs().max().item()
    assert 0 < rounding < 1e-2 * exact[valid].abs().max().item()
    assert rounding < 0.1 * (truncated - exact)[valid].abs().max().item()
    generate_in_every_mode(converted)

    latent = torch.zeros(2, 3)
    for choice, cpu_bf16, expected in [("exact", True, torch.float32), ("bf16", False, torch.bfloat16),
                                       ("auto", True, torch.bfloat16), ("auto", False, torch.float32)]:  # fmt: skip
        monkeypatch.setenv("KVCONVERT_REBUILD", choice)
        monkeypatch.setattr(products, "_CPU_BF16", cpu_bf16)
        monkeypatch.setattr(products, "onednn_half", lambda dtype: True)
        assert products.rebuild_dtype(latent) == expected
        assert products.rebuild_dtype(latent.bfloat16()) == torch.bfloat16  # a 16-bit latent is rebuilt as it is
        monkeypatch.setattr(products, "onednn_half", lambda dtype: False)  # unless oneDNN has no bfloat16 products
        assert products.rebuild_dtype(latent.bfloat16()) == torch.float32
    monkeypatch.setenv("KVCONVERT_REBUILD", "fast")
    with pytest.raises(ValueError, match="KVCONVERT_REBUILD='fast' is not one of auto, bf16, exact"):
        products.rebuild_dtype(latent)


def test_joint_latent_user_errors(tokenized_model_dir, tmp_path):
    for args, fragment in [
        (["--latent", "joint"], "--latent joint needs --schedule auto"),
        (["--latent", "joint", "--schedule", "auto", "--compress", "k"], "it needs --compress kv"),
        (["--latent", "joint", "--schedule", "auto", "--probe-rounds", "2"], "does not combine with --probe-rounds"),
    ]:
        result = run_cli("lorc", "--model", str(tokenized_model_dir("llama")), "--out", str(tmp_path / "o"),
                         "--kv-budget", "0.5", *args)  # fmt: skip
        assert result.exit_code == 2 and fragment in result.stderr, result.stderr
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_qk_norm_models_convert_by_measured_loss_and_generate(kind, tokenized_model_dir, tmp_path):
    """QK-norm families (Qwen3: per head; OLMo 2: over all heads) at 0.5 with the calibrated allocation:
    the probes measure each side's loss (their simulation is tested above), the checkpoint normalises its
    rebuilt keys as the source does, the cache holds half, and generation works."""
    from tests.helpers import generate_in_every_mode

    src = tokenized_model_dir(kind)
    report = convert_lorc(src, tmp_path / "lorc", "--kv-budget", "0.5", "--schedule", "auto", *CALIB)
    layers = report["layers"]
    assert all(r["k_probe_kl"] > 0 and r["v_probe_kl"] > 0 for r in layers)
    config = json.loads((tmp_path / "lorc" / "config.json").read_text())["kvconvert"]
    assert config["qk_norm"]["per_head"] == (kind == "qwen3")
    reference, converted = load_reference(src), load_converted(tmp_path / "lorc")
    width = config["num_kv_heads"] * config["head_dim"]
    measured = kv_budget(reference, converted, torch.randint(3, 90, (2, 64)))
    assert abs(measured - 0.5) <= 1 / (len(layers) * width)
    generate_in_every_mode(converted)


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
@torch.no_grad()
def test_refinement_fits_on_what_the_qk_norm_model_attends_to(kind, tokenized_model_dir):
    """On a QK-norm model the refinement's capture holds the key projection's output (before the norm),
    and its attention normalises and rotates it: the same output as the model's own keys give."""
    import dataclasses

    import torch.nn.functional as F

    from kvconvert.calib.hooks import observed_attention
    from kvconvert.calib.projection import key_projections, rotary_tables
    from kvconvert.methods.lorc.refine import Capture, attend

    model = load_reference(tokenized_model_dir(kind))
    seen = []
    with key_projections(model) as normed:

        def observer(module, query, key, value, scaling):
            if int(module.layer_idx) == 1:
                raw, weight, eps = normed(module)
                seen.append((query, key, value, scaling, raw, weight, eps))

        with observed_attention(model, observer):
            model(torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0)))
    query, key, value, scaling, raw, weight, eps = seen[0]
    kv_heads = key.shape[1]
    cos, sin = rotary_tables(model, "model.rotary_emb", key)
    capture = Capture(query=query, key=raw.unflatten(-1, (kv_heads, -1)).transpose(1, 2), value=value, cos=cos,
                      sin=sin, scaling=scaling, norm=(weight, eps))  # fmt: skip
    own = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    expected = own.transpose(1, 2).flatten(-2)
    assert torch.allclose(attend(capture, capture.key, capture.value), expected, atol=1e-5)
    without_norm = attend(dataclasses.replace(capture, norm=None), capture.key, capture.value)
    assert not torch.allclose(without_norm, expected, atol=1e-3)  # the norm matters
