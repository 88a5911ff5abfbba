"""The token layout's static cache (``StaticTokenLayoutLayer``): ``generate(cache_implementation="static")`` on a
``quant --kv-layout token`` output preallocates int4 rows for every block, decodes from the codes with torch's CPU
int4 kernel over every block's room (masked by position), and holds what the growing token-layout cache holds;
``torch.compile`` decodes from it in one graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import STORE_CHUNKS, compiled_generate, convert, left_padded, load_converted, static_store_steps

import kvconvert
from kvconvert.runtime import kvconvert_tokenlayout
from kvconvert.runtime.kvconvert_codec import QuantSpec, token_group_size
from kvconvert.runtime.kvconvert_tokenlayout import Int4Rows, StaticTokenLayoutStore, TokenLayoutStore, cpu_int4_rows
from kvconvert.runtime.kvconvert_tokenstore import TokenStore

SEARCHES = {
    "greedy": {"do_sample": False},
    "beams": {"num_beams": 2, "do_sample": False},
    "sampling, 2 returned": {"do_sample": True, "top_k": 20, "num_return_sequences": 2},
}
# prompts of 200 tokens: prefill quantizes whole blocks, decode fills one more. Groups of 64 tokens: whole rows of
# every int4 layout torch packs, so both caches are read by the kernel (a 32-token group under AVX-512's 64-row
# blocks is read by dequantizing: the store test below), and greedy ties break alike
TOKEN = {
    "groups of 64, residual 16": ("--kv-group", "64", "--kv-residual", "16"),
    "groups of 64, no residual, sink 4": ("--kv-group", "64", "--kv-residual", "0", "--kv-sink", "4"),
    # values of their own width (per token in KIVI's packing, rotated), read from their codes beside the keys'
    "values 2-bit, sink 4": ("--kv-group", "64", "--kv-residual", "0", "--kv-sink", "4", "--kv-value-bits", "2"),
}


@pytest.fixture(scope="module")
def token_layout(tokenized_model_dir, tmp_path_factory):
    made = {}
    for name, args in TOKEN.items():
        made[name] = tmp_path_factory.mktemp("static-token") / "out"
        convert("quant", tokenized_model_dir("llama_gqa64"), made[name], "--kv-bits", "4", "--kv-layout", "token",
                *args)  # fmt: skip
    return made


def _generate(model, length: int = 200, new: int = 40, **kwargs):
    ids, mask = left_padded(length)
    torch.manual_seed(7)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip


def _reads(out) -> set[bool]:
    """Whether each static layer's stores were read by the int4 kernel (False: dequantized)."""
    return {layer.key_store.reads_codes for layer in out.past_key_values.layers}


@pytest.mark.parametrize("name", TOKEN)
def test_the_token_layout_has_a_static_cache_that_decodes_as_its_growing_one(name, token_layout):
    """Every search on a left-padded batch gives the growing token-layout cache's tokens, with blocks quantized at
    prefill and during decode (40 steps); the static cache is what generate used. Where the int4 kernel reads both,
    its bfloat16 products round differently over the static cache's room than over the growing stores on some CPUs
    (an Intel Xeon with AVX-512 BF16: greedy tokens parted at step 30 of the tiny random model): tokens may then part
    only at a step whose logits, the same tokens read until then, agree within the kernel's error (a near-tie)."""
    model = load_converted(token_layout[name])
    for search, kwargs in SEARCHES.items():
        dynamic = _generate(model, **kwargs)
        static = _generate(model, cache_implementation="static", **kwargs)
        if cpu_int4_rows() is None or torch.equal(static.sequences, dynamic.sequences):
            assert torch.equal(static.sequences, dynamic.sequences), f"{name}, {search}"
            continue
        prompt = static.sequences.shape[1] - len(static.logits)
        step = int((static.sequences != dynamic.sequences).any(0).nonzero()[0]) - prompt  # the first step parting
        a, b = dynamic.logits[step], static.logits[step]
        diff, scale = (a - b).abs().max().item(), a.abs().max().item()
        assert diff <= KERNEL_TOLERANCE * scale, f"{name}, {search}, step {step}: |Δlogit| {diff:.3g} of {scale:.3g}"
    assert {type(layer).__name__ for layer in static.past_key_values.layers} == {"StaticTokenLayoutLayer"}
    assert static.past_key_values.is_compileable
    assert _reads(static) == {cpu_int4_rows() is not None}


@pytest.mark.parametrize("kernel", [True, False], ids=["int4 kernel", "dequantized"])
def test_the_static_token_layout_holds_the_growing_ones_values(kernel, token_layout, monkeypatch):
    """Greedy logits of the unpadded row against the growing cache's: read by dequantizing (no int4 kernel on this
    machine), the stores hold the same values, so the logits agree to float32 summation order; read by the kernel, to
    its bfloat16 operands' rounding (an earlier layer's float32 difference can move a query's bfloat16 rounding, and
    the kernel's own error is ~0.5 % of a logit: this machine's kernel path against its dequantized one)."""
    if not kernel:  # kvconvert.load: the installed runtime, which this test can patch
        monkeypatch.setattr(kvconvert_tokenlayout, "cpu_int4_rows", lambda: None)
    elif cpu_int4_rows() is None:
        pytest.skip("no int4 kernel on this machine")
    model = kvconvert.load(token_layout["groups of 64, residual 16"]).eval()
    dynamic, static = _generate(model), _generate(model, cache_implementation="static")
    assert _reads(static) == {kernel}
    _same_logits(dynamic, static, KERNEL_TOLERANCE if kernel else 1e-4)


# the int4 kernel's products take bfloat16 operands: logits of two caches read by it agree to this share of the
# largest logit (an earlier layer's float32 difference can move a query's bfloat16 rounding)
KERNEL_TOLERANCE = 3e-3


def _same_logits(expected, got, tolerance: float) -> None:
    """Greedy logits of the unpadded row (a fully masked padding query averages over every slot, and a static cache
    has more of them)."""
    for step, (a, b) in enumerate(zip(expected.logits, got.logits, strict=True)):
        diff, scale = (a[0] - b[0]).abs().max().item(), a[0].abs().max().item()
        assert diff <= tolerance * scale, f"step {step}: max |Δlogit| {diff:.3g} > {tolerance} × {scale:.3g}"


@pytest.mark.parametrize("group, residual, sink, value_bits", [(64, 16, 0, None), (64, 0, 4, None), (128, 8, 2, None),
                                                               (64, 0, 4, 2), (128, 8, 2, 3)])  # fmt: skip
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tensor ops"])
def test_a_static_token_layout_step_attends_as_token_decode(group, residual, sink, value_bits, compiled, monkeypatch):
    """Independent of the model: ``StaticTokenLayoutLayer``'s decode step (every block's room, masked by position;
    eagerly the blocks written so far) equals ``token_decode`` over growing stores fed the same tokens, step by step
    across block boundaries, with a left-padded row and the sink's stand-ins; values of their own width
    (``value_bits``) stored per token in KIVI's packing on both sides."""
    from kvconvert.runtime.kvconvert_quant import token_decode
    from kvconvert.runtime.kvconvert_storage import StaticStoreLayer
    from kvconvert.runtime.kvconvert_tokenstatic import StaticTokenLayoutLayer

    machine = cpu_int4_rows()
    if machine is None or group % machine.block:
        pytest.skip("this machine's int4 kernel does not read these stores")
    if compiled:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    spec = QuantSpec(bits=4, group=group, residual=residual, sink=sink, layout="token", value_bits=value_bits)
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, width, prompt, steps, room = 2, 4, 2, 64, 150, 80, 260
    k = torch.randn(batch, kv_heads, prompt + steps, width, generator=g) * torch.linspace(0.5, 4, width)
    v, q = torch.randn(batch, kv_heads, prompt + steps, width, generator=g), torch.randn(batch, heads, steps, width)
    attend = torch.ones(batch, room, dtype=torch.bool)
    attend[1, :9] = False  # a left-padded row
    growing_k = TokenLayoutStore(spec, True)
    growing_v = TokenLayoutStore(spec, False) if value_bits is None else TokenStore(spec.side(0, False), False)
    growing_k.append(k[..., :prompt, :])
    growing_v.append(v[..., :prompt, :])
    layer = StaticTokenLayoutLayer(spec, 0, room)
    StaticStoreLayer.update(layer, k[..., :prompt, :], v[..., :prompt, :])
    for step in range(steps):
        at = prompt + step
        query, key, value = q[..., step : step + 1, :], k[..., at : at + 1, :], v[..., at : at + 1, :]
        bias = torch.where(attend[:, None, None, : at + 1], 0.0, torch.finfo(torch.float32).min)
        expected = token_decode(query, key, value, bias, growing_k, growing_v, width**-0.5)
        growing_k.append(key)
        growing_v.append(value)
        got = layer._decode(query, key, value, attend[:, None, None, :] & (torch.arange(room) <= at), width**-0.5)
        # eagerly both read the blocks written so far alike; compiled, the static step reads every slot of the room,
        # and on some CPUs (an Intel Xeon with AVX-512 BF16) the int4 kernel's bfloat16 products then round
        # differently: 6e-4 of outputs of ~1 measured there, within the kernel's own error (KERNEL_TOLERANCE)
        diff, scale = (got - expected).abs().max().item(), expected.abs().max().item()
        bound = KERNEL_TOLERANCE * scale if compiled else 1e-5
        assert diff <= bound, f"step {step}: max |Δ| {diff:.3g} > {bound:.3g}"
    assert int(layer.filled) == prompt + steps


@pytest.mark.parametrize("name", ["groups of 64, residual 16", "values 2-bit, sink 4"])
def test_compiled_decode_from_the_static_token_layout(name, token_layout):
    """generate compiles the decode step (fullgraph: the int4 kernel calls and the block writes in one graph) and
    decodes what the eager growing cache decodes: the same tokens; the same logits until a block is quantized inside
    the compiled graph (step 8), then within what Inductor's own rounding of that block moves them on this tiny
    random model (``test_a_compiled_block_write_quantizes_as_the_eager_one``)."""
    model = load_converted(token_layout[name])
    eager = _generate(model, new=12)
    compiled = compiled_generate(model, lambda m, **kw: _generate(m, new=12, **kw))
    assert torch.equal(compiled.sequences, eager.sequences)
    first = dataclasses.replace(compiled, logits=compiled.logits[:8])
    _same_logits(dataclasses.replace(eager, logits=eager.logits[:8]), first, KERNEL_TOLERANCE)
    _same_logits(eager, compiled, 0.05)


def test_a_compiled_block_write_quantizes_as_the_eager_one():
    """``_write_one`` (a decode token stored with tensor ops only) compiled by Inductor against the same writes run
    eagerly, across two block fills: the stores dequantize to the same tokens but for Inductor's own rounding (its
    reductions sum block means in another order: a float16 mean one step apart moves that block's codes), which is
    small beside the quantization's own error. Before ``round_up`` rounded on float32's bits, half of a compiled
    step's key scales were cast down to below the range they must cover."""
    spec = QuantSpec(bits=4, group=64, residual=16, layout="token")
    x = torch.randn(2, 2, 340, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.5, 4, 64)
    for keys in (True, False):
        eager, compiled = StaticTokenLayoutStore(spec, keys, 360), StaticTokenLayoutStore(spec, keys, 360)
        for store in (eager, compiled):
            store.extend(x[..., :200, :], torch.tensor(0))
        write = torch.compile(compiled._write_one, fullgraph=True)
        for at in range(200, 340):
            eager._write_one(x[..., at : at + 1, :], torch.tensor(at))
            write(x[..., at : at + 1, :], torch.tensor(at))
        expected, got = (s.extend(x[..., 340:341, :], torch.tensor(340))[..., :340, :] for s in (eager, compiled))
        # measured: the mean difference 2 % (keys) and 0.3 % (values) of the eager cache's own quantization error
        error, quantization = (got - expected).abs(), (expected - x[..., :340, :]).abs()
        assert error.mean() < 0.05 * quantization.mean(), keys
        assert error.max() < quantization.max(), keys


@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize(
    "group, residual, sink, width", [(64, 16, 0, 64), (32, 0, 4, 64), (64, 64, 2, 128), (96, 8, 0, 96)]
)
@pytest.mark.parametrize("writes", ["counts read", "tensor ops"])
@pytest.mark.parametrize("machine", [Int4Rows(64, True), Int4Rows(32, True)])
def test_static_token_layout_store_holds_what_the_growing_store_holds(keys, group, residual, sink, width, writes,
                                                                      machine, monkeypatch):  # fmt: skip
    """Independent of how tokens arrive, ``StaticTokenLayoutStore`` gives each step what ``TokenLayoutStore.extend``
    gives it (the same codes, scales and block means, up to the rotation's rounding), under either layout torch
    packs int4 rows in on a CPU; written with the count read or with tensor ops only (a compiled step)."""
    monkeypatch.setattr(kvconvert_tokenlayout, "cpu_int4_rows", lambda: machine)
    if writes == "tensor ops":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    spec = QuantSpec(bits=4, group=group, residual=residual, sink=sink, layout="token")
    growing, static = TokenLayoutStore(spec, keys), StaticTokenLayoutStore(spec, keys, sum(STORE_CHUNKS) + 5)
    for filled, got, expected, x in static_store_steps(growing, static, width):
        # the rotation is a float product whose rounding may differ with its operand's layout: a token's value may
        # cross a rounding boundary (one code, or one float16 step of its zero), and the rotation back spreads that
        # over the token's channel group; a misplaced block or scale would differ everywhere, and by the values' size
        error = (got - expected).abs()
        assert error.amax(-1).gt(1e-4).float().mean() < 0.01, f"after {filled} tokens"
        assert error.max() < 0.05 * x.abs().max(), f"after {filled} tokens"
    # key rows: whole blocks of the kernel's layout per kv group; value rows (channels): as the growing store's
    size = token_group_size(width, group)
    assert size is not None
    assert static.reads_codes == (
        group % machine.block == 0 if keys else size % machine.block == 0 or size < machine.block
    )
