"""The token layout (``--kv-layout token``): keys minus their block means and values, both rotated
and quantized per token in torch's int4 matrix layout, read by ``aten._weight_int4pack_mm_for_cpu``
without dequantizing. Checked against plain-torch references: the packing against torch's own
packer, the stored values against a fake quantizer written out here, the kernel decode against
float attention over the dequantized cache, and the whole model's kernel path against its
dequantize-then-SDPA path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import convert, generate_in_every_mode, left_padded, load_converted, load_reference, run_cli

import kvconvert
from kvconvert.eval.memory import kv_bytes_per_token
from kvconvert.runtime import kvconvert_quant, kvconvert_razor, kvconvert_tokenlayout
from kvconvert.runtime.kvconvert_codec import QuantSpec, rotation, token_group_size
from kvconvert.runtime.kvconvert_tokenlayout import INT4_ROW_LAYOUTS, Int4Rows, TokenLayoutStore, cpu_int4_rows
from kvconvert.runtime.kvconvert_tokenstore import TokenStore

MACHINE = cpu_int4_rows()
needs_kernel = pytest.mark.skipif(MACHINE is None, reason="this torch has no CPU int4 kernel whose layout we know")
TOKEN = ("--kv-bits", "4", "--kv-group", "32", "--kv-residual", "8", "--kv-layout", "token")


@needs_kernel
@pytest.mark.parametrize("rows, cols", [(32, 64), (96, 32), (64, 256), (160, 64)])
def test_int4_rows_are_torchs_own_packing(rows, cols):
    assert MACHINE is not None
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    packed = MACHINE.pack(codes)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
    assert torch.equal(MACHINE.unpack(packed), codes)


def reference_pack(codes: torch.Tensor, layout: Int4Rows) -> torch.Tensor:
    """ATen's packer, as its source comment describes it, one byte at a time: blocks of ``block`` rows
    (a shorter last block pairwise), each ``K × nb/2`` bytes; byte (k, j) of a block holds rows (j, j + nb/2)
    (halves) or (2j, 2j + 1) (pairs), the first in the low nibble."""
    n, k = codes.shape
    out = torch.zeros(n * k // 2, dtype=torch.uint8)
    for start in range(0, n, layout.block):
        nb = min(layout.block, n - start)
        halves = layout.halves and nb == layout.block
        for kk in range(k):
            for j in range(nb // 2):
                low, high = (j, j + nb // 2) if halves else (2 * j, 2 * j + 1)
                out[start * k // 2 + kk * nb // 2 + j] = codes[start + low, kk] | (codes[start + high, kk] << 4)
    return out.reshape(n, k // 2)


@pytest.mark.parametrize("layout", INT4_ROW_LAYOUTS, ids=lambda r: f"{r.block}-{'halves' if r.halves else 'pairs'}")
@pytest.mark.parametrize("rows", [32, 96, 160])
def test_every_int4_layout_packs_as_defined_and_unpacks(layout, rows):
    codes = torch.randint(0, 16, (2, rows, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    packed = layout.pack(codes)
    assert torch.equal(packed[1], reference_pack(codes[1], layout))
    assert torch.equal(layout.unpack(packed), codes)


@pytest.mark.parametrize("machine", [Int4Rows(64, True), Int4Rows(32, False), None], ids=["avx512", "plain", "none"])
@pytest.mark.parametrize("width, group", [(64, 32), (128, 64), (96, 32), (96, 128)])
def test_stores_follow_the_machines_layout(monkeypatch, machine, width, group):
    """On a CPU whose kernel packs otherwise (AVX-512's 64-row blocks, the plain loop's pairs), the stores
    write that layout — key blocks appended 32 tokens at a time packed as if packed at once, value groups
    the kernel cannot read as one matrix (96 rows in 64-row blocks) in the stores' own — and read back
    what this machine's layout reads: the layout changes bytes, never values."""
    generator = torch.Generator().manual_seed(width + group)
    x = torch.randn(2, 2, 4 * group + 5, width, generator=generator)
    spec = QuantSpec(4, group, residual=0, layout="token")

    def filled(keys: bool) -> TokenLayoutStore:
        store = TokenLayoutStore(spec, keys=keys)
        for start in range(0, x.shape[-2], group):  # block by block, as decoding fills it
            store.append(x[..., start : start + group, :])
        return store

    here = {keys: filled(keys) for keys in (True, False)}  # this machine's layout
    monkeypatch.setattr(kvconvert_tokenlayout, "cpu_int4_rows", lambda: machine)
    for keys in (True, False):
        store = filled(keys)
        size = token_group_size(width, group)
        fits = machine is not None and (keys or size % machine.block == 0 or size < machine.block)
        assert store.rows == (machine if fits else INT4_ROW_LAYOUTS[0]) and store.kernel_reads() == fits
        ours, theirs, their_rows = store.blocks, here[keys].blocks, here[keys].rows
        assert ours is not None and theirs is not None and store.rows is not None and their_rows is not None
        if keys:  # the appended blocks are exactly what packing all codes at once gives
            codes = store.rows.unpack(ours.codes)
            assert torch.equal(ours.codes, store.rows.pack(codes))
            assert torch.equal(codes, their_rows.unpack(theirs.codes))
        assert torch.equal(store.read(), here[keys].read())


def test_token_group_size():
    assert token_group_size(64, 64) == 64 and token_group_size(128, 64) == 64 and token_group_size(96, 64) == 32
    assert token_group_size(64, 32) == 32 and token_group_size(256, 128) == 128 and token_group_size(80, 64) is None


def reference_token_layout(x: torch.Tensor, group: int, size: int, keys: bool) -> torch.Tensor:
    """Plain-torch fake quantization of whole blocks ``x [..., n, d]``: (keys) minus each block's
    per-channel mean in float16, rotated per group of ``size`` channels, 4-bit per token and group
    (a scale rounded up and the kernel's zero, the value of code 8: bfloat16 for keys, float16 for
    values), rotated back."""
    *lead, n, d = x.shape
    x = x.float()
    center = torch.zeros_like(x)
    if keys:
        blocks = x.reshape(*lead, n // group, group, d)
        center = blocks.mean(-2, keepdim=True).half().float().expand_as(blocks).reshape(x.shape)
    r = rotation(size)
    y = (x - center).reshape(*lead, n, d // size, size) @ r
    low, high = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    dtype = torch.bfloat16 if keys else torch.float16
    scale = _up((high - low) / 15, dtype)
    zero = (low + 8 * scale).to(dtype).float()
    y_hat = (((y - zero) / scale + 8).round().clamp(0, 15) - 8) * scale + zero
    return (y_hat @ r.T).reshape(x.shape) + center


def _up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest positive ``dtype`` value ≥ x, as float32 (1 for an empty range)."""
    h = x.to(dtype)
    h = torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h).float()
    return torch.where(h > 0, h, torch.ones_like(h))


@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("width, group", [(64, 64), (64, 32), (96, 64)])
def test_store_holds_the_reference_quantization(keys, width, group):
    generator = torch.Generator().manual_seed(width + group)
    x = torch.randn(2, 3, 5 * group + 7, width, generator=generator)
    x[..., 3] += 6.0  # an outlier channel with an offset: what the key means and the rotation are for
    store = TokenLayoutStore(QuantSpec(4, group, residual=0, layout="token"), keys=keys)
    store.append(x[..., : group + 3, :])
    store.append(x[..., group + 3 :, :])
    assert store.quantized_tokens == 5 * group and len(store) == x.shape[-2]
    size = token_group_size(width, group)
    expected = reference_token_layout(x[..., : 5 * group, :], group, size, keys)
    error = (store.read()[..., : 5 * group, :] - expected).abs()
    # equal, but for a code that flips where a value lies on a rounding boundary: the rotation's
    # matmul sums in another order for another batch shape (the store quantizes block by block), and
    # how often depends on the CPU's float kernels (1–2 of 1920 tokens on an AMD EPYC, 17 on an Intel
    # Xeon). A flipped code is in the rotated space: it moves its whole token a little, so count tokens.
    assert (error > 1e-5).any(-1).float().mean() < 0.02 and error.max() < 0.05
    assert torch.equal(store.read()[..., 5 * group :, :], x[..., 5 * group :, :])  # the tail stays exact
    assert 0 < (expected - x[..., : 5 * group, :]).abs().mean() < 0.1


@needs_kernel
@pytest.mark.parametrize("width, group, sink, dropped", [(64, 32, 3, 40), (64, 32, 0, 70), (128, 64, 4, 130)])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_decode_after_dropping_from_the_front(width, group, sink, dropped, padded):
    """Razor's windows: tokens dropped from the front are masked in their block (or freed with it), and
    ``extra`` exact tokens with their own logits join the softmax — float attention over what is held."""
    batch, kv_heads, heads, n = 2, 2, 6, 5 * group + 9
    keys, values, generator = _filled(batch, kv_heads, n, width, group, sink, seed=width + dropped)
    before_k, before_v = keys.read(), values.read()
    torch.testing.assert_close(keys.take_front(dropped), before_k[..., :dropped, :], rtol=0, atol=0)
    values.take_front(dropped)
    unit = max(group, 64)
    assert keys.offset == values.offset == dropped % unit
    assert keys.quantized_tokens == values.quantized_tokens == 5 * group - dropped // unit * unit
    assert torch.equal(keys.read(), before_k[..., dropped:, :])
    assert torch.equal(values.read(), before_v[..., dropped:, :])
    held = n - dropped
    query = torch.randn(batch, heads, 1, width, generator=generator)
    key, value = torch.randn(batch, kv_heads, 1, width, generator=generator), torch.randn(batch, kv_heads, 1, width)
    extra_k = torch.randn(batch, kv_heads, 3, width, generator=generator)
    extra_v = torch.randn(batch, kv_heads, 3, width, generator=generator)
    logits = torch.tensor([0.0, -1.0, 2.5]).expand(batch, kv_heads, 1, 3).clone()
    logits[1, 0, 0, 0] = torch.finfo(torch.float32).min
    bias = None
    if padded:  # row 1's first 5 held tokens are padding
        bias = torch.zeros(batch, 1, 1, held + 1)
        bias[1, ..., :5] = torch.finfo(torch.float32).min
    out = kvconvert_quant.token_decode(query, key, value, bias, keys, values, width**-0.5, (extra_k, extra_v, logits))
    group_of = heads // kv_heads
    k_all = torch.cat([extra_k, keys.read(), key], 2).repeat_interleave(group_of, 1)
    v_all = torch.cat([extra_v, values.read(), value], 2).repeat_interleave(group_of, 1)
    full_bias = torch.cat([logits, torch.zeros(batch, kv_heads, 1, held + 1) if bias is None else bias.expand(
        batch, kv_heads, 1, -1)], dim=-1).repeat_interleave(group_of, 1)  # fmt: skip
    expected = torch.softmax(query @ k_all.transpose(-1, -2) * width**-0.5 + full_bias, -1) @ v_all
    torch.testing.assert_close(out, expected, rtol=0, atol=3e-2)
    assert (out - expected).abs().mean() < 4e-3


@pytest.mark.parametrize("machine", [Int4Rows(64, True), Int4Rows(32, False)], ids=["avx512", "plain"])
def test_dropping_from_the_front_keeps_the_machines_layout(monkeypatch, machine):
    """On AVX-512 a key block of 64 rows pairs rows j and j + 32: dropping whole 32-token groups would cut
    pairs apart, so tokens leave in 64-token units, and the rest stays packed as packing at once gives."""
    monkeypatch.setattr(kvconvert_tokenlayout, "cpu_int4_rows", lambda: machine)
    x = torch.randn(1, 2, 200, 64, generator=torch.Generator().manual_seed(1))
    for keys in (True, False):
        store = TokenLayoutStore(QuantSpec(4, 32, residual=0, layout="token"), keys=keys)
        store.append(x[..., :96, :])
        store.append(x[..., 96:192, :])
        reference = store.read()
        front = torch.cat([store.take_front(40), store.take_front(30)], dim=-2)  # 70: one 64-token unit freed
        assert store.quantized_tokens == 192 - 64 and store.offset == 6 and store.rows == machine
        torch.testing.assert_close(front, reference[..., :70, :], rtol=0, atol=0)
        assert torch.equal(store.read(), reference[..., 70:, :])
        store.append(x[..., 192:, :])
        assert len(store) == 130 and torch.equal(store.read()[..., :-8, :], reference[..., 70:, :])
        if keys:
            assert store.blocks is not None and torch.equal(machine.pack(machine.unpack(store.blocks.codes)),
                                                            store.blocks.codes)  # fmt: skip


def test_windows_slide_by_whole_units():
    """What razor's window may drop from a token-layout store: whole 64-token units of the quantized part
    (tokens short of a unit stay), or everything quantized and some of the float tail."""
    store = TokenLayoutStore(QuantSpec(4, 32, residual=0, layout="token"), keys=True)
    store.append(torch.randn(1, 1, 170, 64))  # 160 quantized (2.5 units), 10 in the tail
    assert [store.whole_front(n) for n in (10, 63, 64, 100, 159)] == [0, 0, 64, 64, 128]
    assert store.whole_front(160) == 160 and store.whole_front(165) == 165
    store.take_front(64)
    assert store.quantized_tokens == 96 and store.offset == 0 and store.whole_front(70) == 64


def _filled(batch: int, kv_heads: int, n: int, width: int, group: int, sink: int, seed: int,
            value_bits: int | None = None):  # fmt: skip
    """Token-layout stores holding ``n`` random tokens; with ``value_bits``, the values per token in KIVI's packing at
    that width, rotated (``--kv-value-bits``: ``QuantSpec.side``)."""
    generator = torch.Generator().manual_seed(seed)
    spec = QuantSpec(4, group, residual=0, sink=sink, layout="token", value_bits=value_bits)
    keys = TokenLayoutStore(spec, keys=True)
    values = TokenLayoutStore(spec, keys=False) if value_bits is None else TokenStore(spec.side(0, False), False)
    k = torch.randn(batch, kv_heads, n, width, generator=generator)
    k[..., 5] += 4.0
    v = torch.randn(batch, kv_heads, n, width, generator=generator)
    keys.append(k)
    values.append(v)
    return keys, values, generator


@needs_kernel
@pytest.mark.parametrize("width, group, sink, value_bits", [(64, 64, 0, None), (64, 32, 3, None), (128, 64, 4, None),
                                                            (64, 32, 3, 2), (128, 64, 0, 2), (64, 32, 2, 3),
                                                            (128, 32, 4, 4)])  # fmt: skip
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_decode_equals_float_attention_over_the_dequantized_cache(width, group, sink, value_bits, padded):
    """``token_decode`` from the codes equals float attention over ``read()``'s dequantized cache: the token layout's
    values through the int4 kernel, or values of their own width per token in KIVI's packing (``value_bits``, rotated)
    weighed from their codes (``folded_value_sum``)."""
    batch, kv_heads, heads, n = 2, 2, 6, 5 * group + 9
    keys, values, generator = _filled(batch, kv_heads, n, width, group, sink, width + sink, value_bits)
    assert kvconvert_quant.decodes_from_codes(keys, values, torch.device("cpu"))
    query = torch.randn(batch, heads, 1, width, generator=generator)
    key, value = torch.randn(batch, kv_heads, 1, width, generator=generator), torch.randn(batch, kv_heads, 1, width)
    bias = None
    if padded:  # row 1 is left-padded by 5 tokens
        bias = torch.zeros(batch, 1, 1, n + 1)
        bias[1, ..., :5] = torch.finfo(torch.float32).min
    out = kvconvert_quant.token_decode(query, key, value, bias, keys, values, scaling=width**-0.5)
    k_all = torch.cat([keys.read(), key], 2).repeat_interleave(heads // kv_heads, 1)
    v_all = torch.cat([values.read(), value], 2).repeat_interleave(heads // kv_heads, 1)
    scores = query @ k_all.transpose(-1, -2) * width**-0.5 + (0 if bias is None else bias)
    expected = torch.softmax(scores, -1) @ v_all
    # the kernel reads queries and probability-weighted scales in bfloat16 (8-bit mantissa)
    torch.testing.assert_close(out, expected, rtol=0, atol=3e-2)
    assert (out - expected).abs().mean() < 4e-3


def decode_both_ways(runtime, directory, monkeypatch, new_tokens: int = 32, length: int = 24) -> torch.Tensor:
    """Prefill and ``new_tokens`` greedy steps of a left-padded batch through ``directory``, once reading
    the 4-bit codes (``runtime.token_decode``, counted) and once with the int4 kernel unavailable (the
    dequantizing path), fed the first run's tokens: logits within bf16 rounding at every step, and the same greedy
    choices except where the first run's two best logits are closer than the paths differ (a random tiny model's
    logits are flat: a tie broken the other way would send the two runs down different sequences). Returns the
    dequantizing path's logits."""
    ids, mask = left_padded(length)
    calls = []
    original = runtime.token_decode

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    def run(forced: torch.Tensor | None = None):
        model = kvconvert.load(directory).eval()
        follow = None if forced is None else (lambda row, sequence: [int(forced[row, sequence.shape[-1]])])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                             output_logits=True, pad_token_id=0, prefix_allowed_tokens_fn=follow)  # fmt: skip
        return torch.stack(out.logits), out.sequences

    monkeypatch.setattr(runtime, "token_decode", counted)
    kernel_logits, kernel_tokens = run()
    assert calls, "the codes were never read"
    monkeypatch.setattr(kvconvert_quant, "int4_kernel_available", lambda device: False)
    calls.clear()
    float_logits, float_tokens = run(forced=kernel_tokens)
    assert not calls and torch.equal(kernel_tokens, float_tokens)
    difference = (kernel_logits - float_logits).abs()
    assert difference.max() < 2e-2 * float_logits.abs().max()
    best = kernel_logits.topk(2, dim=-1).values
    near_tie = best[..., 0] - best[..., 1] <= 2 * difference.amax(-1)
    assert ((kernel_logits.argmax(-1) == float_logits.argmax(-1)) | near_tie).all()
    assert near_tie.float().mean() < 0.1  # the comparison is not vacuous
    return float_logits


@needs_kernel
def test_converted_model_decodes_from_the_codes_like_its_dequantized_path(tokenized_model_dir, tmp_path, monkeypatch):
    """The kernel path (int4 codes, bf16 products) and the dequantize-then-SDPA path agree; the cache is
    really quantized (the source decodes differently)."""
    src = tokenized_model_dir("llama_gqa64")
    report = convert("quant", src, tmp_path / "q", *TOKEN, "--kv-sink", "2")
    assert report["kv_storage"]["layout"] == "token"
    config = json.loads((tmp_path / "q" / "config.json").read_text())["kvconvert"]
    assert config["spec_version"] == 2  # a runtime that predates the layout refuses it instead of misreading it
    assert "token layout" in (tmp_path / "q" / "README.md").read_text()  # the model card says how it is stored
    float_logits = decode_both_ways(kvconvert_quant, tmp_path / "q", monkeypatch)
    ids, mask = left_padded()
    source = load_reference(src).generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                                          do_sample=False, return_dict_in_generate=True, output_logits=True,
                                          pad_token_id=0)  # fmt: skip
    assert not torch.allclose(torch.stack(source.logits), float_logits, rtol=1e-3, atol=1e-3)


@needs_kernel
def test_razor_retrieval_heads_decode_from_the_codes(tokenized_model_dir, tmp_path, monkeypatch):
    """Razor in the token layout: its retrieval heads' full stores are read from the codes at each decode
    step (the windows too once they hold a quantized block), like its dequantizing path; it generates in
    every mode."""
    src = tokenized_model_dir("llama_gqa64")
    convert("razor", src, tmp_path / "r", "--kv-budget", "0.5", "--profile-tokens", "16", "--window", "8", *TOKEN,
            "--kv-sink", "2")  # fmt: skip
    decode_both_ways(kvconvert_quant, tmp_path / "r", monkeypatch, new_tokens=40)
    generate_in_every_mode(load_converted(tmp_path / "r"))


@needs_kernel
@pytest.mark.parametrize("value_bits", [[], ["--kv-value-bits", "2"]], ids=["4-bit values", "2-bit values"])
def test_razor_windows_decode_from_the_codes_while_they_slide(value_bits, tokenized_model_dir, tmp_path, monkeypatch):
    """Windows of 40 tokens in 32-token blocks: the windows are read from the codes with razor's sink and
    compensation token, like the dequantizing path (same tokens and logits); they slide by whole 64-token
    units (freed as they leave), so a window holds between L and L + 63 tokens. With ``--kv-value-bits 2`` the
    values are KIVI's per-token codes, dropped in the keys' whole units (the readers assert both sides agree)."""
    src = tokenized_model_dir("llama_gqa64")
    convert("razor", src, tmp_path / "r", "--kv-budget", "0.5", "--profile-tokens", "16", "--window", "40", *TOKEN,
            "--kv-sink", "2", *value_bits)  # fmt: skip
    windows, freed, lengths = [], [], []
    original, evict = kvconvert_quant.token_decode, kvconvert_razor.RazorLayer.evict

    def recorded(*args, **kwargs):
        windows.append(len(args) > 7 or "extra" in kwargs)
        return original(*args, **kwargs)

    def counted(layer, valid):
        before = layer.recent_k.quantized_tokens
        evict(layer, valid)
        freed.append(before > layer.recent_k.quantized_tokens)
        assert isinstance(layer.recent_v, TokenLayoutStore) == (not value_bits)
        keys, values = layer.recent_k, layer.recent_v
        assert (values.quantized_tokens, values.offset) == (keys.quantized_tokens, keys.offset)
        lengths.append(len(layer.recent_k) - layer.recent_budget(layer.seen))

    monkeypatch.setattr(kvconvert_quant, "token_decode", recorded)  # what razor's ``token_reader`` hands out
    monkeypatch.setattr(kvconvert_razor.RazorLayer, "evict", counted)
    decode_both_ways(kvconvert_quant, tmp_path / "r", monkeypatch, new_tokens=40, length=100)
    assert any(windows) and any(freed) and min(lengths) >= 0 and max(lengths) < 64


def test_generate_and_measured_bytes(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa64")
    convert("quant", src, tmp_path / "q", *TOKEN)
    model = load_converted(tmp_path / "q")  # through AutoModelForCausalLM with trust_remote_code
    generate_in_every_mode(model)
    tokens = torch.randint(3, 90, (1, 168), generator=torch.Generator().manual_seed(0))
    measured = kv_bytes_per_token(model, tokens, 72, 168)  # both lengths: whole blocks + the same tail
    spec = QuantSpec(4, 32, 8, layout="token")
    values = 3 * 2 * 64  # layers × KV heads × head width
    accounted = values * (spec.bytes_per_value(64, per_channel=True) + spec.bytes_per_value(64, per_channel=False))
    assert measured == pytest.approx(accounted)
    assert measured < 0.3 * kv_bytes_per_token(load_reference(src), tokens, 72, 168)


def test_token_keys_beside_values_of_their_own_width(tokenized_model_dir, tmp_path):
    """``--kv-layout token --kv-value-bits 2`` (quant): keys stored as the token layout stores them (layer 0 of one
    prefill sees the same states as the 4-bit token layout's), values as a KIVI store of 2-bit rotated values holds
    transformers' own layer-0 values; it generates in every mode and holds the bytes its spec accounts."""
    src = tokenized_model_dir("llama_gqa64")
    convert("quant", src, tmp_path / "mixed", *TOKEN, "--kv-value-bits", "2")
    convert("quant", src, tmp_path / "token", *TOKEN)
    models = {name: kvconvert.load(tmp_path / name) for name in ("mixed", "token")}
    tokens = torch.randint(3, 90, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layers = {name: model(tokens, use_cache=True).past_key_values.layers[0] for name, model in models.items()}
        values = load_reference(src)(tokens, use_cache=True).past_key_values.layers[0].values
    mixed = layers["mixed"]
    assert isinstance(mixed.key_store, TokenLayoutStore) and not isinstance(mixed.value_store, TokenLayoutStore)
    assert kvconvert_quant.decodes_from_codes(mixed.key_store, mixed.value_store, torch.device("cpu")) == bool(MACHINE)
    torch.testing.assert_close(mixed.key_store.read(), layers["token"].key_store.read(), rtol=0, atol=0)
    kivi = TokenStore(QuantSpec(2, 32, 8, rotate=True), per_channel=False)
    kivi.append(values)
    torch.testing.assert_close(mixed.value_store.read(), kivi.read(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mixed.value_store.read(), layers["token"].value_store.read(), atol=1e-3)
    loaded = load_converted(tmp_path / "mixed")  # through AutoModelForCausalLM, trust_remote_code
    generate_in_every_mode(loaded)
    ids, mask = left_padded()
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught:  # a static layer of its own: nothing said
        warnings.simplefilter("always")
        static = loaded.generate(**common, cache_implementation="static", return_dict_in_generate=True)
    assert not [str(w.message) for w in caught if "kvconvert" in str(w.message)]
    assert {type(layer).__name__ for layer in static.past_key_values.layers} == {"StaticTokenLayoutLayer"}
    assert torch.equal(static.sequences, loaded.generate(**common))
    tokens = torch.randint(3, 90, (1, 168), generator=torch.Generator().manual_seed(0))
    measured = kv_bytes_per_token(models["mixed"], tokens, 72, 168)
    spec = QuantSpec(4, 32, 8, layout="token", value_bits=2)
    keys, values = spec.side(0, keys=True), spec.side(0, keys=False)
    assert values.layout == "kivi" and values.bits == 2 and values.rotate
    per_value = keys.bytes_per_value(64, per_channel=True) + values.bytes_per_value(64, per_channel=False)
    accounted = 3 * 2 * 64 * per_value  # layers × KV heads × head width
    assert measured == pytest.approx(accounted)
    assert measured < kv_bytes_per_token(models["token"], tokens, 72, 168)
    # razor composes with it: retrieval heads and windows store their values so, and hold fewer bytes
    for name, extra in (("razor-mixed", ["--kv-value-bits", "2"]), ("razor-token", [])):
        convert("razor", src, tmp_path / name, "--kv-budget", "0.5", "--profile-tokens", "16", "--window", "8",
                *TOKEN, *extra)  # fmt: skip
    razor = {name: kvconvert.load(tmp_path / name) for name in ("razor-mixed", "razor-token")}
    layer = razor["razor-mixed"](tokens, use_cache=True).past_key_values.layers[0]
    assert isinstance(layer.full_k, TokenLayoutStore) and not isinstance(layer.full_v, TokenLayoutStore)
    assert layer.full_v.quant.bits == 2 and layer.full_v.quantized_tokens == layer.full_k.quantized_tokens
    measured = {name: kv_bytes_per_token(model, tokens, 72, 168) for name, model in razor.items()}
    assert measured["razor-mixed"] < measured["razor-token"]
    generate_in_every_mode(load_converted(tmp_path / "razor-mixed"))


@needs_kernel
def test_token_keys_beside_2bit_values_decode_from_the_codes(tokenized_model_dir, tmp_path, monkeypatch):
    """``--kv-layout token --kv-value-bits 2``: decode steps read the keys' int4 codes and the values' 2-bit codes
    (``token_decode``) and generate what the dequantizing path does, sink and left padding included."""
    src = tokenized_model_dir("llama_gqa64")
    convert("quant", src, tmp_path / "mixed", *TOKEN, "--kv-value-bits", "2", "--kv-sink", "2")
    decode_both_ways(kvconvert_quant, tmp_path / "mixed", monkeypatch, new_tokens=40)


def test_token_layout_refusals(tiny_model_dir, tokenized_model_dir, tmp_path):
    narrow = tiny_model_dir("llama_gqa")  # head width 16
    result = run_cli("quant", "--model", str(narrow), "--out", str(tmp_path / "a"), *TOKEN)
    assert result.exit_code == 2 and "multiple of 32" in result.output
    wide = tokenized_model_dir("llama_gqa64")
    result = run_cli("lorc", "--model", str(wide), "--out", str(tmp_path / "b"), "--kv-budget", "0.75", *TOKEN)
    assert result.exit_code == 2 and "--kv-layout token is for quant and razor only" in result.output
    result = run_cli("quant", "--model", str(wide), "--out", str(tmp_path / "c"), "--kv-bits", "3", "--kv-layout",
                     "token")  # fmt: skip
    assert result.exit_code == 2 and "the token layout is 4-bit storage" in result.output
    assert not any((tmp_path / name).exists() for name in "abc")


@needs_kernel
def test_a_kernel_that_computes_otherwise_is_not_trusted(monkeypatch):
    """The probe checks the kernel's product too: a packing that matches is not enough (a torch whose
    kernel read the codes another way would decode by dequantizing, not misread them)."""
    real = torch.ops.aten._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", lambda x, b, g, s: real(x, b, g, s) * 2)
    assert kvconvert_tokenlayout.cpu_int4_rows.__wrapped__() is None
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", real)
    assert kvconvert_tokenlayout.cpu_int4_rows.__wrapped__() == MACHINE


def test_machine_layout_is_the_one_its_capability_packs():
    """The layouts ATen's packer writes on the CPUs this suite has run on (AVX2 on an Intel Xeon, AVX-512 on an AMD
    EPYC Zen 4; the plain loop under ``ATEN_CPU_CAPABILITY=default``, the next test)."""
    expected = {"AVX2": Int4Rows(32, True), "AVX512": Int4Rows(64, True), "DEFAULT": Int4Rows(32, False)}
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in expected or not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        pytest.skip(f"no expectation written for {capability}")
    assert expected[capability] == MACHINE


@pytest.mark.slow
@needs_kernel
def test_decode_from_the_codes_under_another_cpu_capability():
    """The same kernel-path tests in a process whose ATen runs its plain loop (``ATEN_CPU_CAPABILITY=default``:
    another int4 packing). Before the layout was found at run time, this CPU decoded garbage."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this process already runs the plain loop")
    tests = "torchs_own or machine_layout or kernel_decode_equals or decodes_from_the_codes_like"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    assert "20 passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


def test_the_token_layout_says_once_that_off_a_cpu_it_dequantizes_every_step():
    """Off a CPU, where the GPU kernel cannot read the token layout's codes (a device that is no CUDA GPU, Triton
    missing, ``KVCONVERT_KERNELS=torch``), every step dequantizes (0.01x the original on an H200): the runtime says so
    once, not at every block, and names the way out."""
    kvconvert_tokenlayout._warn_off_cpu.cache_clear()
    spec = QuantSpec(4, 32, residual=0, layout="token")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TokenLayoutStore(spec, keys=True).extend(torch.randn(1, 2, 64, 64))
        assert not [w for w in caught if "token layout" in str(w.message)]  # on the CPU: nothing to say
        for _ in range(2):
            store = TokenLayoutStore(spec, keys=True)
            store.extend(torch.randn(1, 2, 64, 64, device="meta"))  # any device that is not a CPU
    said = [w for w in caught if "token layout" in str(w.message)]
    assert len(said) == 1 and "meta" in str(said[0].message) and "Triton" in str(said[0].message)
