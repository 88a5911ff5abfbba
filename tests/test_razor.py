"""RazorAttention: exactness where nothing is dropped, eq. 5 by hand, head profiling, bounded cache."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvconvert.errors import KVConvertError
from kvconvert.eval.memory import cache_nbytes
from kvconvert.methods.razor.heads import HeadScores, profile_heads
from kvconvert.methods.razor.method import retrieval_kv_heads, top_heads
from kvconvert.runtime.kvconvert_razor import compensated_attention
from tests.conftest import build_tiny_model
from tests.helpers import assert_equivalent, convert, left_padded, load_converted, load_reference, run_cli


def convert_razor(src, dst, *extra: str) -> dict:
    return convert("razor", src, dst, "--profile-tokens", "16", *extra)


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt_neox", "gpt2"])
def test_all_heads_retrieval_is_exact(kind, tiny_model_dir, tmp_path):
    src = tiny_model_dir(kind)
    report = convert_razor(src, tmp_path / "razor", "--induction-frac", "1")
    assert all(r["retrieval_kv_heads"] for r in report["layers"])
    converted = load_converted(tmp_path / "razor")
    assert converted.config._attn_implementation == "kvconvert_razor"
    assert_equivalent(load_reference(src), converted, *left_padded())


def test_non_retrieval_heads_are_exact_while_nothing_is_dropped(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    convert_razor(src, tmp_path / "razor", "--induction-frac", "0", "--echo-frac", "0", "--window", "1000")
    assert_equivalent(load_reference(src), load_converted(tmp_path / "razor"), *left_padded())


def test_compensation_token_follows_eq5():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    k_hat, v_hat, n_d = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), 5.0
    scale = 0.5
    # eq. 5 written out: (N_d e^{q·k̂} v̂ + Σ e^{q·k_n} v_n) / (N_d e^{q·k̂} + Σ e^{q·k_n})
    w = [torch.exp(scale * (q[0, 0, 0] @ k[0, 0, n])) for n in range(3)]
    w_hat = n_d * torch.exp(scale * (q[0, 0, 0] @ k_hat[0, 0, 0]))
    expected = (w_hat * v_hat[0, 0, 0] + sum(w[n] * v[0, 0, n] for n in range(3))) / (w_hat + sum(w))
    got = compensated_attention(q, k, v, None, k_hat, v_hat, torch.tensor([n_d]), scale)
    torch.testing.assert_close(got[0, 0, 0], expected)
    # N_d = 0: the compensation token takes no weight
    plain = torch.softmax(scale * (q @ k.transpose(-1, -2)), -1) @ v
    torch.testing.assert_close(compensated_attention(q, k, v, None, k_hat, v_hat, torch.tensor([0.0]), scale), plain)


def test_a_chunk_attends_through_sdpa_as_eq5_says():
    """Chunks (prefill) attend through SDPA with the compensation token's ln N_d in its mask: equal to eq. 5's
    softmax (``compensated_attention``) for a GQA group's query heads, with masked keys, one row that dropped
    tokens and one that dropped none."""
    from kvconvert.runtime.kvconvert_razor_ops import count_logit, fused_attention, grouped_bias

    g = torch.Generator().manual_seed(1)
    batch, group, q_len, dim, others = 2, 2, 5, 8, [0, 2]
    query = torch.randn(batch, 3 * group, q_len, dim, generator=g)
    keys, values = torch.randn(batch, 2, 10, dim, generator=g), torch.randn(batch, 2, 10, dim, generator=g)
    comp_k, comp_v = torch.randn(batch, 2, 1, dim, generator=g), torch.randn(batch, 2, 1, dim, generator=g)
    count = torch.tensor([7.0, 0.0])
    bias = torch.where(torch.rand(batch, 1, q_len, 10, generator=g) < 0.3, torch.finfo(torch.float32).min, 0.0)
    rows = query.reshape(batch, 3, group * q_len, dim)[:, others]
    scores = grouped_bias(rows @ keys.transpose(-1, -2) * 0.3, bias, group)
    expected = compensated_attention(rows, keys, values, scores, comp_k, comp_v, count, 0.3)
    mask = torch.cat([bias, count_logit(count).view(-1, 1, 1, 1).expand(batch, 1, q_len, 1)], dim=-1)
    kv = torch.cat([keys, comp_k], dim=2), torch.cat([values, comp_v], dim=2)
    torch.testing.assert_close(fused_attention(query, others, group, kv, mask, 0.3), expected)


def test_a_16_bit_window_slides_along_its_room_holding_exactly_its_tokens():
    """A 16-bit store used as razor's window (a token in, the oldest out, every step) hands out exactly the tokens it
    should at every step, and keeps its buffer with room as it slides: a new buffer every few steps, not every step."""
    from kvconvert.runtime.kvconvert_codec import QuantSpec
    from kvconvert.runtime.kvconvert_tokenstore import TokenStore

    tokens = torch.randn(2, 3, 700, 4, generator=torch.Generator().manual_seed(3))
    store, window = TokenStore(QuantSpec(), per_channel=False), 256
    assert torch.equal(store.extend(tokens[:, :, :window]), tokens[:, :, :window])  # a prefill
    buffers = set()
    for t in range(window, tokens.shape[2]):
        held = store.extend(tokens[:, :, t : t + 1])
        assert torch.equal(held, tokens[:, :, t - window : t + 1])
        buffers.add(held.untyped_storage().data_ptr())
        assert torch.equal(store.take_front(1), tokens[:, :, t - window : t - window + 1])
        assert len(store) == window
    steps = tokens.shape[2] - window
    assert len(buffers) <= steps // 4, f"{len(buffers)} buffers in {steps} steps"


@torch.no_grad()
def test_whole_heads_decode_through_sdpa_as_plain_products_while_windows_slide(tokenized_model_dir, tmp_path,
                                                                                   monkeypatch):  # fmt: skip
    """16-bit razor: a decode step's whole heads through SDPA (their G query heads as G rows of one KV head) give the
    tokens and logits of the same attention as plain products (softmax, then the product), over 40 steps of a
    left-padded batch in which the other heads' windows of 20 tokens slide along their buffer."""
    import types

    import kvconvert
    from kvconvert.runtime import kvconvert_razor

    src = tokenized_model_dir("llama_gqa")
    convert("razor", src, tmp_path / "r", "--profile-tokens", "16", "--induction-frac", "0.3", "--echo-frac", "0",
            "--window", "20", "--window-frac", "0", "--sink", "2")  # fmt: skip
    ids, mask = left_padded()
    calls: list[str] = []

    def plain(query, keys, values, bias):
        scores = query.float() @ keys.float().transpose(-1, -2) * query.shape[-1] ** -0.5
        return (torch.softmax(scores if bias is None else scores + bias.float(), -1) @ values.float()).to(query.dtype)

    def whole(query, keys, values, attn_mask=None, scale=None):
        calls.append("whole")
        assert scale == query.shape[-1] ** -0.5
        return plain(query, keys, values, attn_mask)

    def run():
        model = kvconvert.load(tmp_path / "r").eval()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)  # fmt: skip
        return torch.stack(out.logits), out.sequences

    fused_logits, fused_tokens = run()
    monkeypatch.setattr(kvconvert_razor, "F", types.SimpleNamespace(scaled_dot_product_attention=whole))
    plain_logits, plain_tokens = run()
    assert calls
    assert torch.equal(fused_tokens, plain_tokens)
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compensation_logit_comes_in_the_dtype_asked_for(dtype):
    """Its mask column joins the query's dtype: SDPA on a GPU refuses a mask of another dtype (on a CPU it does
    not, so only this checks it here): ln N_d where tokens were dropped, the dtype's lowest value where none were."""
    from kvconvert.runtime.kvconvert_razor_ops import count_logit

    logit = count_logit(torch.tensor([7.0, 0.0]), dtype)
    assert logit.dtype == dtype and logit[1] == torch.finfo(dtype).min
    torch.testing.assert_close(logit[0].float(), torch.tensor(7.0).log(), rtol=1e-2, atol=0)


def test_head_scores_on_planted_attention_patterns():
    period, n = 5, 20
    rows = torch.arange(period, n)
    probs = torch.full((1, 3, rows.numel(), n), 0.01)
    probs[0, 0, torch.arange(rows.numel()), rows - period] = 0.9  # head 0: echo
    probs[0, 1, torch.arange(rows.numel()), rows - period + 1] = 0.9  # head 1: induction
    scores = HeadScores(num_layers=1, num_heads=3, period=period)
    scores.add(0, probs, rows)
    assert scores.echo[0].argmax() == 0 and scores.induction[0].argmax() == 1
    assert scores.echo[0, 0] == pytest.approx(0.9) and scores.induction[0, 1] == pytest.approx(0.9)


@torch.no_grad()
def test_profiling_finds_a_planted_echo_head():
    """GPT-2 without position embeddings whose head (0, 0) has W_Q = W_K = 8·I: each query is most
    similar to the earlier copies of its own token, i.e. an echo head."""
    model = build_tiny_model("gpt2")
    attn = model.transformer.h[0].attn
    d, head = 64, 16
    model.transformer.wpe.weight.zero_()
    eye = 8.0 * torch.eye(d)[:, :head]  # Conv1D weight [in, out]: first head reads the input's first 16 dims
    attn.c_attn.weight[:, :head] = eye  # q of head 0
    attn.c_attn.weight[:, d : d + head] = eye  # k of head 0
    attn.c_attn.bias.zero_()
    scores = profile_heads(model, tokens=24, exclude=set(), progress=False)
    assert torch.argmax(scores.echo.flatten()) == 0, scores.echo


def test_top_heads_and_gqa_grouping():
    scores = torch.tensor([[0.1, 0.9, 0.2, 0.3], [0.5, 0.0, 0.0, 0.8]])
    assert top_heads(scores, 0.25) == {(0, 1), (1, 3)}
    assert top_heads(scores, 0.0) == set()
    # 4 query heads sharing 2 KV heads: query head 1 → KV 0, query head 3 → KV 1
    assert retrieval_kv_heads({(0, 1), (1, 3)}, 2, group=2) == [[0], [1]]


@torch.no_grad()
def test_non_retrieval_cache_stays_bounded(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    convert_razor(src, tmp_path / "razor", "--induction-frac", "0.2", "--echo-frac", "0", "--window", "8",
                  "--window-frac", "0.1", "--sink", "2")  # fmt: skip
    converted, reference = load_converted(tmp_path / "razor"), load_reference(src)
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                  return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    cache = converted.generate(ids, **kwargs).past_key_values
    total = 24 + 39
    budget = max(8, int(total * 0.1))
    for layer in cache.layers:
        if layer.others:
            assert layer.sink_k.shape[2] == 2 and len(layer.recent_k) == budget
            # the storage itself is bounded too, not just the visible slice
            recent = layer.recent_k.tail
            assert (
                recent.shape[2] == budget
                and recent.untyped_storage().nbytes() == recent.numel() * recent.element_size()
            )
            # dropped = total − sink − recent; the padded row's 7 padding tokens are never compensated
            assert layer.comp_count.tolist() == [total - 2 - budget, total - 2 - budget - 5]
    ref_cache = reference.generate(ids, **kwargs).past_key_values
    assert cache_nbytes(cache) < 0.8 * cache_nbytes(ref_cache)


def test_kv_budget_sets_window_fraction(tiny_model_dir, tmp_path):
    report = convert_razor(tiny_model_dir("llama_gqa"), tmp_path / "r", "--induction-frac", "0.2", "--echo-frac",
                           "0", "--kv-budget", "0.6")  # fmt: skip
    spec = json.loads((tmp_path / "r" / "config.json").read_text())["kvconvert"]["razor"]
    share = sum(len(r["retrieval_kv_heads"]) for r in report["layers"]) / (3 * 2)
    assert spec["window_frac"] == pytest.approx((0.6 - share) / (1 - share))
    assert report["kv_budget_expected"] == pytest.approx(0.6)
    with pytest.raises(KVConvertError, match="not above the retrieval heads' share"):
        from kvconvert.io.source import open_source
        from kvconvert.methods.razor.method import RazorConfig, RazorMethod
        from kvconvert.pipeline import convert

        method = RazorMethod(RazorConfig(induction_frac=1.0, kv_budget=0.5, profile_tokens=16))
        convert(open_source(str(tiny_model_dir("llama_gqa"))), method, tmp_path / "x", progress=False)


def test_chunked_eval_sees_dropped_tokens(tiny_model_dir, tmp_path):
    """A single forward attends over everything (same ppl as the original); feeding the same text
    through the cache in chunks makes non-retrieval heads drop tokens, and ppl changes."""
    from kvconvert.eval.quality import evaluate_quality

    src = tiny_model_dir("llama_gqa")
    convert_razor(src, tmp_path / "razor", "--induction-frac", "0", "--echo-frac", "0", "--window", "4",
                  "--window-frac", "0", "--sink", "1")  # fmt: skip
    razor, reference = load_converted(tmp_path / "razor"), load_reference(src)
    ids = torch.randint(3, 90, (96,), generator=torch.Generator().manual_seed(4))
    single = evaluate_quality(razor, ids, 96, reference=reference)
    assert single.kl_mean == pytest.approx(0.0, abs=1e-9)
    chunked = evaluate_quality(razor, ids, 96, reference=reference, chunk=8)
    assert chunked.kl_mean > 1e-4 and chunked.ppl != pytest.approx(single.ppl, rel=1e-4)


def test_two_checkpoints_in_one_process_keep_their_own_behaviour(tiny_model_dir, tmp_path):
    """Each directory loaded with remote code registers its own copy of razor's attention function
    under one name; the first model must still run its own cache and code afterwards."""
    src = tiny_model_dir("llama_gqa")
    convert_razor(src, tmp_path / "exact", "--induction-frac", "1")
    convert_razor(src, tmp_path / "lossy", "--induction-frac", "0", "--echo-frac", "0", "--window", "2",
                  "--window-frac", "0", "--sink", "1")  # fmt: skip
    exact = load_converted(tmp_path / "exact")
    lossy = load_converted(tmp_path / "lossy")
    assert_equivalent(load_reference(src), exact, *left_padded())
    assert type(exact(torch.ones(1, 3, dtype=torch.long), use_cache=True).past_key_values.layers[0]).__module__ != (
        type(lossy(torch.ones(1, 3, dtype=torch.long), use_cache=True).past_key_values.layers[0]).__module__
    )


@pytest.mark.parametrize("kind", ["llama_gqa", "gpt_neox", "gpt2"])
def test_layer_by_layer_profile_equals_the_loaded_model(kind, tiny_model_dir):
    """Razor profiles one decoder layer at a time (conversion memory: one layer); the scores are
    those of the whole model loaded at once."""
    from kvconvert.arch import adapter_for
    from kvconvert.io.source import open_source
    from kvconvert.methods.razor.heads import profile_heads, profile_heads_layer_by_layer

    source = open_source(str(tiny_model_dir(kind)))
    whole = profile_heads(load_reference(tiny_model_dir(kind)), 16, {0}, seed=3, progress=False)
    layered = profile_heads_layer_by_layer(source, adapter_for(source.config), 16, {0}, seed=3, progress=False)
    torch.testing.assert_close(layered.induction, whole.induction, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layered.echo, whole.echo, rtol=1e-5, atol=1e-6)
    assert whole.induction.abs().sum() > 0


@torch.no_grad()
@pytest.mark.parametrize("bits", [4, 2, 8])
def test_windows_in_kivi_layout_decode_from_their_codes_while_they_slide(bits, tokenized_model_dir, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """Razor + KIVI-layout storage on a CPU: the other heads' windows are read from their codes (``kivi_decode`` with
    razor's sink and compensation token as extra exact tokens), as the retrieval heads already were: the same tokens
    and logits as dequantizing the windows, over 40 steps of a left-padded batch in which windows of 20 tokens slide
    through 8-token blocks, a whole block leaving at once (``TokenStore.whole_front``: 20 to 27 tokens held)."""
    import kvconvert
    from kvconvert.runtime import kvconvert_folded, kvconvert_quant, kvconvert_razor

    src = tokenized_model_dir("llama_gqa")
    convert("razor", src, tmp_path / "r", "--profile-tokens", "16", "--induction-frac", "0.3", "--echo-frac", "0",
            "--window", "20", "--window-frac", "0", "--sink", "2", "--kv-bits", str(bits), "--kv-group", "8",
            "--kv-residual", "8", "--kv-sink", "2", "--kv-rotate")  # fmt: skip
    ids, mask = left_padded()
    windows = []
    original = kvconvert_razor.kivi_decode

    def recorded(*args, **kwargs):
        if kwargs.get("extra") is not None:  # the window's store: whether its front slid, what it holds
            windows.append((args[4].front_dropped, len(args[4]), args[4].offset))
        return original(*args, **kwargs)

    def run():
        model = kvconvert.load(tmp_path / "r").eval()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, pad_token_id=0)  # fmt: skip
        return torch.stack(out.logits), out.sequences

    monkeypatch.setattr(kvconvert_razor, "kivi_decode", recorded)
    monkeypatch.setattr(kvconvert_folded, "BYTE_CODES_MIN", 0)  # 8-bit codes are read from a size these are not
    codes_logits, codes_tokens = run()
    slid = [(held, offset) for dropped, held, offset in windows if dropped]
    assert slid and len(slid) < len(windows), "the windows were not read from their codes while sliding"
    assert {held for held, _ in slid} == set(range(20, 28)) and not any(offset for _, offset in slid)
    monkeypatch.setattr(kvconvert_razor, "kivi_kernel_reads", lambda *args, **kwargs: False)
    monkeypatch.setattr(kvconvert_quant, "kivi_kernel_reads", lambda *args, **kwargs: False)
    windows.clear()
    float_logits, float_tokens = run()
    assert not windows
    assert torch.equal(codes_tokens, float_tokens)
    # at 8 bits a code is range/255 wide: the two paths' float32 roundings (~2e-6 in a layer's new states) now and then
    # round a later layer's token to the next code, which moves logits by ~1e-4 (seen: 2.4e-4, tokens equal)
    tolerance = 1e-3 if bits == 8 else 1e-4
    torch.testing.assert_close(codes_logits, float_logits, rtol=tolerance, atol=tolerance)


def _windowed_reference(q, k, v, row, sink, kept_recent, scaling):
    """Razor's windowed attention of one query row, written out token by token: the kept tokens' logits and the
    compensation token's (mean dropped key, logit + ln N_d) in one softmax."""
    dropped = [p for p in range(sink, row + 1) if p <= row - kept_recent]
    kept = [p for p in range(row + 1) if p not in dropped]
    logits = [float(q @ k[p]) * scaling for p in kept]
    tokens = [v[p] for p in kept]
    if dropped:
        mean_k, mean_v = k[dropped].mean(0), v[dropped].mean(0)
        logits.append(float(q @ mean_k) * scaling + math.log(len(dropped)))
        tokens.append(mean_v)
    weights = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
    return sum(w * t for w, t in zip(weights, tokens, strict=True))


def test_window_errors_follow_razors_windowed_attention_through_the_output_projection():
    from kvconvert.linalg import head_output_grams
    from kvconvert.methods.razor.heads import window_errors

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, n, dk, sink, window, frac = 4, 2, 40, 8, 2, 6, 0.25
    q, k, v = (torch.randn(h, n, dk, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    o_weight = torch.randn(12, heads * dk, generator=g, dtype=torch.float64)
    rows = torch.tensor([9, 25, 39])
    got = window_errors(q, k, v, rows, sink, window, frac, head_output_grams(o_weight, heads, dk), 0.3)
    expected = torch.zeros(heads, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[h // (heads // kv_heads)], v[h // (heads // kv_heads)]
        for row in rows.tolist():
            probs = torch.softmax((q[h, row] @ kh[: row + 1].T) * 0.3, 0)
            full = probs @ vh[: row + 1]
            kept_recent = max(window, int((row + 1) * frac))
            approx = _windowed_reference(q[h, row], kh, vh, row, sink, kept_recent, 0.3)
            expected[h] += (o_weight[:, h * dk : (h + 1) * dk] @ (full - approx)).norm() / len(rows)
    torch.testing.assert_close(got, expected)
    assert (got > 0).all()
    # a window that holds every token changes nothing
    nothing = window_errors(q, k, v, rows, sink, n, frac, head_output_grams(o_weight, heads, dk), 0.3)
    torch.testing.assert_close(nothing, torch.zeros(heads, dtype=torch.float64), atol=1e-12, rtol=0)


def test_costliest_kv_heads_rank_whole_groups_of_the_layers_given():
    from kvconvert.methods.razor.method import costliest_kv_heads

    errors = torch.tensor([[0.1, 0.1, 5.0, 0.0], [0.4, 0.4, 0.3, 0.3], [9.0, 9.0, 9.0, 9.0]])  # 2 KV heads of 2
    assert costliest_kv_heads(errors, (0, 1), group=2, count=2) == [[1], [0], []]  # layer 2 is not compressed
    assert costliest_kv_heads(errors, (0, 1), group=2, count=0) == [[], [], []]
    assert costliest_kv_heads(errors, (0, 1, 2), group=2, count=3) == [[1], [], [0, 1]]


def test_heads_by_window_error_keeps_the_share_asked_and_converts(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    report = convert("razor", src, tmp_path / "half", "--heads-by", "window-error", "--whole-share", "0.5",
                     "--profile-context", "128", "--window", "8", "--window-frac", "0")  # fmt: skip
    kept = [r["retrieval_kv_heads"] for r in report["layers"]]
    assert sum(map(len, kept)) == 3  # half of 3 layers × 2 KV heads
    errors = torch.tensor([r["window_errors"] for r in report["layers"]]).view(3, 2, -1).sum(-1)
    assert min(errors[i, g] for i, row in enumerate(kept) for g in row) >= max(
        errors[i, g] for i, row in enumerate(kept) for g in range(2) if g not in row
    )
    assert "induction_scores" not in report["layers"][0]
    spec = json.loads((tmp_path / "half" / "config.json").read_text())["kvconvert"]["razor"]
    assert spec["retrieval_kv_heads"] == kept
    # the recipe names this ranking's options, not induction's, and repeats the conversion
    assert report["params"]["heads_by"] == "window-error" and "induction_frac" not in report["params"]
    recipe, again_dir = tmp_path / "half" / "recipe.yaml", tmp_path / "again"
    again = run_cli("run", str(recipe), "--model", str(src), "--out", str(again_dir), "--quiet")
    assert again.exit_code == 0, again.output
    assert json.loads((again_dir / "kvconvert.json").read_text())["layers"] == report["layers"]
    # every head whole: the source's outputs exactly
    convert("razor", src, tmp_path / "all", "--heads-by", "window-error", "--whole-share", "1", "--profile-context",
            "128")  # fmt: skip
    assert_equivalent(load_reference(src), load_converted(tmp_path / "all"), *left_padded())


def test_window_errors_are_measured_on_the_layers_razor_windows_only(tokenized_model_dir, tmp_path):
    # Gemma 3's sliding layers keep transformers' own window: an error razor's window would make there is not one
    # the checkpoint can make, so those rows stay 0 and only the global layer's KV head is a candidate
    src = tokenized_model_dir("gemma3")
    report = convert("razor", src, tmp_path / "out", "--heads-by", "window-error", "--whole-share", "1",
                     "--profile-context", "128", "--window", "8", "--window-frac", "0")  # fmt: skip
    errors = [max(r["window_errors"]) for r in report["layers"]]
    assert errors[0] == errors[2] == 0 and errors[1] > 0, errors
    assert [r["retrieval_kv_heads"] for r in report["layers"]] == [[], [0], []]


def test_heads_by_window_error_refuses_windows_the_text_or_model_cannot_hold(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    calib = tmp_path / "short.txt"
    calib.write_text("a few words only. " * 3)
    for extra, words in ((("--calib", str(calib)), "--profile-context"), (("--profile-context", "100000"), "context")):
        result = run_cli("razor", "--model", str(src), "--out", str(tmp_path / "out"), "--heads-by", "window-error",
                         "--profile-context", "128", *extra)  # fmt: skip
        assert result.exit_code == 2 and words in result.output, result.output
        assert not (tmp_path / "out").exists()
