"""The token layout (``--kv-layout token``): keys minus their block means and values, both rotated
and quantized per token in torch's int4 matrix layout, read by ``aten._weight_int4pack_mm_for_cpu``
without dequantizing. Checked against plain-torch references: the packing against torch's own
packer, the stored values against a fake quantizer written out here, the kernel decode against
float attention over the dequantized cache, and the whole model's kernel path against its
dequantize-then-SDPA path."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import convert, generate_in_every_mode, left_padded, load_converted, load_reference, run_cli

import kvconvert
from kvconvert.eval.memory import kv_bytes_per_token
from kvconvert.runtime import kvconvert_quant, kvconvert_razor
from kvconvert.runtime.kvconvert_storage import (
    QuantSpec,
    TokenLayoutStore,
    int4_pack_rows,
    int4_unpack_rows,
    rotation,
    token_group_size,
)

HAS_KERNEL = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="this torch has no CPU int4 matmul kernel")
TOKEN = ("--kv-bits", "4", "--kv-group", "32", "--kv-residual", "8", "--kv-layout", "token")


@needs_kernel
@pytest.mark.parametrize("rows, cols", [(32, 64), (96, 32), (64, 256)])
def test_int4_rows_are_torchs_own_packing(rows, cols):
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(rows))
    packed = int4_pack_rows(codes)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
    assert torch.equal(int4_unpack_rows(packed), codes)


def test_token_group_size():
    assert token_group_size(64, 64) == 64 and token_group_size(128, 64) == 64 and token_group_size(96, 64) == 32
    assert token_group_size(64, 32) == 32 and token_group_size(256, 128) == 128 and token_group_size(80, 64) is None


def reference_token_layout(x: torch.Tensor, group: int, size: int, keys: bool) -> torch.Tensor:
    """Plain-torch fake quantization of whole blocks ``x [..., n, d]``: (keys) minus each block's
    per-channel mean in float16, rotated per group of ``size`` channels, 4-bit per token and group
    (keys: bfloat16 scale rounded up and the kernel's zero, the value of code 8; values: float16 scale
    rounded up, zero rounded down), rotated back."""
    *lead, n, d = x.shape
    x = x.float()
    center = torch.zeros_like(x)
    if keys:
        blocks = x.reshape(*lead, n // group, group, d)
        center = blocks.mean(-2, keepdim=True).half().float().expand_as(blocks).reshape(x.shape)
    r = rotation(size)
    y = (x - center).reshape(*lead, n, d // size, size) @ r
    low, high = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    if keys:
        scale = _up((high - low) / 15, torch.bfloat16)
        zero = (low + 8 * scale).to(torch.bfloat16).float()
        y_hat = (((y - zero) / scale + 8).round().clamp(0, 15) - 8) * scale + zero
    else:
        zero = _down(low, torch.float16)
        scale = _up((high - zero) / 15, torch.float16)
        y_hat = ((y - zero) / scale).round().clamp(0, 15) * scale + zero
    return (y_hat @ r.T).reshape(x.shape) + center


def _down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest ``dtype`` value ≤ x, as float32."""
    h = x.to(dtype)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -float("inf"))), h).float()


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
    # matmul sums in another order for another batch shape (the store quantizes block by block)
    assert (error > 1e-5).float().mean() < 1e-3 and error.max() < 0.05
    assert torch.equal(store.read()[..., 5 * group :, :], x[..., 5 * group :, :])  # the tail stays exact
    assert 0 < (expected - x[..., : 5 * group, :]).abs().mean() < 0.1


def _filled(batch: int, kv_heads: int, n: int, width: int, group: int, sink: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    spec = QuantSpec(4, group, residual=0, sink=sink, layout="token")
    keys, values = TokenLayoutStore(spec, keys=True), TokenLayoutStore(spec, keys=False)
    k = torch.randn(batch, kv_heads, n, width, generator=generator)
    k[..., 5] += 4.0
    v = torch.randn(batch, kv_heads, n, width, generator=generator)
    keys.append(k)
    values.append(v)
    return keys, values, generator


@needs_kernel
@pytest.mark.parametrize("width, group, sink", [(64, 64, 0), (64, 32, 3), (128, 64, 4)])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_decode_equals_float_attention_over_the_dequantized_cache(width, group, sink, padded):
    batch, kv_heads, heads, n = 2, 2, 6, 5 * group + 9
    keys, values, generator = _filled(batch, kv_heads, n, width, group, sink, seed=width + sink)
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


def decode_both_ways(runtime, directory, monkeypatch, new_tokens: int = 32) -> torch.Tensor:
    """Prefill and ``new_tokens`` greedy steps of a left-padded batch through ``directory``, once reading
    the 4-bit codes (``runtime.token_decode``, counted) and once with the int4 kernel unavailable (the
    dequantizing path): the same tokens, logits within bf16 rounding. Returns the dequantizing path's logits."""
    ids, mask = left_padded()
    calls = []
    original = runtime.token_decode

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    def run():
        model = kvconvert.load(directory).eval()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                             output_logits=True, pad_token_id=0)  # fmt: skip
        return torch.stack(out.logits), out.sequences

    monkeypatch.setattr(runtime, "token_decode", counted)
    kernel_logits, kernel_tokens = run()
    assert calls, "the codes were never read"
    monkeypatch.setattr(runtime, "int4_kernel_available", lambda device: False)
    calls.clear()
    float_logits, float_tokens = run()
    assert not calls
    assert (kernel_logits - float_logits).abs().max() < 2e-2 * float_logits.abs().max()
    assert torch.equal(kernel_tokens, float_tokens)
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
    step (the windows stay in KIVI's layout), like its dequantizing path; it generates in every mode."""
    src = tokenized_model_dir("llama_gqa64")
    convert("razor", src, tmp_path / "r", "--kv-budget", "0.5", "--profile-tokens", "16", "--window", "8", *TOKEN,
            "--kv-sink", "2")  # fmt: skip
    decode_both_ways(kvconvert_razor, tmp_path / "r", monkeypatch, new_tokens=40)
    generate_in_every_mode(load_converted(tmp_path / "r"))


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
