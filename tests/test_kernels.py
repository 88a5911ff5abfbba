"""Triton decode kernels against their plain-torch references (same signature), over a grid of
shapes and dtypes; on CPU through TRITON_INTERPRET=1 (set in conftest), natively on a GPU."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from kvconvert.runtime import kvconvert_folded
from kvconvert.runtime.kvconvert_codec import QuantSpec, dequantize_tokens, quantize_tokens
from kvconvert.runtime.kvconvert_folded import kivi_decode_folded, merge_partials
from kvconvert.runtime.kvconvert_fp8_kernel import fp8_decode_reference, fp8_decode_triton
from kvconvert.runtime.kvconvert_kernels import (
    HeadColumns,
    packed_decode_reference,
    packed_decode_triton,
    razor_decode_reference,
    razor_decode_triton,
    triton_available,
)
from kvconvert.runtime.kvconvert_kivi_kernel import kivi_decode_reference, kivi_decode_triton

pytestmark = pytest.mark.slow  # Triton's interpreter / wheel builds: minutes; `make test-fast` skips them

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Both sides read the same half-precision inputs and compute in float32; they differ only in the
# order of float32 sums (tiles of 32 tokens, online softmax rescaling), i.e. by a few ulps of the
# result, so one float32 tolerance holds for every input dtype. Any indexing or masking mistake
# moves results by O(1).
TOL = dict(atol=2e-5, rtol=2e-5)
NEG = torch.finfo(torch.float32).min


def test_triton_is_installed_for_the_tests():
    assert triton_available(), "pip install -e '.[kernels]' (make install does)"


def layout(name: str) -> tuple[HeadColumns, int, int, int]:
    """(columns, query width, key width, value width) of the cache layouts the runtimes use."""
    if name == "zack":  # 2 KV groups of 2 query heads, odd per-group widths, packed side by side
        wk_g, wv_g, group = [5, 13], [7, 1], 2
        heads = 4
        wk, wv = [wk_g[h // group] for h in range(heads)], [wv_g[h // group] for h in range(heads)]
        cols = HeadColumns.build([sum(wk_g[: h // group]) for h in range(heads)], wk,
                                 [sum(wv_g[: h // group]) for h in range(heads)], wv, DEVICE)  # fmt: skip
        return cols, sum(wk), sum(wk_g), sum(wv_g)
    if name == "lorc":  # one latent (r_k = 9, r_v = 6) shared by 3 heads
        cols = HeadColumns.build([0, 0, 0], [9] * 3, [0, 0, 0], [6] * 3, DEVICE)
        return cols, 27, 9, 6
    if name == "slim":  # 2 heads of dk = 8 on RoPE'd keys; values = whole pre-RoPE key rows (e = 16)
        cols = HeadColumns.build([0, 8], [8, 8], [0, 0], [16, 16], DEVICE)
        return cols, 16, 16, 16
    if name == "wide":  # values wider than one value block (chunked grid): 3 chunks of 64
        cols = HeadColumns.build([0], [3], [0], [150], DEVICE)
        return cols, 3, 3, 150
    raise ValueError(name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["zack", "lorc", "slim", "wide"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 33), (2, 70)])
@pytest.mark.parametrize("splits", [None, 3], ids=["auto-splits", "3-splits"])
def test_packed_decode_matches_reference(name, batch, tokens, dtype, splits):
    torch.manual_seed(batch * 100 + tokens)
    cols, wq, wk, wv = layout(name)
    query = torch.randn(batch, wq, device=DEVICE).to(dtype)
    keys = torch.randn(batch, tokens, wk, device=DEVICE).to(dtype)
    values = torch.randn(batch, tokens, wv, device=DEVICE).to(dtype)
    bias = torch.zeros(batch, tokens, device=DEVICE)
    bias[-1, : tokens // 3] = NEG  # left padding in the last row
    for b in (bias, None):
        expected = packed_decode_reference(query, keys, values, b, cols, 0.37)
        got = packed_decode_triton(query, keys, values, b, cols, 0.37, value_block=64, splits=splits)
        torch.testing.assert_close(got, expected, **TOL)


def test_packed_decode_is_attention():
    """The reference itself against SDPA on a plain GQA layout (4 query heads, 2 KV heads, dk 8)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    cols = HeadColumns.build([0, 0, 8, 8], [8] * 4, [0, 0, 8, 8], [8] * 4, "cpu")
    got = packed_decode_reference(q.reshape(2, 32), k.transpose(1, 2).reshape(2, 11, 16),
                                  v.transpose(1, 2).reshape(2, 11, 16), None, cols, 8**-0.5)  # fmt: skip
    torch.testing.assert_close(got.view(2, 4, 8), expected[:, :, 0], **TOL)


def test_longest_heads_are_scheduled_first():
    cols = HeadColumns.build([0, 0, 0], [1, 9, 4], [0, 0, 0], [1, 9, 2], "cpu")
    assert cols.order.tolist() == [1, 2, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kinds", [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], ids=["mixed", "none-kept", "all-kept"])
@pytest.mark.parametrize("full_len,short_len", [(1, 1), (40, 9), (65, 33)])
@pytest.mark.parametrize("splits", [None, 3], ids=["auto-splits", "3-splits"])
def test_razor_decode_matches_reference(kinds, full_len, short_len, dtype, splits):
    torch.manual_seed(full_len)
    batch, dim, group = 2, 12, 2
    query = torch.randn(batch, 4, dim, device=DEVICE).to(dtype)
    kind = torch.tensor(kinds, device=DEVICE)
    # KV head g = h // group is retrieval (kind 0) or not; slots count within each kind
    kv_kinds = kinds[::group]
    slot = torch.tensor([kv_kinds[: h // group].count(kinds[h]) for h in range(4)], device=DEVICE)
    retrieval, others = max(1, kv_kinds.count(0)), max(1, kv_kinds.count(1))
    full_k, full_v = (torch.randn(batch, retrieval, full_len, dim, device=DEVICE).to(dtype) for _ in range(2))
    short_k, short_v = (torch.randn(batch, others, short_len, dim, device=DEVICE).to(dtype) for _ in range(2))
    comp_k, comp_v = (torch.randn(batch, others, dim, device=DEVICE).to(dtype) for _ in range(2))
    full_bias, short_bias = torch.zeros(batch, full_len, device=DEVICE), torch.zeros(batch, short_len, device=DEVICE)
    full_bias[1, : full_len // 2] = NEG
    comp_logit = torch.tensor([math.log(17.0), NEG], device=DEVICE)  # row 1: nothing dropped yet
    args = (
        query,
        full_k,
        full_v,
        full_bias,
        short_k,
        short_v,
        short_bias,
        comp_k,
        comp_v,
        comp_logit,
        kind,
        slot,
        0.29,
    )
    torch.testing.assert_close(razor_decode_triton(*args, splits=splits), razor_decode_reference(*args), **TOL)


def test_razor_reference_is_eq5():
    """One head by hand: softmax over kept tokens plus the compensation token weighted by N_d."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    ck, cv = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    n_d, scale = 5.0, 0.5
    w = [torch.exp(scale * (q[0, 0] @ k[0, 0, i])) for i in range(3)]
    w_c = n_d * torch.exp(scale * (q[0, 0] @ ck[0, 0]))
    expected = (w_c * cv[0, 0] + sum(w[i] * v[0, 0, i] for i in range(3))) / (w_c + sum(w))
    no_bias, other, first = torch.zeros(1, 3), torch.tensor([1]), torch.tensor([0])
    log_n = torch.tensor([math.log(n_d)])
    got = razor_decode_reference(q, k, v, no_bias, k, v, no_bias, ck, cv, log_n, other, first, scale)
    torch.testing.assert_close(got[0, 0], expected, **TOL)


# -- quantized storage in KIVI's layout ------------------------------------------------------


def kivi_cache(batch: int, kv_heads: int, dim: int, block: int, blocks: int, value_group: int, dtype: torch.dtype):
    """Random keys and values ``[b, Hkv, blocks·block, d]`` in 4-bit KIVI storage (the codec's own quantizer), and
    the same cache dequantized by the codec."""
    keys, values = (torch.randn(batch, kv_heads, blocks * block, dim, device=DEVICE).to(dtype) for _ in range(2))
    k, v = quantize_tokens(keys, 4, block, True), quantize_tokens(values, 4, value_group, False)
    plain = (dequantize_tokens(k, 4, block, dim, True, torch.float32),
             dequantize_tokens(v, 4, value_group, dim, False, torch.float32))  # fmt: skip
    return (k.codes, k.scale, k.zero, v.codes, v.scale, v.zero), plain


def attention(query, keys, values, bias, scale):
    """Plain softmax attention ``[b, Hkv, G, d]`` over ``[b, Hkv, n, d]``, ``bias [b, n]``."""
    scores = torch.einsum("bhgd,bhnd->bhgn", query.float(), keys) * scale
    return torch.softmax(scores if bias is None else scores + bias[:, None, None], -1) @ values


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "batch,kv_heads,group,dim,block,blocks,value_group",
    [(2, 2, 3, 64, 32, 3, 64), (1, 1, 4, 32, 64, 5, 16), (3, 3, 1, 64, 32, 4, 128), (1, 2, 8, 128, 32, 2, 64)],
)
@pytest.mark.parametrize("splits", [None, 3], ids=["auto-splits", "3-splits"])
@pytest.mark.parametrize(("tile", "split", "magic"), [(0, False, False), (128, False, False), (128, True, False),
                                                    (128, False, True), (128, True, True)],
                         ids=["per-block", "tiles", "split-tiles", "tiles-magic", "split-tiles-magic"])  # fmt: skip
def test_kivi_decode_matches_reference(batch, kv_heads, group, dim, block, blocks, value_group, dtype, splits, tile,
                                       split, magic):  # fmt: skip
    """The kernel's partial softmax (merged; values read per element or per channel group), and the torch reader's
    that folds the scales (``kivi_decode_folded``), against the plain-torch reference and against attention over the
    codec's own dequantized cache: channel scales per block, value scales per token and channel group, padding."""
    torch.manual_seed(blocks * 10 + dim)
    cache, (keys, values) = kivi_cache(batch, kv_heads, dim, block, blocks, value_group, dtype)
    query = torch.randn(batch, kv_heads, group, dim, device=DEVICE).to(dtype)
    bias = torch.zeros(batch, blocks * block, device=DEVICE)
    bias[-1, : block + 3] = NEG  # left padding over a whole block and more in the last row
    for b in (bias, None):
        expected = attention(query, keys, values, b, 0.3)
        reference = merge_partials([kivi_decode_reference(query, *cache, b, 0.3)])
        kernel = dict(splits=splits, tile=tile, split_tiles=split, magic=magic)
        got = merge_partials([kivi_decode_triton(query, *cache, b, 0.3, precise=True, **kernel)])
        torch.testing.assert_close(reference, expected, **TOL)
        torch.testing.assert_close(got, expected, **TOL)
        torch.testing.assert_close(merge_partials([kivi_decode_folded(query, *cache, b, 0.3)]), expected, **TOL)
        # half-precision queries take TF32 products on a GPU (the interpreter computes them in float32), the tile
        # kernel the query's own 16-bit operands (a float16 query in the interpreter too)
        fast = merge_partials([kivi_decode_triton(query, *cache, b, 0.3, **kernel)])
        low = tile and DEVICE == "cuda" and dtype != torch.float32
        torch.testing.assert_close(fast, expected, atol=2e-2 if low else 3e-3, rtol=1e-2 if low else 3e-3)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NaN warnings, where the NaN is the point
@pytest.mark.parametrize("splits", [None, 3], ids=["auto-splits", "3-splits"])
@pytest.mark.parametrize(("tile", "split"), [(0, False), (64, False), (128, False), (128, True), (100, True)],
                         ids=["per-block", "tiles-64", "tiles-128", "split-tiles-128", "tiles-100"])  # fmt: skip
def test_kivi_kernel_reads_only_the_length_given(splits, tile, split):
    """A static cache's blocks not quantized yet: with ``length`` (read on the device) the kernel gives attention over
    the first ``length`` tokens and never reads the blocks after them (their scales made NaN: the same result, bit
    for bit; without ``length`` the NaN shows). A tile of no whole power of two of blocks (100 tokens) is read as the
    largest one below it."""
    torch.manual_seed(7)
    cache, (keys, values) = kivi_cache(2, 2, 64, 32, 5, 64, torch.float32)
    query = torch.randn(2, 2, 4, 64, device=DEVICE)
    length = torch.tensor(2 * 32, device=DEVICE)
    bias = torch.zeros(2, 5 * 32, device=DEVICE)
    bias[:, 64:] = NEG
    expected = attention(query, keys[:, :, :64], values[:, :, :64], None, 0.3)

    def decoded(**kwargs):
        kernel = dict(splits=splits, precise=True, tile=tile, split_tiles=split)
        return merge_partials([kivi_decode_triton(query, *cache, bias, 0.3, **kernel, **kwargs)])

    got = decoded(length=length)
    torch.testing.assert_close(got, expected, **TOL)
    _, key_scale, _, _, value_scale, _ = cache
    key_scale[:, :, 2:] = float("nan")  # read, a NaN would reach every output through the softmax's max
    value_scale[:, :, 64:] = float("nan")
    torch.testing.assert_close(decoded(length=length), got, rtol=0, atol=0)
    assert decoded().isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("batch", "kv_heads", "group", "dim", "tokens", "per_head", "length"),
                         [(2, 2, 4, 32, 70, True, None), (1, 3, 1, 64, 33, False, None), (2, 1, 8, 16, 130, True, 100),
                          (3, 2, 2, 128, 9, False, 5)])  # fmt: skip
@pytest.mark.parametrize("splits", [None, 3], ids=["auto-splits", "3-splits"])
@pytest.mark.parametrize("native", [True, False], ids=["fp8-convert", "bit-moves"])
def test_fp8_decode_matches_reference(batch, kv_heads, group, dim, tokens, per_head, length, dtype, splits, native):
    """The fp8 kernel against attention over the codes' values in float32: GQA groups of 1-8 (padded to a 16-row
    dot), heads of 16-128, scales per tensor or per KV head, left padding (a bias), a length read on the device
    (a static cache's slots not written yet: filled with codes that would change the result if read), one or three
    splits, e4m3 converted natively (sm_89 on) or by moving bits (sm_80). float16 and, on a GPU, bfloat16 queries
    take half-precision products (the probabilities rounded to the query's dtype, as flash attention does)."""
    g = torch.Generator().manual_seed(tokens + dim)
    q = torch.randn(batch, kv_heads, group, dim, generator=g).to(DEVICE, dtype)
    k, v = (3 * torch.randn(batch, kv_heads, tokens, dim, generator=g) for _ in range(2))
    keys, values = k.to(torch.float8_e4m3fn).view(torch.uint8).to(DEVICE), v.to(torch.float8_e4m3fn).to(DEVICE)
    key_scale, value_scale = (torch.rand(kv_heads if per_head else 1, generator=g).to(DEVICE) + 0.1 for _ in range(2))
    bias = torch.zeros(batch, tokens, device=DEVICE)
    bias[1:, : tokens // 3] = NEG  # rows after the first left-padded
    at = None if length is None else torch.tensor(length, device=DEVICE)
    ref = fp8_decode_reference(q, keys, values, key_scale, value_scale, bias, dim**-0.5, at)
    out = fp8_decode_triton(q, keys, values, key_scale, value_scale, bias, dim**-0.5, at, splits=splits, native=native)
    half = dtype == torch.float16 or (dtype == torch.bfloat16 and DEVICE == "cuda")
    torch.testing.assert_close(out, ref, **(dict(atol=2e-2, rtol=1e-2) if half else TOL))
    # a cache cropped along its tokens (assisted decoding): read in place, the same result
    cropped = [torch.cat([c, c], dim=2)[:, :, :tokens] for c in (keys, values)]
    again = fp8_decode_triton(q, *cropped, key_scale, value_scale, bias, dim**-0.5, at, splits=splits, native=native)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    if at is not None:  # what lies past the length is never read
        keys[:, :, length:] = 0x7E  # e4m3 448
        moved = fp8_decode_triton(q, keys, values, key_scale, value_scale, bias, dim**-0.5, at, splits=splits)
        torch.testing.assert_close(moved, out, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(
    "dim,block,value_group", [(64, 32, 64), (32, 64, 16), (128, 32, 64), (48, 32, 32), (54, 32, 32), (26, 32, 8)]
)
@pytest.mark.parametrize("peak", [1.0, 40.0], ids=["plain", "peaked"])
@pytest.mark.parametrize("piece_bytes", [None, 1, 6000], ids=["whole", "single", "pieces"])
def test_folded_reader_is_attention_over_the_dequantized_codes(bits, dim, block, value_group, peak, piece_bytes,
                                                               monkeypatch):  # fmt: skip
    """``kivi_decode_folded`` at 2, 3, 4 and 8 bits (4 codes a byte, 8 in three bytes, 2 a byte, 1), heads that are
    not a power of two (48: value groups padded; 54 and 26, groups of 27 and 7 channels: groups that end inside a
    packed byte), left padding: attention over the codec's own dequantized cache. A peaked
    query (scores hundreds apart: most of them more than ``EXP_FLOOR`` below their row's largest, where the reader
    floors them before ``torch.exp``) too: the far tokens weigh nothing that shows. Codes widened whole, a block or
    token at a time, or in pieces of a few (``PLANE_BYTES``; the last one short): the same attention."""
    from kvconvert.runtime import kvconvert_folded
    from kvconvert.runtime.kvconvert_folded import EXP_FLOOR, kivi_folded_fits

    if piece_bytes is not None:
        monkeypatch.setattr(kvconvert_folded, "PLANE_BYTES", piece_bytes)
    torch.manual_seed(dim + bits)
    keys, values = (torch.randn(2, 2, 3 * block, dim) for _ in range(2))
    k, v = quantize_tokens(keys, bits, block, True), quantize_tokens(values, bits, value_group, False)
    plain_k = dequantize_tokens(k, bits, block, dim, True, torch.float32)
    plain_v = dequantize_tokens(v, bits, value_group, dim, False, torch.float32)
    assert kivi_folded_fits(bits, block)
    query, bias = peak * torch.randn(2, 2, 3, dim), torch.zeros(2, 3 * block)
    bias[-1, : block + 5] = NEG
    if peak > 1:
        scores = torch.einsum("bhgd,bhnd->bhgn", query, plain_k) * 0.3
        assert ((scores - scores.amax(-1, keepdim=True)) < EXP_FLOOR).float().mean() > 0.5
    got = kivi_decode_folded(query, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, bias, 0.3, bits, bits)
    # scores in the hundreds: the two orders of float32 products differ by ~1e-5 of them, a few 1e-5 in the output
    tolerance = TOL if peak == 1 else dict(atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(merge_partials([got]), attention(query, plain_k, plain_v, bias, 0.3), **tolerance)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_folded_reads_take_per_token_factors_and_per_channel_values(bits):
    """What MiniCache reads folded: per-token factors on the stored keys and values (``kivi_decode_folded``'s
    ``key_factor`` / ``value_factor``: merged directions times a layer's norms) against attention over the scaled
    dequantized cache, and a store quantized per channel mixed by weights (``folded_channel_mix``: subspace
    latents) and scored (``folded_scores``) against plain products with its dequantized tokens."""
    from kvconvert.runtime.kvconvert_folded import folded_channel_mix, folded_scores

    torch.manual_seed(bits)
    block, dim, n = 32, 64, 96
    keys, values = (torch.randn(2, 2, n, dim) for _ in range(2))
    k, v = quantize_tokens(keys, bits, block, True), quantize_tokens(values, bits, dim, False)
    plain_k = dequantize_tokens(k, bits, block, dim, True, torch.float32)
    plain_v = dequantize_tokens(v, bits, dim, dim, False, torch.float32)
    query, bias = torch.randn(2, 2, 3, dim), torch.zeros(2, n)
    bias[-1, :5] = NEG
    k_factor, v_factor = torch.rand(2, n) + 0.5, torch.rand(2, n) + 0.5
    got = kivi_decode_folded(query, k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, bias, 0.3, bits, bits,
                             k_factor, v_factor)  # fmt: skip
    expected = attention(query, plain_k * k_factor[:, None, :, None], plain_v * v_factor[:, None, :, None], bias, 0.3)
    torch.testing.assert_close(merge_partials([got]), expected, **TOL)
    latents = torch.randn(2, n, 40)  # [b, n, r] per channel: blocks of 32 tokens
    z = quantize_tokens(latents, bits, block, True)
    plain_z = dequantize_tokens(z, bits, block, 40, True, torch.float32)
    weights, x = torch.rand(2, 5, n), torch.randn(2, 5, 40)
    sums = dict(atol=1e-4, rtol=1e-4)  # sums of ~100 products of magnitude ~1: float32 rounding in another order
    torch.testing.assert_close(folded_channel_mix(weights, z.codes, z.scale, z.zero, bits), weights @ plain_z, **sums)
    scores = folded_scores(x[:, None], z.codes[:, None], z.scale[:, None], z.zero[:, None], bits)[:, 0]
    torch.testing.assert_close(scores, x @ plain_z.transpose(1, 2), **sums)


def test_merge_partials_is_attention_over_the_union():
    torch.manual_seed(0)
    query, keys, values = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 9, 8), torch.randn(2, 1, 9, 8)
    parts = []
    for part in (slice(0, 4), slice(4, 9)):
        scores = torch.einsum("bhgd,bhnd->bhgn", query, keys[:, :, part])
        top = scores.amax(-1)
        probs = torch.exp(scores - top[..., None])
        parts.append((probs @ values[:, :, part], torch.stack([top, probs.sum(-1)], -1)))
    torch.testing.assert_close(merge_partials(parts), attention(query, keys, values, None, 1.0), **TOL)


@pytest.mark.parametrize("reader", ["torch", "triton"], ids=["folded-torch", "kernel"])
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated-values"])
@torch.no_grad()
def test_kivi_decode_step_is_attention_over_the_stores(rotate, reader, monkeypatch):
    """One decode step from the stores (quantized blocks through the kernel, or the torch reader without it; sink,
    float tail and this step's token exact; values the store rotated rotated back) equals SDPA over what the stores
    read back."""
    from kvconvert.runtime.kvconvert_quant import kivi_decode
    from kvconvert.runtime.kvconvert_tokenstore import TokenStore

    torch.manual_seed(1)
    quant = QuantSpec(bits=4, group=32, residual=8, sink=3, rotate=rotate)
    keys, values = TokenStore(quant, per_channel=True), TokenStore(quant, per_channel=False)
    past_k, past_v = torch.randn(2, 2, 77, 64, device=DEVICE), torch.randn(2, 2, 77, 64, device=DEVICE)
    keys.append(past_k)
    values.append(past_v)
    assert keys.quantized_tokens == 64 and values.rotate == rotate and keys.head is not None
    query, key, value = torch.randn(2, 6, 1, 64, device=DEVICE), *torch.randn(2, 2, 2, 1, 64, device=DEVICE)
    bias = torch.zeros(2, 1, 1, 78, device=DEVICE)
    bias[1, ..., :40] = NEG  # left padding past the sink and into the second block
    k, v = keys.read(then=key), values.read(then=value)
    expected = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=bias, scale=0.125,
                                                                enable_gqa=True)  # fmt: skip
    got = kivi_decode(query, key, value, bias, keys, values, 0.125, kernel=reader == "triton")
    torch.testing.assert_close(got, expected, **TOL)


KIVI_RECIPES = {
    "quant-sink-rotated-residual": ["quant", "--kv-bits", "4", "--kv-group", "32", "--kv-residual", "16",
                                    "--kv-sink", "4", "--kv-rotate"],
    "quant-groups-of-64": ["quant", "--kv-bits", "4", "--kv-group", "64", "--kv-residual", "0"],
    # razor's retrieval heads from their codes, its windows (quantized too) through the head-wise kernel
    "razor-4bit": ["razor", "--induction-frac", "0.5", "--echo-frac", "0", "--window", "6", "--window-frac", "0.1",
                   "--sink", "2", "--profile-tokens", "16", "--kv-bits", "4", "--kv-group", "32", "--kv-residual", "0"],
    # the same with windows of 40 tokens (at least residual + group): a static cache too (``StaticRazorKiviLayer``)
    "razor-4bit-window-40": ["razor", "--induction-frac", "0.5", "--echo-frac", "0", "--window", "40", "--sink", "2",
                             "--profile-tokens", "16", "--kv-bits", "4", "--kv-group", "32", "--kv-residual", "0"],
}  # fmt: skip
STATIC_KIVI = [name for name in KIVI_RECIPES if name != "razor-4bit"]  # razor-4bit's window is too short for one


# what only the torch reader takes (the kernel reads 4 bits)
FOLDED_RECIPES = {
    "quant-2bit": ["quant", "--kv-bits", "2", "--kv-group", "32", "--kv-residual", "0", "--kv-sink", "4"],
    "quant-3bit": ["quant", "--kv-bits", "3", "--kv-group", "32", "--kv-residual", "0", "--kv-sink", "4"],
    "quant-8bit": ["quant", "--kv-bits", "8", "--kv-group", "32", "--kv-residual", "0", "--kv-sink", "4"],
}  # fmt: skip


def kivi_checkpoint(name: str, tokenized_model_dir, out) -> tuple[str, int]:
    """``KIVI_RECIPES[name]`` (or ``FOLDED_RECIPES[name]``) converted into ``out``: (its command, the layers whose
    decode steps read codes: every layer, or for razor those with retrieval heads)."""
    import json

    from tests.helpers import run_cli

    command, *args = {**KIVI_RECIPES, **FOLDED_RECIPES}[name]
    result = run_cli(command, "--model", str(tokenized_model_dir("llama_gqa64")), "--out", str(out), "--quiet", *args)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    if command != "razor":
        return command, config["num_hidden_layers"]
    layers = sum(bool(heads) for heads in config["kvconvert"]["razor"]["retrieval_kv_heads"])
    assert layers > 0
    return command, layers


def greedy_twelve(model, **options):
    """Greedy decoding of a left-padded batch whose cache holds quantized blocks, with the logits."""
    from tests.helpers import left_padded

    ids, mask = (t.to(DEVICE) for t in left_padded(length=100, pad=37, seed=3))
    return model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=0, return_dict_in_generate=True, output_logits=True, **options)  # fmt: skip


def assert_same_generation(expected, got, where: str) -> None:
    from tests.helpers import assert_same_logits

    for step, (a, b) in enumerate(zip(expected.logits, got.logits, strict=True)):
        assert_same_logits(a, b, f"{where} decode step {step}")
    assert torch.equal(expected.sequences, got.sequences)


@pytest.mark.parametrize(("name", "static"), [(name, False) for name in KIVI_RECIPES] +
                         [(name, True) for name in STATIC_KIVI])  # fmt: skip
@torch.no_grad()
def test_decode_with_the_kivi_kernel_matches_the_torch_runtime(name, static, tokenized_model_dir, tmp_path,
                                                               monkeypatch):  # fmt: skip
    """A 4-bit KIVI checkpoint with KVCONVERT_KERNELS=triton: greedy decoding gives the torch path's tokens and
    logits, every decode step of every layer (razor: of every layer with retrieval heads) in one KIVI kernel launch;
    from a static cache too (the kernel reads every block the buffers hold, those not quantized yet masked). On a
    GPU, left to ``auto``, the same generation (eager steps do not take the kernel; whether generate's compiled steps
    do is not asserted: on an H200 they did not, 2026-11-27, cause not found). A quant checkpoint's attention is
    routed to the codes' readers whether the kernels are asked for or not."""
    import kvconvert
    import kvconvert.runtime.kvconvert_quant as runtime

    command, layers = kivi_checkpoint(name, tokenized_model_dir, tmp_path / "m")
    if command == "quant":
        assert kvconvert.load(tmp_path / "m").config._attn_implementation == runtime.IMPLEMENTATION
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    model = kvconvert.load(tmp_path / "m").eval().to(DEVICE)
    launches = []

    def counted(*a, **k):
        launches.append(1)
        return kivi_decode_triton(*a, **k)

    monkeypatch.setattr(runtime, "kivi_decode_triton", counted)
    kivi_packed_values(monkeypatch)  # the torch path's values as the kernel reads them: float32 products both ways
    outputs = {}
    for choice in ("torch", "triton", *(("auto",) if DEVICE == "cuda" else ())):
        monkeypatch.setenv("KVCONVERT_KERNELS", choice)
        launches.clear()
        outputs[choice] = greedy_twelve(model, **({"cache_implementation": "static"} if static else {}))
        if choice != "auto" or not static:
            assert len(launches) == (11 * layers if choice == "triton" else 0), choice
        assert_same_generation(outputs["torch"], outputs[choice], f"{name} {choice}")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@torch.no_grad()
def test_generate_compiles_static_kivi_steps_and_they_launch_the_kernel(tokenized_model_dir, tmp_path, monkeypatch):
    """On a GPU, ``generate(cache_implementation="static")`` compiles the decode step (transformers' auto-compile)
    and, left to ``auto``, the compiled step launches the KIVI kernel: counted from the CUDA kernels the profiler saw,
    not by a Python wrapper (a trace runs that once). The question left open on an H200 on 2026-11-27, when a
    wrapper counted 0 launches in 33 steps; rows of equal length, so no growing padding mask recompiles the step."""
    import kvconvert

    kivi_checkpoint("quant-groups-of-64", tokenized_model_dir, tmp_path / "m")
    monkeypatch.setenv("KVCONVERT_KERNELS", "auto")
    model = kvconvert.load(tmp_path / "m").eval().to(DEVICE)
    ids = torch.randint(3, 90, (2, 100), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    torch._dynamo.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static")
    assert getattr(model, "_compiled_call", None) is not None, "generate did not compile the static decode step"
    kernels = {event.name for event in profiler.events() if "kivi" in event.name}
    assert kernels, "the compiled static step launched no KIVI kernel"


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@torch.no_grad()
def test_decode_with_the_fp8_kernel_matches_the_torch_runtime(static, tokenized_model_dir, tmp_path, monkeypatch):
    """An fp8 checkpoint (scales per KV head) with KVCONVERT_KERNELS=triton: its attention is routed through
    kvconvert's, and greedy decoding of a left-padded batch gives the torch path's tokens and logits (the codes read
    back for SDPA) with every decode step of every layer one fp8 kernel launch; from a static cache too, where the
    kernel reads the slots written so far. On a GPU, left to ``auto``, every decode step takes it (generate's
    compiled steps from a static cache included)."""
    import kvconvert
    import kvconvert.runtime.kvconvert_quant as runtime
    import kvconvert.runtime.kvconvert_storage as storage
    from tests.helpers import run_cli

    out = tmp_path / "m"
    result = run_cli("quant", "--model", str(tokenized_model_dir("llama_gqa")), "--out", str(out), "--quiet",
                     "--kv-format", "fp8", "--kv-scale-strategy", "head", "--calib-tokens", "512")  # fmt: skip
    assert result.exit_code == 0, result.output
    model = kvconvert.load(out).eval().to(DEVICE)
    assert model.config._attn_implementation == runtime.IMPLEMENTATION
    launches = []

    def counted(*a, **k):
        launches.append(1)
        return fp8_decode_triton(*a, **k)

    monkeypatch.setattr(storage, "fp8_decode_triton", counted)
    options = {"cache_implementation": "static"} if static else {}
    outputs = {}
    for choice in ("torch", "triton", *(("auto",) if DEVICE == "cuda" else ())):
        monkeypatch.setenv("KVCONVERT_KERNELS", choice)
        launches.clear()
        outputs[choice] = greedy_twelve(model, **options)
        assert len(launches) == (0 if choice == "torch" else 11 * model.config.num_hidden_layers), choice
        assert_same_generation(outputs["torch"], outputs[choice], f"fp8 {choice}")


def kivi_packed_values(monkeypatch) -> None:
    """Growing KIVI-layout caches keep their 4-bit values in KIVI's own packing on a CPU too, not in the int4
    kernel's rows (``KiviInt4Values``, whose bfloat16 products have their own tests), so that the readers compared
    here compute in float32."""
    import kvconvert.runtime.kvconvert_quant as runtime

    monkeypatch.setattr(runtime, "int4_values_read", lambda quant, values: False)  # every layer asks it


# (recipe, static cache)
FROM_CODES = [(name, static) for name in (*KIVI_RECIPES, *FOLDED_RECIPES) for static in (False, True)
              if not static or name in STATIC_KIVI or name in FOLDED_RECIPES]  # fmt: skip


@pytest.mark.parametrize(("name", "static"), FROM_CODES)
@torch.no_grad()
def test_cpu_decode_from_the_codes_matches_dequantize_then_sdpa(name, static, tokenized_model_dir, tmp_path,
                                                                monkeypatch):  # fmt: skip
    """On a CPU a KIVI checkpoint decodes from its codes by default (``kivi_decode_folded``: one call per layer and
    step, no kernels asked for; razor: for its retrieval heads, per layer that has them, and for its windows once
    they hold a quantized block), from a growing cache or a
    static one (``StaticKiviLayer``: every slot read, the blocks not quantized yet masked by position; blocks fill
    while it decodes): the tokens and logits of dequantizing the same cache for attention."""
    import kvconvert
    import kvconvert.runtime.kvconvert_quant as runtime
    import kvconvert.runtime.kvconvert_razor as razor_runtime
    import kvconvert.runtime.kvconvert_razor_kivi as razor_kivi_runtime

    if DEVICE != "cpu":
        pytest.skip("a GPU keeps dequantize-then-SDPA by default")
    monkeypatch.delenv("KVCONVERT_KERNELS", raising=False)
    _, layers = kivi_checkpoint(name, tokenized_model_dir, tmp_path / "m")
    model = kvconvert.load(tmp_path / "m").eval()
    options = {"cache_implementation": "static"} if static else {}
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return kivi_decode_folded(*a, **k)

    monkeypatch.setattr(runtime, "kivi_decode_folded", counted)
    monkeypatch.setattr(kvconvert_folded, "BYTE_CODES_MIN", 0)  # 8-bit codes are read from a size these are not
    kivi_packed_values(monkeypatch)  # float32 products (4-bit values in int4 rows: tests/test_kivi_int4.py)
    from_codes = greedy_twelve(model, **options)
    read = len(calls)
    # razor's growing windows read their codes too; its static windows are dequantized (retrieval heads only)
    assert read > 11 * layers if name.startswith("razor") and not static else read == 11 * layers
    for module in (runtime, razor_runtime):  # the dequantizing paths
        monkeypatch.setattr(module, "kivi_kernel_reads", lambda *a, **k: False)
    monkeypatch.setattr(runtime.StaticKiviLayer, "_folded_reads", lambda self, dim, kernel=False: False)
    monkeypatch.setattr(razor_kivi_runtime, "static_reads_codes", lambda *a, **k: False)
    dequantized = greedy_twelve(model, **options)
    assert len(calls) == read
    assert_same_generation(dequantized, from_codes, f"{name}, static" if static else name)


@torch.no_grad()
def test_eight_bit_codes_are_read_from_a_cache_size_on(tokenized_model_dir, tmp_path, monkeypatch):
    """8-bit KIVI storage on a CPU: a cache of fewer codes a layer than ``BYTE_CODES_MIN`` decodes dequantized (there
    faster than widening the bytes in the reader), a larger one from its codes; the same generation either way."""
    import kvconvert
    import kvconvert.runtime.kvconvert_quant as runtime

    if DEVICE != "cpu":
        pytest.skip("a GPU keeps dequantize-then-SDPA by default")
    monkeypatch.delenv("KVCONVERT_KERNELS", raising=False)
    _, layers = kivi_checkpoint("quant-8bit", tokenized_model_dir, tmp_path / "m")
    model = kvconvert.load(tmp_path / "m").eval()
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return kivi_decode_folded(*a, **k)

    monkeypatch.setattr(runtime, "kivi_decode_folded", counted)
    dequantized = greedy_twelve(model)
    held = min(layer.key_store.blocks.codes.numel() for layer in dequantized.past_key_values.layers)
    assert not calls and held < kvconvert_folded.BYTE_CODES_MIN
    monkeypatch.setattr(kvconvert_folded, "BYTE_CODES_MIN", held)  # what the prompt's quantized blocks hold
    from_codes = greedy_twelve(model)
    assert len(calls) == 11 * layers
    assert_same_generation(dequantized, from_codes, "quant-8bit")


# -- the kernels inside converted models -----------------------------------------------------

CONVERSIONS = {
    "slim-llama": ("llama", ["slim"]),
    "slim-gpt2": ("gpt2", ["slim"]),
    "lorc-rope-gqa": ("llama_gqa", ["lorc", "--kv-budget", "0.6", "--schedule", "uniform"]),
    "lorc-absorbed-gpt2": ("gpt2", ["lorc", "--kv-budget", "0.6", "--schedule", "uniform"]),
    "lorc-k-only": ("llama_gqa", ["lorc", "--kv-budget", "0.8", "--schedule", "uniform", "--compress", "k"]),
    "zack-rope-gqa": ("llama_gqa", ["zack", "--removal-rate", "0.1", "--calib-tokens", "2048"]),
    "zack-folded-gpt2": ("gpt2", ["zack", "--removal-rate", "0.1", "--calib-tokens", "2048"]),
    "razor-mixed": ("llama_gqa", ["razor", "--induction-frac", "0.3", "--echo-frac", "0", "--window", "6",
                                  "--window-frac", "0.1", "--sink", "2", "--profile-tokens", "16"]),
    "razor-none-kept": ("gpt_neox", ["razor", "--induction-frac", "0", "--echo-frac", "0", "--window", "6",
                                     "--window-frac", "0.1", "--sink", "2", "--profile-tokens", "16"]),
}  # fmt: skip


def converted_layers(model) -> int:
    """Layers running kvconvert attention (lorc leaves some stock); razor: all, through its function."""
    spec = model.config.kvconvert
    if spec["method"] == "lorc":
        return sum(layer is not None for layer in spec["lorc_layers"])
    return len(spec["attention_modules"])


@pytest.mark.parametrize("name", list(CONVERSIONS))
@torch.no_grad()
def test_decode_with_kernels_matches_the_torch_runtime(name, tokenized_model_dir, tmp_path, monkeypatch):
    """Greedy decoding of a left-padded batch, Triton kernels vs the method's torch code."""
    import kvconvert
    import kvconvert.runtime.kvconvert_kernels as kernels
    from tests.helpers import assert_same_logits, left_padded, run_cli

    kind, args = CONVERSIONS[name]
    result = run_cli(args[0], "--model", str(tokenized_model_dir(kind)), "--out", str(tmp_path / "m"), "--quiet",
                     *args[1:])  # fmt: skip
    assert result.exit_code == 0, result.output
    model = kvconvert.load(tmp_path / "m").eval().to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded(length=20, pad=5, seed=3))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)  # fmt: skip
    # slim, lorc and zack launch through LatentAttention (kvconvert_common), razor through its own module
    runtime = importlib.import_module(f"kvconvert.runtime.kvconvert_{'razor' if args[0] == 'razor' else 'common'}")
    launcher = "razor_decode_triton" if args[0] == "razor" else "packed_decode_triton"
    launches = []

    def counted(*a, **k):
        launches.append(1)
        return getattr(kernels, launcher)(*a, **k)

    monkeypatch.setattr(runtime, launcher, counted)
    outputs = {}
    for choice in ("torch", "triton"):  # the torch path is the default; triton opts in
        monkeypatch.setenv("KVCONVERT_KERNELS", choice)
        outputs[choice] = model.generate(ids, **kwargs)
        # the torch runtime never launches; with kernels every decode step of every converted layer does
        assert len(launches) == (0 if choice == "torch" else 11 * converted_layers(model))
    for step, (a, b) in enumerate(zip(outputs["torch"].logits, outputs["triton"].logits, strict=True)):
        assert_same_logits(a, b, f"{name} decode step {step}")
    assert torch.equal(outputs["torch"].sequences, outputs["triton"].sequences)


@torch.no_grad()
def test_razor_static_cache_decodes_with_the_head_wise_kernel(monkeypatch):
    """razor's static cache asked for the kernels: every single-token step is one launch over the buffers as they
    are (sink and ring in one tensor, masked by position), and agrees with the growing cache's torch path."""
    import kvconvert.runtime.kvconvert_razor_static as static
    from tests.helpers import razor_static_steps

    launches = []
    original = static.razor_decode_triton

    def counted(*args, **kwargs):
        launches.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(static, "razor_decode_triton", counted)
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    razor_static_steps(2, 6, 0.25, [1], tolerance=1e-4, device=DEVICE)  # both kinds of head in one layer
    assert len(launches) == 44  # the steps of one token (longer ones go through the growing layer)


def test_kernels_asked_for_where_they_cannot_run_are_an_error_not_a_fall_back(monkeypatch):
    """A misspelt KVCONVERT_KERNELS, Triton missing, or Triton on a CPU without the interpreter: one line naming
    the problem and the flag, never the torch path in silence (a kernel measurement would measure torch)."""
    import kvconvert.runtime.kvconvert_kernels as kernels

    monkeypatch.setenv("KVCONVERT_KERNELS", "trition")
    with pytest.raises(ValueError, match="'trition' is not one of auto, torch, triton"):
        kernels.use_kernels(torch.zeros(1))
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if triton_available():
        with pytest.raises(ValueError, match="this model runs on cpu; set KVCONVERT_KERNELS=torch"):
            kernels.use_kernels(torch.zeros(1))
    monkeypatch.setattr(kernels, "triton", None)
    with pytest.raises(ValueError, match="Triton is not installed"):
        kernels.use_kernels(torch.zeros(1))
    for choice in ("auto", "torch", "TORCH", ""):  # the torch path needs nothing
        monkeypatch.setenv("KVCONVERT_KERNELS", choice)
        assert not kernels.use_kernels(torch.zeros(1))


@pytest.mark.parametrize("method", ["quant", "razor", "slim", "lorc", "zack", "minicache"])
@torch.no_grad()
def test_every_method_refuses_kernels_on_a_cpu_at_its_first_forward(method, converted, monkeypatch):
    """``KVCONVERT_KERNELS=triton`` on a CPU without the interpreter is refused by every converted checkpoint at its
    first forward, a prompt's too: checked only where a decode step asked for a kernel, a prefill (which never asks)
    and every storage with no kernel of its own (3-bit codes, MiniCache's) ran through torch in silence."""
    import kvconvert

    _, out = converted(method, "compressing")
    model = kvconvert.load(out).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on cpu; set KVCONVERT_KERNELS=torch|Triton is not installed"):
        model(ids)
    monkeypatch.setenv("KVCONVERT_KERNELS", "torch")
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("command", ["eval", "plan"])
@pytest.mark.parametrize(
    ("variable", "value", "choices"),
    [
        ("KVCONVERT_KERNELS", "trition", "auto, torch, triton"),
        ("KVCONVERT_REBUILD", "fast", "auto, bf16, exact"),
        ("KVCONVERT_COMPILE", "yes", "auto, on, off"),
    ],
)
def test_cli_refuses_a_kernel_setting_it_cannot_honour(command, variable, value, choices, monkeypatch, tmp_path):
    from helpers import run_cli

    monkeypatch.setenv(variable, value)
    extra = ["--data", "x.txt"] if command == "eval" else ["--out", str(tmp_path / "plan")]
    result = run_cli(command, "--model", str(tmp_path / "absent"), *extra, "--device", "cpu")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"kvconvert: error: {variable}={value!r} is not one of {choices}"]
    assert not (tmp_path / "plan").exists()


def test_kernels_run_only_when_asked(monkeypatch):
    """The torch path is the default, except for the kernels measured faster end to end on an NVIDIA GPU: fp8's
    ("gpu": eager and through CUDA graphs) and KIVI's ("graphs": while a CUDA graph is captured or torch.compile
    traces the step), which ``auto`` takes there (Ampere on) and nowhere else; ``torch`` turns them off."""
    import types

    import kvconvert.runtime.kvconvert_kernels as kernels

    monkeypatch.delenv("KVCONVERT_KERNELS", raising=False)
    here = torch.zeros(1, device=DEVICE)
    assert not kernels.use_kernels(here)
    ampere = DEVICE == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 0)
    assert kernels.use_kernels(here, default="gpu") == ampere
    assert not kernels.use_kernels(here, default="graphs")  # not capturing
    monkeypatch.setenv("KVCONVERT_KERNELS", "torch")
    assert not kernels.use_kernels(here, default="gpu")
    if triton_available():  # without Triton, asking for it is an error (test above)
        monkeypatch.setenv("KVCONVERT_KERNELS", "triton")
        assert kernels.use_kernels(here)
    # the auto choice's rule, on a stand-in for a tensor on a GPU of each generation, eager, captured, and traced
    monkeypatch.delenv("KVCONVERT_KERNELS")
    monkeypatch.setattr(torch.version, "hip", None)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    cases = [  # (capability, compiling, capturing) -> taken for "gpu", for "graphs"
        ((9, 0), False, False, True, False), ((9, 0), False, True, True, True), ((8, 0), False, True, True, True),
        ((7, 5), False, True, False, False), ((9, 0), True, False, True, True), ((7, 5), True, False, False, False),
    ]  # fmt: skip
    for capability, compiling, capturing, gpu, graphs in cases:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda c=compiling: c)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        where = (capability, compiling, capturing)
        assert kernels.use_kernels(on_gpu, default="gpu") == gpu, where
        assert kernels.use_kernels(on_gpu, default="graphs") == graphs, where
        assert not kernels.use_kernels(on_gpu), where


def test_kernels_compile_for_sm80_and_sm90():
    """The interpreter does not type-check like the compiler; compile both kernels for A100/H100 in
    fp32/fp16/bf16 (PTX and cubin via Triton's own ptxas), which needs no GPU."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("compile_kernels.py")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          cwd=script.parents[1])  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
