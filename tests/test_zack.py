"""ZACK: eq. 6, rotations, exactness at r = 0, real memory saving, the simulation the search relies on."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SHARED
from helpers import (
    assert_equivalent,
    assert_same_logits,
    convert,
    kv_budget,
    left_padded,
    load_converted,
    load_reference,
    run_cli,
)
from transformers import AutoConfig

from kvconvert import linalg
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import PlanContext
from kvconvert.methods.zack import ZackConfig

CALIB = ("--calib-tokens", "2048")  # tiny models: 8 chunks of 256 tokens of calib_data/


def _zack(src, dst, *args: str):
    return convert("zack", src, dst, *CALIB, *args)


def test_eq6_on_a_hand_made_spectrum():
    s = torch.tensor([4.0, 3.0, 2.0, 1.0])  # total 10; removing the last k dims drops 1, 3, 6 (of 10)
    expected = {0.0: 4, 0.05: 4, 0.1: 3, 0.25: 3, 0.3: 2, 0.59: 2, 0.6: 1, 0.99: 1}
    assert {r: linalg.rank_for_removal_rate(s, r) for r in expected} == expected


@pytest.mark.parametrize("seed", range(5))
def test_eq6_inequality_holds_for_random_spectra(seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.rand(16, generator=g, dtype=torch.float64).sort(descending=True).values
    for r in torch.rand(20, generator=g, dtype=torch.float64).tolist():
        keep = linalg.rank_for_removal_rate(s, r)  # keep = j + 1
        removed_after_j = float(s[keep:].sum() / s.sum())
        removed_from_j = float(s[keep - 1 :].sum() / s.sum())
        assert removed_after_j <= r < removed_from_j


def test_principal_basis_is_orthogonal_and_diagonalises_the_gram():
    g = torch.Generator().manual_seed(0)
    activations = torch.randn(500, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g,
                                                                                      dtype=torch.float64)  # fmt: skip
    rotation, singular = linalg.principal_basis(activations.T @ activations)
    assert torch.allclose(rotation.T @ rotation, torch.eye(12, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(singular, torch.linalg.svdvals(activations), rtol=1e-9)
    rotated = activations @ rotation  # columns ordered by descending energy
    assert torch.all(rotated.pow(2).sum(0)[:-1] >= rotated.pow(2).sum(0)[1:] - 1e-9)


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_gqa", "gpt2", "gpt_neox"])
def test_removal_rate_zero_is_exact(tokenized_model_dir, tmp_path, kind):
    """RoPE + GQA (llama, qwen2 with biases), no RoPE (GPT-2, rotations folded into W_Q/W_K) and
    partial RoPE (GPT-NeoX): full-width rotations change nothing."""
    src = tokenized_model_dir(kind)
    report = _zack(src, tmp_path / "zack", "--removal-rate", "0")
    assert all(width == 16 for row in report["layers"] for width in row["rank_k"] + row["rank_v"])
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    assert_equivalent(load_reference(src), load_converted(tmp_path / "zack"), ids, mask)


@pytest.mark.parametrize(("kind", "entry"), [("smollm3", {"nope_layers": [1]}), ("glm", {"interleaved_rope": True})])
def test_rope_variants_are_named_for_the_runtime(kind, entry, tokenized_model_dir, tmp_path):
    """SmolLM3's layer without RoPE and GLM's RoPE on interleaved pairs are named in the spec, which then asks for a
    runtime that knows them (spec version 4): an older one would turn those keys the rotate-half way, and refuses
    instead."""
    from kvconvert.runtime.kvconvert_spec import SPEC_VERSION

    _zack(tokenized_model_dir(kind), tmp_path / "zack", "--removal-rate", "0")
    spec = json.loads((tmp_path / "zack" / "config.json").read_text())["kvconvert"]
    assert {k: spec[k] for k in entry} == entry and spec["spec_version"] == SPEC_VERSION == 4


def test_sliding_window_layers_stay_stock_outside_the_budget(tokenized_model_dir, tmp_path):
    """A Qwen3 with sliding-window layers (window 8): they keep their stock attention and windowed cache, full width,
    and the budget (by measured loss, each global layer's sides probed) is spent on the global layer alone, as the
    pipeline's accounting counts it; the model generates (greedy, beams) past the window."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from kvconvert.arch import adapter_for

    src = tokenized_model_dir("qwen3_sliding")
    local = adapter_for(AutoConfig.from_pretrained(src)).layout().local_layers
    assert local  # the tiny model has sliding-window layers
    report = _zack(src, tmp_path / "zack", "--kv-budget", "0.5", "--schedule", "auto")
    stock = [row["layer"] for row in report["layers"] if row.get("stock")]
    assert stock == list(local)
    cut = [row for row in report["layers"] if not row.get("stock")]
    kept = sum(sum(row["rank_k"]) + sum(row["rank_v"]) for row in cut) / (len(cut) * 2 * 2 * 16)
    assert kept <= 0.5 and report["kv_budget_expected"] == pytest.approx(kept)
    assert all(w == 16 for row in report["layers"] if row.get("stock") for w in row["rank_k"] + row["rank_v"])
    converted = load_converted(tmp_path / "zack")
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = converted(ids, use_cache=True).past_key_values
    assert [isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers] == [
        i in local for i in range(len(cache.layers))]  # fmt: skip
    for beams in (1, 3):
        out = converted.generate(ids[:1, :12], max_new_tokens=16, num_beams=beams, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 28)


def test_sliding_window_layers_take_quantized_storage(tokenized_model_dir, tmp_path):
    """ZACK + 4-bit storage with ``--kv-include-local`` on a Qwen3 with sliding-window layers: the windows are quantized
    like quant's (``QuantizedSlidingLayer``) and the global layer holds ZACK's latent; asked for a static cache, the
    checkpoint says once why it has none (quantized windows grow and forget per block) and decodes what the growing
    cache decodes, past the window."""
    src = tokenized_model_dir("qwen3_sliding")
    _zack(src, tmp_path / "zack", "--removal-rate", "0.3", "--kv-bits", "4", "--kv-group", "4", "--kv-residual", "4",
          "--kv-include-local")  # fmt: skip
    converted = load_converted(tmp_path / "zack")
    ids, mask = left_padded()
    cache = converted(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[0] == "LatentLayer" and set(kinds[1:]) == {"QuantizedSlidingLayer"}, kinds
    options = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    growing = converted.generate(**options)
    with pytest.warns(UserWarning, match="sliding-window layers have no static layer"):
        static = converted.generate(**options, cache_implementation="static")
    assert torch.equal(growing, static)


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen3"])
def test_budget_is_met_with_per_head_widths_and_a_smaller_cache(kind, tokenized_model_dir, tmp_path):
    src = tokenized_model_dir(kind)
    report = _zack(src, tmp_path / "zack", "--kv-budget", "0.6")
    layers = report["layers"]
    widths = [w for row in layers for w in row["rank_k"] + row["rank_v"]]
    assert len(widths) == 3 * 2 * 2 and len(set(widths)) > 1  # adaptive: heads differ
    expected = sum(widths) / (3 * 2 * 2 * 16)
    assert expected <= 0.6 and report["kv_budget_expected"] == pytest.approx(expected)
    config = json.loads((tmp_path / "zack" / "config.json").read_text())
    assert [row["rank_k"] for row in config["kvconvert"]["zack_layers"]] == [row["rank_k"] for row in layers]
    reference, converted = load_reference(src), load_converted(tmp_path / "zack")
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(0))
    assert kv_budget(reference, converted, ids) == pytest.approx(expected, abs=1e-9)
    generated = converted.generate(ids[:, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 14)
    beams = converted.generate(ids[:, :8], max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert beams.shape == (1, 14)


def test_k_only_keeps_values_full(tokenized_model_dir, tmp_path):
    report = _zack(tokenized_model_dir("llama_gqa"), tmp_path / "zack", "--kv-budget", "0.75", "--compress", "k")
    assert all(w == 16 for row in report["layers"] for w in row["rank_v"])
    assert sum(w for row in report["layers"] for w in row["rank_k"]) <= 0.5 * 3 * 2 * 16


@pytest.mark.parametrize(("kind", "value_basis"), [("qwen2_gqa", "paper"), ("qwen2_gqa", "output"),
                                                    ("qwen3", "paper"), ("olmo2", "output"),
                                                    ("smollm3", "paper"), ("glm", "output"),
                                                    ("qwen3_sliding", "paper"), ("gemma3", "output")])  # fmt: skip
def test_truncated_attention_simulates_the_checkpoint(kind, value_basis, tokenized_model_dir, tmp_path):
    """The --target-agreement search scores a simulation; it must compute what the checkpoint does. The simulation
    truncates the source's own queries and keys where its attention receives them, after the QK-norm (per head on
    Qwen3, over all heads on OLMo 2) and RoPE: a checkpoint that normed elsewhere, or not at all, differs; on SmolLM3
    its layer without RoPE takes the bases folded into its projections; on GLM RoPE turns interleaved pairs of half
    of each head's channels (the family's own function applies it); a Qwen3 with sliding-window layers keeps them
    stock (the simulation leaves them whole); Gemma 3 besides scales its norm by 1 + weight and rotates its global
    layers by their own RoPE table."""
    from kvconvert.io.source import open_source
    from kvconvert.methods.zack.method import ZackMethod
    from kvconvert.methods.zack.search import projectors_for, truncated_attention

    src = tokenized_model_dir(kind)
    method = ZackMethod(ZackConfig(removal_rate=0.3, calib_tokens=2048, value_basis=value_basis))
    from kvconvert.pipeline import convert

    plan = convert(open_source(str(src)), method, tmp_path / "zack", progress=False).plan
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))
    reference = load_reference(src)
    with torch.no_grad(), truncated_attention(reference, projectors_for(plan.bases, plan.widths).__getitem__):
        simulated = reference(ids).logits
    plain = reference(ids).logits  # hooks are gone after the block
    converted = load_converted(tmp_path / "zack")(ids).logits
    assert_same_logits(simulated, converted, "simulation vs checkpoint")
    assert (plain - converted).abs().max() > 1e-2  # r = 0.3 really truncates


@pytest.mark.slow
def test_target_agreement_search_logs_probes(tokenized_model_dir, tmp_path):
    report = _zack(tokenized_model_dir("llama_gqa"), tmp_path / "zack", "--target-agreement", "0.8")
    search = report["plan"]["calibration"]["search"]
    chosen = report["plan"]["removal_rate"]
    passing = [p for p in search if p["agreement"] >= 0.8]
    assert chosen == (max(p["removal_rate"] for p in passing) if passing else 0.0)
    # whole-model decisions live in the plan section, not on whichever layer converted first
    assert all("removal_rate" not in layer and "calibration" not in layer for layer in report["layers"])


@pytest.mark.parametrize(
    "args, message",
    [
        (("--kv-budget", "0.5", "--removal-rate", "0.1"), "exactly one of"),
        (("--removal-rate", "1.5"), "removal_rate must be in"),
        (("--kv-budget", "0.01"), "below what zack can reach"),
        (("--kv-budget", "0.5", "--calib-tokens", "10000000"), "--calib-tokens asks for"),
        (("--removal-rate", "0.1", "--schedule", "auto"), "--schedule auto allocates a --kv-budget"),
        (("--kv-budget", "0.01", "--schedule", "auto"), "below what zack can reach"),
    ],
)
def test_bad_input_is_one_line(tokenized_model_dir, tmp_path, args, message):
    result = run_cli("zack", "--model", str(tokenized_model_dir("llama_gqa")), "--out", str(tmp_path / "z"),
                     "--quiet", *args)  # fmt: skip
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "z").exists()


def test_no_tokenizer_is_refused(tiny_model_dir, tmp_path):
    result = run_cli(
        "zack", "--model", str(tiny_model_dir("llama")), "--out", str(tmp_path / "z"), "--kv-budget", "0.5"
    )
    assert result.exit_code == 2 and "tokenizer" in result.output


def test_config_needs_exactly_one_target():
    with pytest.raises(KVConvertError):
        ZackConfig()


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data" / "tinystories").exists(), reason="../shared/data is not present")
def test_rotations_do_not_depend_on_the_calibration_text(aidreams_dir, tmp_path):
    """ZACK §4.3/§6.6: bases fitted on calib_data/ and on TinyStories (16K tokens each) keep the same
    activations. Element-wise δ/ε is reported too but is not small: RoPE pairs dims with equal
    singular values, so which basis a fit picks inside such a pair is arbitrary."""
    text = SHARED / "data" / "tinystories" / "tinystories_train_head.txt"
    result = run_cli("analyze", "--model", str(aidreams_dir), "--out", str(tmp_path / "a"), "--rotations",
                     "--compare-calib", str(text))  # fmt: skip
    assert result.exit_code == 0, result.output
    compare = json.loads((tmp_path / "a" / "analysis.json").read_text())["rotations"]["compare"]
    assert compare["tokens"] >= 16384
    assert compare["qk"]["captured_energy_min"] > 0.99
    assert compare["vw"]["captured_energy_mean"] > 0.97
    assert 0 < compare["qk"]["ratio"] < 1 and "R_QK" in result.output


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_gqa", "gpt2"])
def test_output_value_basis_is_exact_at_full_width(kind, tokenized_model_dir, tmp_path):
    """--value-basis output: the oblique V pair (cached B_rᵀv, read back by W_O through C_r) keeps every
    dim at r = 0, where it must reproduce the source exactly (C·Bᵀ = I)."""
    src = tokenized_model_dir(kind)
    report = _zack(src, tmp_path / "zack", "--removal-rate", "0", "--value-basis", "output")
    assert report["params"]["value_basis"] == "output"
    assert_equivalent(load_reference(src), load_converted(tmp_path / "zack"),
                      *left_padded(length=20, pad=6, seed=3, high=97))  # fmt: skip


def test_output_value_basis_loses_less_than_the_paper(tokenized_model_dir):
    """At the same r the output basis loses less of the attention output on the calibration values than
    the paper's V‖W_O rotation: Σ_h ‖W_Oʰ(v − v̂)‖² from the Grams, per head. (Its simulation against the
    checkpoint: ``test_truncated_attention_simulates_the_checkpoint``.)"""
    from kvconvert.io.source import open_source
    from kvconvert.methods.zack.method import fit_bases, output_gram

    src = tokenized_model_dir("qwen2_gqa")
    from kvconvert.arch import adapter_for
    from kvconvert.calib.stats import collect_head_grams
    from kvconvert.calib.text import calibration_set

    source = open_source(str(src))
    layout = adapter_for(source.config).layout()
    grams = collect_head_grams(source, adapter_for(source.config), calibration_set(src, None, 2048, 256, 0).chunks,
                               progress=False)  # fmt: skip
    o_weights = [w.o_weight for w in _attention_weights(source)]
    o_grams = [output_gram(o, layout) for o in o_weights]
    paper, output = fit_bases(grams, o_grams, "paper"), fit_bases(grams, o_grams, "output")
    for layer, o_gram in enumerate(o_grams):
        for g in range(layout.num_kv_heads):
            for rank in (2, 5, 9):

                def loss(bases, layer=layer, g=g, rank=rank, o_gram=o_gram):
                    b, c = bases.vw[layer][g][:, :rank], bases.vw_out[layer][g][:, :rank]
                    residual = torch.eye(16, dtype=torch.float64) - c @ b.T  # v − v̂ = (I − C Bᵀ) v
                    return float(torch.trace(residual @ grams.value[layer, g] @ residual.T @ o_gram[g]))

                assert loss(output) <= loss(paper) * (1 + 1e-9) + 1e-12, (layer, g, rank)


def _attention_weights(source):
    from kvconvert.arch import adapter_for

    adapter = adapter_for(source.config)
    names = adapter.attention_names_by_layer(source.tensor_names())
    return [adapter.read_attention({k: source.get(v) for k, v in names[i].items()}) for i in sorted(names)]


def _synthetic_bases(layers: int, kv_heads: int, dk: int):
    """HeadBases whose every head has the spectrum dk, dk−1, …, 1 (identity rotations)."""
    from kvconvert.methods.zack.method import HeadBases

    spectrum = torch.arange(dk, 0, -1, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)

    def grid(x):
        return [[x.clone() for _ in range(kv_heads)] for _ in range(layers)]

    return HeadBases(grid(eye), grid(spectrum), grid(eye), grid(spectrum))


def test_widths_by_loss_meet_the_budget_and_follow_the_measured_kl():
    """plan_by_loss: Σ widths = the budget to one dim; alike heads with alike probes get alike widths; a
    layer side whose probe KL is 100× larger gets wider (every one of its heads), the others narrower."""
    from kvconvert.methods.zack.method import plan_by_loss, plan_for_budget

    bases = _synthetic_bases(layers=3, kv_heads=2, dk=8)
    probe = plan_for_budget(bases, 0.5, 8)
    even = {"k": [0.1] * 3, "v": [0.1] * 3}
    plan = plan_by_loss(bases, 0.5, 8, "kv", probe, even)
    assert plan.removal_rate is None and plan.budget == 0.5
    assert {w for layer in plan.rank_k + plan.rank_v for w in layer} == {4}
    louder = {"k": [0.1, 10.0, 0.1], "v": [0.1] * 3}
    skewed = plan_by_loss(bases, 0.5, 8, "kv", probe, louder)
    assert skewed.budget == 0.5 and skewed.probe_kl == louder
    assert all(w > 4 for w in skewed.rank_k[1])
    assert all(w <= 4 for i, layer in enumerate(skewed.rank_k + skewed.rank_v) if i != 1 for w in layer)
    assert plan_by_loss(bases, 1.0, 8, "kv", plan_for_budget(bases, 1.0, 8), even).budget == 1.0
    k_only = plan_by_loss(bases, 0.75, 8, "k", plan_for_budget(bases, 0.75, 8, "k"), {"k": [0.1] * 3})
    assert all(w == 8 for layer in k_only.rank_v for w in layer) and k_only.budget == 0.75


def test_auto_schedule_converts_by_measured_loss(tokenized_model_dir, tmp_path):
    """--schedule auto: every layer side's probe KL is recorded, the widths meet the budget as measured
    from the live cache and are not one removal rate's, and the checkpoint generates in every mode."""
    from helpers import generate_in_every_mode

    src = tokenized_model_dir("llama_gqa")
    report = _zack(src, tmp_path / "zack", "--kv-budget", "0.5", "--schedule", "auto", "--value-basis", "output")
    layers = report["layers"]
    assert report["plan"]["removal_rate"] is None and report["plan"]["calibration"]["probe"]["chunks"] >= 1
    assert all(r["k_probe_kl"] > 0 and r["v_probe_kl"] > 0 for r in layers)
    cached = sum(sum(r["rank_k"]) + sum(r["rank_v"]) for r in layers)
    assert cached == round(0.5 * 2 * len(layers) * 2 * 16)  # 2 KV heads of 16 dims
    converted = load_converted(tmp_path / "zack")
    assert abs(kv_budget(load_reference(src), converted, torch.randint(3, 90, (2, 64))) - 0.5) < 0.01
    generate_in_every_mode(converted)


def test_auto_schedule_at_full_budget_reproduces_the_source(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("qwen2_gqa")
    report = _zack(src, tmp_path / "zack", "--kv-budget", "1", "--schedule", "auto")
    assert all(w == 16 for r in report["layers"] for w in r["rank_k"] + r["rank_v"])
    assert_equivalent(load_reference(src), load_converted(tmp_path / "zack"),
                      *left_padded(length=20, pad=6, seed=3, high=97))  # fmt: skip


def test_probe_branches_measure_what_a_lone_truncation_costs(tokenized_model_dir):
    """The probes share one branching pass; each branch's KL must equal the KL between two plain runs of
    the source (no branches): as is, and with only that layer side truncated at the paper's widths."""
    import contextlib

    from kvconvert.arch import adapter_for
    from kvconvert.calib.sequential import run_layer_by_layer
    from kvconvert.calib.text import calibration_set
    from kvconvert.io.source import open_source
    from kvconvert.methods.zack.method import ZackMethod, plan_for_budget
    from kvconvert.methods.zack.search import projectors_for, truncated_attention

    src = tokenized_model_dir("llama_gqa")
    source = open_source(str(src))
    adapter = adapter_for(source.config)
    layout = adapter.layout()
    method = ZackMethod(ZackConfig(kv_budget=0.5, schedule="auto", calib_tokens=2048))
    plan = method.plan(PlanContext(layout, _attention_weights(source), source, progress=False))
    chunks = calibration_set(src, None, 2048, min(512, layout.context), 0).held_out[:4]
    projectors = projectors_for(plan.bases, plan_for_budget(plan.bases, 0.5, layout.head_dim))

    def log_probs(observe) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        run_layer_by_layer(source, adapter, chunks, observe, progress=False,
                           logits=lambda c, x: out.append(torch.log_softmax(x.float(), -1)))  # fmt: skip
        return out

    plain = log_probs(contextlib.nullcontext)
    for layer, side in ((1, "v"), (2, "k")):
        p_k, p_v = projectors[layer]
        lone = (p_k, None) if side == "k" else (None, p_v)
        cut = log_probs(lambda model, layer=layer, lone=lone: truncated_attention(model, {layer: lone}.get))
        kl = sum(float((p.exp() * (p - q)).sum()) for p, q in zip(plain, cut, strict=True)) / chunks.numel()
        assert kl > 0 and plan.widths.probe_kl[side][layer] == pytest.approx(kl, rel=1e-4, abs=1e-8)
