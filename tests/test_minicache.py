"""MiniCache: SLERP and retention by hand, exactness where nothing is lost, the stored state and its
accounting, the merge plan (start layer, budget, measured similarity)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.eval.memory import cache_nbytes
from kvconvert.eval.quality import evaluate_quality
from kvconvert.methods.base import PlanContext
from kvconvert.methods.minicache.method import MiniCacheConfig, kv_bytes_per_token, merge_pairs
from kvconvert.runtime.kvconvert_merge import merge_tokens, retained_tokens, slerp
from kvconvert.runtime.kvconvert_minicache import PairState
from tests.conftest import build_tiny_model
from tests.helpers import assert_equivalent, convert, left_padded, load_converted, load_reference, run_cli


def convert_minicache(src, dst, *extra: str) -> dict:
    return convert("minicache", src, dst, *extra)


def text_ids(n: int = 160) -> torch.Tensor:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(1))


# -- eq. 2-4 on hand-made vectors ------------------------------------------------------------


def test_slerp_endpoints_midpoint_and_unit_norm():
    e1, e2 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    start, omega = slerp(e1, e2, 0.0)
    torch.testing.assert_close(start, e1)
    assert float(omega) == pytest.approx(math.pi / 2)
    torch.testing.assert_close(slerp(e1, e2, 1.0)[0], e2)
    # t = 0.6 is 0.6 of the way along the great circle, i.e. at 54°
    angle = 0.6 * math.pi / 2
    torch.testing.assert_close(slerp(e1, e2, 0.6)[0], torch.tensor([math.cos(angle), math.sin(angle), 0.0]))
    torch.manual_seed(0)
    a, b = (
        torch.nn.functional.normalize(torch.randn(50, 16), dim=-1),
        torch.nn.functional.normalize(torch.randn(50, 16), dim=-1),
    )
    for t in (0.0, 0.3, 0.6, 1.0):
        torch.testing.assert_close(slerp(a, b, t)[0].norm(dim=-1), torch.ones(50))
    same, omega = slerp(a, a, 0.6)  # parallel: the limit, no NaN
    torch.testing.assert_close(same, a)
    assert torch.all(omega.abs() < 1e-3)


def test_merge_keeps_each_layers_norm_and_identical_layers_restore_exactly():
    torch.manual_seed(0)
    first, second = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    merged = merge_tokens(first, second, 0.6)
    for member, original in enumerate((first, second)):
        restored = merged.direction * merged.norms[:, member, None, :, None]
        # per token, the norm over all KV heads is the original's
        torch.testing.assert_close(restored.norm(dim=(1, 3)), original.norm(dim=(1, 3)))
    same = merge_tokens(first, first.clone(), 0.6)
    torch.testing.assert_close(same.direction * same.norms[:, 1, None, :, None], first)
    assert same.distance.abs().max() < 1e-3
    # angular distance: d = Ω/π of the flattened per-token states
    flat_a, flat_b = first.transpose(1, 2).reshape(2, 7, -1), second.transpose(1, 2).reshape(2, 7, -1)
    expected = torch.arccos(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=-1)) / math.pi
    torch.testing.assert_close(merged.distance, expected)
    average = merge_tokens(first, second, 0.6, merge="average")
    torch.testing.assert_close(average.direction, (first + second) / 2)
    assert average.norms is None


def test_retention_keeps_the_most_distant_tokens():
    distance = torch.tensor([[0.1, 0.2, 0.5, 0.9, 0.88, 0.95]])
    valid = torch.tensor([[True, True, True, True, True, False]])  # the last one is padding
    fresh = torch.tensor([[math.inf, -math.inf]])
    keep, seen_range = retained_tokens(distance, valid, fresh, gamma=0.05)
    # d ≥ d_max − (d_max − d_min)·γ = 0.9 − 0.8·0.05 = 0.86; padding neither kept nor ranged
    assert keep.tolist() == [[False, False, False, True, True, False]]
    torch.testing.assert_close(seen_range, torch.tensor([[0.1, 0.9]]))
    assert not retained_tokens(distance, valid, fresh, gamma=0.0)[0].any()
    assert retained_tokens(distance, valid, fresh, gamma=1.0)[0].tolist() == [valid[0].tolist()]
    # a decode step is judged against the range seen so far, not against itself alone
    step, _ = retained_tokens(torch.tensor([[0.5]]), torch.tensor([[True]]), seen_range, gamma=0.05)
    assert not step.any()
    step, grown = retained_tokens(torch.tensor([[0.97]]), torch.tensor([[True]]), seen_range, gamma=0.05)
    assert step.all() and grown[0, 1] == pytest.approx(0.97)


def test_pair_state_stores_one_direction_and_restores_both_layers():
    torch.manual_seed(0)
    pair = PairState(t=0.6, gamma=0.0, merge="slerp")
    k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    valid = torch.ones(2, 5, dtype=torch.bool)
    pair.commit(0, k, v, valid)
    pair.commit(1, k.clone(), v.clone(), valid)  # identical layers
    assert pair.pending is None and pair.seen == 5
    assert pair.keys_merged.direction.read().shape == (2, 3, 5, 4)  # one tensor for the two layers
    for member in (0, 1):
        restored_k, restored_v = pair.restore(member)
        torch.testing.assert_close(restored_k, k)
        torch.testing.assert_close(restored_v, v)


def test_retained_tokens_follow_batch_reordering():
    torch.manual_seed(0)
    pair = PairState(t=0.6, gamma=0.3, merge="slerp")
    first, second = torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4)
    valid = torch.ones(3, 6, dtype=torch.bool)
    pair.commit(0, first, first, valid)
    pair.commit(1, second, second, valid)
    assert pair.keys_merged.retained.shape[0] > 0
    before = [pair.restore(member)[0] for member in (0, 1)]
    index = torch.tensor([2, 0, 0])
    pair.select_rows(index)
    for member in (0, 1):
        torch.testing.assert_close(pair.restore(member)[0], before[member][index])


# -- whole models ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt_neox", "gpt2"])
def test_retaining_every_token_is_exact(kind, tiny_model_dir, tmp_path):
    """γ = 1 keeps every pair unmerged: prefill, greedy and sampled decoding equal the source."""
    src = tiny_model_dir(kind)
    report = convert_minicache(src, tmp_path / "mc", "--gamma", "1", "--start-layer", "0")
    assert report["plan"]["pairs"] == [[0, 1]]
    converted = load_converted(tmp_path / "mc")
    assert converted.config._attn_implementation == "kvconvert_minicache"
    assert_equivalent(load_reference(src), converted, *left_padded())


def test_start_at_last_layer_merges_nothing_through_reload(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    report = convert_minicache(src, tmp_path / "mc", "--start-layer", "3", "--gamma", "0")
    assert report["plan"]["pairs"] == [] and report["kv_budget_expected"] == 1.0
    assert all(row["merged_with"] is None for row in report["layers"])
    assert_equivalent(load_reference(src), load_converted(tmp_path / "mc"), *left_padded())


@torch.no_grad()
def test_identical_adjacent_layers_decode_exactly(tmp_path):
    """Layer 1 adds nothing to the residual stream and layer 2 repeats its norm and q/k/v: both
    layers compute the same K and V, so restoring from one shared direction is exact even with
    no retention, token after token through the cache."""
    model = build_tiny_model("llama_gqa")
    one, two = model.model.layers[1], model.model.layers[2]
    one.self_attn.o_proj.weight.zero_()
    one.mlp.down_proj.weight.zero_()
    two.input_layernorm.weight.copy_(one.input_layernorm.weight)
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(two.self_attn, name).weight.copy_(getattr(one.self_attn, name).weight)
    model.save_pretrained(tmp_path / "src")
    convert_minicache(tmp_path / "src", tmp_path / "mc", "--start-layer", "1", "--gamma", "0")
    converted, reference = load_converted(tmp_path / "mc"), load_reference(tmp_path / "src")
    result = evaluate_quality(converted, text_ids(), 80, reference, chunk=1)
    assert result.kl_mean < 1e-9 and result.top1_agreement == 1.0
    # while a different pair of layers is not reproduced: the check above can fail
    convert_minicache(tmp_path / "src", tmp_path / "mc0", "--start-layer", "0", "--gamma", "0")
    lossy = evaluate_quality(load_converted(tmp_path / "mc0"), text_ids(), 80, reference, chunk=1)
    assert lossy.kl_mean > 1e-4


@torch.no_grad()
def test_cache_holds_what_the_accounting_says(tiny_model_dir, tmp_path):
    """Bytes of the live cache = appendix-E-style accounting at the retained shares counted in it
    (+ the running distance range, 2 floats per row, side and pair), and fewer than the source's."""
    src = tiny_model_dir("llama_gqa")
    convert_minicache(src, tmp_path / "mc", "--start-layer", "0", "--gamma", "0.05")
    converted, reference = load_converted(tmp_path / "mc"), load_reference(src)
    ids = text_ids(96).view(2, 48)
    cache = converted(ids, use_cache=True).past_key_values
    pairs = [layer for layer in cache.layers if getattr(layer, "pair", None) is layer]
    assert len(pairs) == 1 and cache.layers[0].pair is pairs[0]
    state = pairs[0]
    tokens = ids.numel()
    share_k = state.keys_merged.retained.shape[0] / tokens
    share_v = state.values_merged.retained.shape[0] / tokens
    assert 0 < share_k < 0.5 and 0 < share_v < 0.5  # eq. 4 kept some, not most
    layout = type("Layout", (), {"kv_width": 2 * 16, "num_layers": 3})()
    per_token, original = kv_bytes_per_token(layout, 1, 4, share_k, share_v)  # type: ignore[arg-type]
    distance_ranges = 2 * (ids.shape[0] * 2 * 4)
    assert cache_nbytes(cache) == pytest.approx(per_token * tokens + distance_ranges)
    assert cache_nbytes(cache) < cache_nbytes(reference(ids, use_cache=True).past_key_values)
    assert original == 2 * 3 * 32 * 4


@torch.no_grad()
def test_decode_merges_each_new_token_pairwise(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    convert_minicache(src, tmp_path / "mc", "--start-layer", "1", "--gamma", "0.05")
    converted = load_converted(tmp_path / "mc")
    ids, mask = left_padded()
    out = converted.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    cache = out.past_key_values
    first, state = cache.layers[1], cache.layers[2]
    assert state.pending is None and state.seen == 24 + 9
    assert state.keys_merged.direction.read().shape == (2, 2, 33, 16)
    assert not [v for v in vars(first).values() if torch.is_tensor(v)]  # layer l-1 owns no tensors
    # the padded row's 7 padding positions are never retained
    at = state.keys_merged.retained_at
    assert not ((at[:, 0] == 1) & (at[:, 1] < 7)).any()
    beams = converted.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False,
                               pad_token_id=0)  # fmt: skip
    assert beams.shape == (2, 30)


def test_two_checkpoints_in_one_process_keep_their_own_behaviour(tiny_model_dir, tmp_path):
    """Each directory loaded with remote code registers its own copy of the attention function
    under the same name; the first model must still run its own cache afterwards."""
    src = tiny_model_dir("llama_gqa")
    convert_minicache(src, tmp_path / "exact", "--gamma", "1", "--start-layer", "0")
    convert_minicache(src, tmp_path / "lossy", "--gamma", "0", "--start-layer", "0")
    exact = load_converted(tmp_path / "exact")
    load_converted(tmp_path / "lossy")
    assert_equivalent(load_reference(src), exact, *left_padded())


def test_average_merge_is_worse_than_exact_but_runs(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    report = convert_minicache(src, tmp_path / "avg", "--merge", "average", "--gamma", "0", "--start-layer", "0")
    assert report["plan"]["merge"] == "average"
    result = evaluate_quality(load_converted(tmp_path / "avg"), text_ids(), 80, load_reference(src), chunk=4)
    assert result.kl_mean > 1e-4 and math.isfinite(result.ppl)


# -- the plan --------------------------------------------------------------------------------


def test_merge_pairs_and_default_start():
    assert merge_pairs(15, 30) == [(15, 16), (17, 18), (19, 20), (21, 22), (23, 24), (25, 26), (27, 28)]
    assert merge_pairs(16, 30)[-1] == (28, 29)
    assert merge_pairs(30, 30) == [] and merge_pairs(29, 30) == []


def test_kv_budget_picks_the_number_of_merged_layers(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    report = convert_minicache(src, tmp_path / "b", "--kv-budget", "0.8", "--gamma", "0")
    # 3 layers: one pair saves a third of the cache minus the norms → budget 0.667 + ε ≤ 0.8
    assert report["plan"]["pairs"] == [[1, 2]] and report["kv_budget_expected"] <= 0.8
    report = convert_minicache(src, tmp_path / "c", "--kv-budget", "1.0")
    assert report["plan"]["pairs"] == []
    result = run_cli("minicache", "--model", str(src), "--out", str(tmp_path / "d"), "--kv-budget", "0.3")
    assert result.exit_code == 2 and "below what merging every layer pair reaches" in result.output
    assert not (tmp_path / "d").exists()


def test_bad_options_are_one_line_errors(tiny_model_dir, tmp_path):
    src = str(tiny_model_dir("llama_gqa"))
    for extra, message in (
        (["--start-layer", "4"], "past the model's 3 layers"),
        (["--start-layer", "1", "--kv-budget", "0.5"], "at most one of"),
        (["--gamma", "1.5"], "gamma must be in [0, 1]"),
        (["--t", "-0.1"], "t must be in [0, 1]"),
    ):
        result = run_cli("minicache", "--model", src, "--out", str(tmp_path / "x"), *extra)
        assert result.exit_code == 2, result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1
    with pytest.raises(KVConvertError, match="min_similarity is a cosine"):
        MiniCacheConfig(min_similarity=2.0)


@torch.no_grad()
def test_similarity_measurement_matches_the_stock_cache(tokenized_model_dir, tmp_path):
    """Layer-by-layer measurement vs K/V read from transformers' own DynamicCache of a full forward."""

    from kvconvert.io.source import open_source
    from kvconvert.methods.minicache.layer_similarity import measure_layer_similarity

    src = tokenized_model_dir("llama_gqa")
    result = measure_layer_similarity(open_source(str(src)), tokens=256, chunk_len=64, progress=False)
    assert [p["layers"] for p in result["pairs"]] == [[0, 1], [1, 2]]
    from kvconvert.calib.text import calibration_set

    chunks = calibration_set(src, None, 256, 64, 0).chunks
    model = load_reference(src)
    cache = model(chunks, use_cache=True).past_key_values
    for pair in result["pairs"]:
        a, b = pair["layers"]
        for side in ("keys", "values"):
            x, y = getattr(cache.layers[a], side), getattr(cache.layers[b], side)  # [n, Hkv, T, d]
            flat = lambda t: t.transpose(1, 2).flatten(2)  # noqa: E731
            expected = torch.nn.functional.cosine_similarity(flat(x), flat(y), dim=-1).mean()
            assert pair[f"cos_{side[0]}"] == pytest.approx(float(expected), abs=1e-5)
            heads = torch.nn.functional.cosine_similarity(x, y, dim=-1).mean(dim=(0, 2))
            assert pair[f"cos_{side[0]}_heads"] == pytest.approx(heads.tolist(), abs=1e-5)


def test_min_similarity_chooses_the_start_layer(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    extra = ("--calib-tokens", "256")
    report = convert_minicache(src, tmp_path / "a", "--min-similarity", "-1", *extra)
    assert report["plan"]["start_layer"] == 0  # every pair passes
    assert report["plan"]["retention_source"] == "measured on calibration text"
    pairs = report["plan"]["layer_similarity"]["pairs"]
    worst = [min(p["cos_k"], p["cos_v"]) for p in pairs]  # what each pair (0-1, 1-2) keeps
    result = run_cli("minicache", "--model", str(src), "--out", str(tmp_path / "b"), "--min-similarity",
                     f"{max(worst) + 1e-3:.6f}", *extra)  # fmt: skip
    assert result.exit_code == 2 and "no layer pair reaches" in result.output
    # a threshold only the deeper pair meets starts there; one both meet starts at 0
    threshold = worst[1] - 1e-4
    report = convert_minicache(src, tmp_path / "d", "--min-similarity", f"{threshold:.6f}", *extra)
    assert report["plan"]["start_layer"] == (0 if worst[0] >= threshold else 1)
    assert report["plan"]["pairs"] == ([[0, 1]] if worst[0] >= threshold else [[1, 2]])
    # bare --calib measures and records, keeping the default start
    report = convert_minicache(src, tmp_path / "c", "--calib", *extra)
    assert report["plan"]["start_layer"] == 1 and "layer_similarity" in report["plan"]
    assert report["layers"][2]["cos_k_with_previous"] == pytest.approx(pairs[1]["cos_k"], abs=1e-6)


@pytest.mark.slow
def test_analyze_writes_layer_similarity(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    result = run_cli("analyze", "--model", str(src), "--out", str(tmp_path / "a"), "--layer-similarity",
                     "--calib-tokens", "256")  # fmt: skip
    assert result.exit_code == 0, result.output
    analysis = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert len(analysis["layer_similarity"]["pairs"]) == 2
    assert (tmp_path / "a" / "layer_similarity.png").stat().st_size > 10_000


def test_recipe_round_trip(tiny_model_dir, tmp_path):
    from kvconvert.recipe import load_recipe

    name, config, _ = load_recipe(__import__("pathlib").Path(__file__).parents[1] / "recipes" / "minicache.yaml")
    assert name == "minicache" and config == MiniCacheConfig()
    convert_minicache(tiny_model_dir("llama_gqa"), tmp_path / "mc")
    again = load_recipe(tmp_path / "mc" / "recipe.yaml")
    assert again[:2] == ("minicache", MiniCacheConfig()) and not again[2].quantized


def test_the_cached_element_size_comes_from_the_converted_dtype(tiny_model_dir):
    """The cached element size comes from the converted dtype given to ``plan`` (that converting layers
    changes no decision: ``test_method_contract``)."""
    from kvconvert.arch import adapter_for
    from kvconvert.io.source import open_source
    from kvconvert.methods.minicache.method import MiniCacheMethod

    source = open_source(str(tiny_model_dir("llama")))
    layout = adapter_for(source.config).layout()
    method = MiniCacheMethod(MiniCacheConfig(start_layer=1))
    bf16 = method.plan(PlanContext(layout, source=source, dtype=torch.bfloat16, progress=False))
    float32 = method.plan(PlanContext(layout, source=source, dtype=torch.float32, progress=False))
    assert (bf16.element_bytes, float32.element_bytes) == (2, 4) and bf16.pairs == float32.pairs == [(1, 2)]
    # float32 norms weigh less next to float32 states
    assert method.expected_kv_budget(float32, layout) < method.expected_kv_budget(bf16, layout)


# -- subspace merge (extension, xKV) ---------------------------------------------------------


def test_shared_subspace_is_the_weighted_optimum_and_beats_separate_layers():
    """Brute force: the rank-r shared subspace's weighted error equals the sum of the left-out eigenvalues, no
    random encoder (with its least-squares decoder) does better, and per-layer subspaces of the same total
    width (the block-diagonal special case) lose more when the two layers share structure."""
    from kvconvert import linalg
    from kvconvert.methods.minicache.method import fit_pair_subspace

    torch.manual_seed(0)
    n, h, dk = 4000, 8, 4
    shared = torch.randn(n, 3, dtype=torch.float64)
    x = torch.cat([shared @ torch.randn(3, h, dtype=torch.float64), shared @ torch.randn(3, h, dtype=torch.float64)], 1)
    x = x + 0.1 * torch.randn(n, 2 * h, dtype=torch.float64) + 2.0  # a mean the fit must keep
    mean = x.mean(0)
    cov = (x - mean).T @ (x - mean) / n
    metrics = [torch.eye(dk, dtype=torch.float64).repeat(2, 1, 1) * s for s in (1.0, 3.0)]
    fit = fit_pair_subspace(mean, cov, metrics)
    metric = fit.lower @ fit.lower.T  # the metric the fit used: each layer's block scaled to unit energy

    def error(encoder, decoder):
        e = x - (mean + (x - mean) @ encoder @ decoder)
        return float(((e @ metric) * e).sum(1).mean())

    assert error(*linalg.subspace_factors(fit.lower, fit.vectors, 0)) == pytest.approx(2.0)  # both layers' energy
    for rank in (2, 3, 6):
        best = error(*linalg.subspace_factors(fit.lower, fit.vectors, rank))
        assert best == pytest.approx(float(fit.losses()[rank]), rel=1e-6)
        for _ in range(20):
            a = torch.randn(2 * h, rank, dtype=torch.float64)
            b = torch.linalg.lstsq((x - mean) @ a, x - mean).solution
            assert error(a, b) >= best * (1 - 1e-9)
    separate = 0.0
    for member in range(2):
        rows = slice(member * h, (member + 1) * h)
        blocks = torch.stack([metric[rows, rows][i * dk : (i + 1) * dk, i * dk : (i + 1) * dk] for i in range(2)])
        eigenvalues = linalg.shared_subspace(cov[rows, rows], blocks)[2]
        separate += float(eigenvalues[2:].sum())  # this layer alone at width 2
    assert float(fit.losses()[4]) < 0.5 * separate


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt_neox", "gpt2"])
def test_subspace_at_full_width_is_exact(kind, tokenized_model_dir, tmp_path):
    """--kv-budget 1 keeps every latent channel: prefill, greedy, sampled decoding with left padding equal the
    source through the cache, and the written parameters load into the stock attention modules."""
    src = tokenized_model_dir(kind)
    report = convert_minicache(src, tmp_path / "mc", "--merge", "subspace", "--kv-budget", "1", "--calib-tokens",
                               "256")  # fmt: skip
    converted = load_converted(tmp_path / "mc")
    spec = converted.config.kvconvert
    width = spec["num_kv_heads"] * spec["head_dim"]
    assert report["plan"]["pairs"] == [[0, 1]] and report["plan"]["ranks"] == [[2 * width, 2 * width]]
    module = converted.get_submodule(spec["attention_modules"][1])
    assert module.subspace_v_decoder.shape == (2 * width, width) and module.subspace_k_mean.abs().sum() > 0
    assert_equivalent(load_reference(src), converted, *left_padded())


@pytest.mark.slow
@torch.no_grad()
def test_subspace_budget_is_allocated_held_and_beats_slerp(tokenized_model_dir, tmp_path):
    """At budget 0.6 the widths are allocated by loss, the live cache holds what the plan says (fewer bytes
    than the source), decoding through the cache loses something, and less than SLERP merging of the same
    pair at a larger cache."""
    from kvconvert.methods.minicache.method import subspace_bytes_per_token

    src = tokenized_model_dir("llama_gqa")
    report = convert_minicache(src, tmp_path / "sub", "--merge", "subspace", "--kv-budget", "0.6",
                               "--calib-tokens", "512")  # fmt: skip
    ranks = report["plan"]["ranks"]
    layout = type("Layout", (), {"kv_width": 32, "num_layers": 3})()
    per_token, original = subspace_bytes_per_token(layout, [tuple(r) for r in ranks], 4)  # type: ignore[arg-type]
    assert per_token / original <= 0.6 and report["kv_budget_expected"] == pytest.approx(per_token / original)
    assert sum(ranks[0]) == int(0.6 * 2 * 3 * 32) - 2 * 32
    converted, reference = load_converted(tmp_path / "sub"), load_reference(src)
    ids = text_ids(96).view(2, 48)
    cache = converted(ids, use_cache=True).past_key_values
    stored = cache_nbytes(cache)
    unmerged = cache_nbytes(reference(ids, use_cache=True).past_key_values) / 3  # layer 2 is stock
    sinks = 2 * 2 * ids.shape[0] * 4 * 32 * 4  # both layers' K and V of the 4 sink tokens of each row, exact
    assert stored == pytest.approx(unmerged + sum(ranks[0]) * 4 * ids.numel() + sinks)
    sub = evaluate_quality(converted, text_ids(), 80, reference, chunk=1)
    convert_minicache(src, tmp_path / "slerp", "--start-layer", "0", "--gamma", "0")
    slerp_result = evaluate_quality(load_converted(tmp_path / "slerp"), text_ids(), 80, reference, chunk=1)
    assert 1e-6 < sub.kl_mean < slerp_result.kl_mean


def test_subspace_decodes_with_beams_and_storage(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    convert_minicache(src, tmp_path / "q", "--merge", "subspace", "--kv-budget", "0.5", "--calib-tokens", "256",
                      "--kv-bits", "4", "--kv-residual", "8", "--kv-group", "16")  # fmt: skip
    converted = load_converted(tmp_path / "q")
    ids, mask = left_padded()
    out = converted.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=3, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    state = out.past_key_values.layers[1]
    assert state.pending is None and state.latents[0].blocks is not None  # quantized latent blocks exist
    assert out.sequences.shape == (2, 36)


def test_subspace_bad_options(tokenized_model_dir, tmp_path):
    src = str(tokenized_model_dir("llama_gqa"))
    result = run_cli("minicache", "--model", src, "--out", str(tmp_path / "x"), "--merge", "subspace",
                     "--min-similarity", "0.5")  # fmt: skip
    assert result.exit_code == 2 and "needs no similar layers" in result.output
    result = run_cli("minicache", "--model", src, "--out", str(tmp_path / "y"), "--merge", "subspace", "--kv-budget",
                     "0.34", "--calib-tokens", "256")  # fmt: skip
    assert result.exit_code == 2 and "less than one latent channel" in result.output, result.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("storage", [(), ("--kv-bits", "4"), ("--kv-bits", "3"), ("--kv-bits", "2", "--kv-sink", "2")])
@torch.no_grad()
def test_subspace_latent_attention_equals_restoring_the_past(storage, tokenized_model_dir, tmp_path):
    """Decoding computes scores and outputs from the latents (``SubspaceState.attend_past``), quantized latents
    from their codes; restoring each layer's past states and running SDPA over them (``PairedLayer.attend_past``)
    is the reference."""
    src = tokenized_model_dir("llama_gqa")
    if storage:
        storage = (*storage, "--kv-group", "16", "--kv-residual", "4")
    convert_minicache(src, tmp_path / "sub", "--merge", "subspace", "--kv-budget", "0.6", "--calib-tokens", "256",
                      *storage)  # fmt: skip
    converted = load_converted(tmp_path / "sub")
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    latent = converted.generate(ids, **kwargs)
    state_class = type(latent.past_key_values.layers[1])
    assert state_class.__name__ == "SubspaceState"
    assert not storage or latent.past_key_values.layers[1].latents[1].blocks is not None  # codes were read
    assert_same_as_restoring(converted, state_class, latent, ids, kwargs)


def assert_same_as_restoring(converted, state_class, out, ids, kwargs) -> None:
    """``out`` (a ``generate`` result) equals generating again with ``state_class``'s decode path replaced by
    ``PairedLayer.attend_past`` (restore the past, then SDPA): the same tokens, logits up to rounding."""
    reads_codes = state_class.attend_past
    state_class.attend_past = state_class.__mro__[1].attend_past
    try:
        restored = converted.generate(ids, **kwargs)
    finally:
        state_class.attend_past = reads_codes
    assert torch.equal(out.sequences, restored.sequences)
    for a, b in zip(out.logits, restored.logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_pair_moments_match_the_stock_cache(tokenized_model_dir):
    """Layer-by-layer pair statistics vs K/V read from transformers' own DynamicCache of a full forward."""
    from kvconvert.arch import adapter_for
    from kvconvert.calib.text import calibration_set
    from kvconvert.io.source import open_source
    from kvconvert.methods.minicache.subspace import collect_pair_moments

    src = tokenized_model_dir("llama_gqa")
    source = open_source(str(src))
    chunks = calibration_set(src, None, 256, 64, 0).chunks
    moments = collect_pair_moments(source, adapter_for(source.config), [(1, 2)], chunks, progress=False)
    model = load_reference(src)
    out = model(chunks, use_cache=True)
    cache = out.past_key_values
    for side, name in enumerate(("keys", "values")):
        stacked = torch.cat([getattr(cache.layers[i], name).transpose(1, 2).flatten(2) for i in (1, 2)], dim=-1)
        x = stacked.reshape(-1, stacked.shape[-1]).double()
        mean, cov = moments.covariance(0, side)
        torch.testing.assert_close(mean, x.mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cov, torch.cov(x.T, correction=0), atol=1e-5, rtol=1e-4)
    assert int(moments.tokens[0]) == chunks.numel() and set(moments.query) == {1, 2}


def test_subspace_plan_without_a_dtype_still_reads_every_layer(tokenized_model_dir):
    """Without a dtype the element size comes from the first layer's weights, which the fit must still see."""
    from kvconvert.io.source import open_source
    from kvconvert.methods.minicache.method import MiniCacheMethod
    from kvconvert.pipeline import plan_conversion

    source = open_source(str(tokenized_model_dir("llama_gqa")))
    config = MiniCacheConfig(merge="subspace", kv_budget=0.6, calib_tokens=256)
    method = MiniCacheMethod(config)
    checkpoint, given = plan_conversion(source, method)  # the pipeline passes the converted dtype
    layers = (checkpoint.adapter.read_attention(checkpoint.read_layer(i)) for i in range(3))
    inferred = method.plan(PlanContext(checkpoint.layout, layers, source, progress=False))
    assert inferred.ranks == given.ranks and inferred.element_bytes == given.element_bytes == 4


@pytest.mark.parametrize("merge, bits, padded", [("slerp", "4", True), ("slerp", "3", True), ("slerp", "2", True),
                                                  ("slerp", "8", True),
                                                  ("average", "4", True), ("slerp", "4", False)])  # fmt: skip
@torch.no_grad()
def test_merged_codes_decode_equals_restoring_the_past(merge, bits, padded, tokenized_model_dir, tmp_path,
                                                        monkeypatch):  # fmt: skip
    """A CPU decode step reads the merged directions' codes with each layer's norms folded in (``merged_decode``),
    the unpaired layers theirs (``KiviLayer``); restoring each layer's past and running SDPA over it is the
    reference. A high ``gamma`` retains tokens on one side and not the other; sink, rotated values, a float tail
    and a left-padded row are all read (``padded``; else rows of one length: decode steps without a mask)."""
    src = tokenized_model_dir("llama_gqa")
    convert_minicache(src, tmp_path / "m", "--merge", merge, "--gamma", "0.4", "--kv-bits", bits, "--kv-group", "16",
                      "--kv-residual", "4", "--kv-sink", "2", "--kv-rotate")  # fmt: skip
    converted = load_converted(tmp_path / "m")
    package = type(converted).__module__.rsplit(".", 1)[0]  # the directory's own runtime (remote code)
    monkeypatch.setattr(sys.modules[f"{package}.kvconvert_folded"], "BYTE_CODES_MIN", 0)  # 8-bit: from a size on
    ids, mask = left_padded(length=40, pad=7 if padded else 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    fused = converted.generate(ids, **kwargs)
    cache = fused.past_key_values
    state = next(layer for layer in cache.layers if type(layer).__name__ == "PairState")
    streams = state.keys_merged, state.values_merged
    assert all(s.direction.blocks is not None for s in streams) and state.retained  # codes read, memo in use
    assert streams[0].retained.shape[0] != streams[1].retained.shape[0] or not torch.equal(
        streams[0].retained_at, streams[1].retained_at)  # fmt: skip
    assert any(type(layer).__name__ == "KiviLayer" and layer.routed for layer in cache.layers)
    assert_same_as_restoring(converted, type(state), fused, ids, kwargs)
