"""Razor's static cache in the token layout (``StaticRazorTokenLayer``): ``generate(cache_implementation="static")``
on a ``razor --kv-bits 4 --kv-layout token`` output preallocates the retrieval heads' int4 rows and a ring of blocks for
the other heads' windows, which slide by whole 64-token units as the growing cache's do, and decodes what the
growing cache decodes; ``torch.compile`` decodes from it in one graph."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    compiled_generate,
    convert,
    left_padded,
    load_converted,
    razor_static_steps,
    replays_as_a_cuda_graph,
)

from kvconvert.runtime import kvconvert_razor_token, kvconvert_tokenlayout
from kvconvert.runtime.kvconvert_codec import QuantSpec
from kvconvert.runtime.kvconvert_tokenlayout import cpu_int4_rows

# the int4 kernel's products take bfloat16 operands, and a static step weighs the values of every slot of its ring in
# another order than the growing window's: outputs agree to this share of the largest (test_static_token_layout's)
KERNEL_TOLERANCE = 3e-3

# a prefill past the window, decode tokens across block and unit boundaries, chunks that drop units at once
CHUNKS = [1, 1, 5, *[1] * 12, 150, *[1] * 70, 90, *[1] * 80, 64, *[1] * 30]


@pytest.mark.parametrize("sink, window, frac, retrieval, storage", [
    (2, 96, 0.25, [1], {"group": 64, "residual": 16}),
    (2, 64, 0.2, [], {"group": 64, "residual": 0, "sink": 4}),
    (0, 80, 0.3, [2], {"group": 64, "residual": 0, "sink": 4, "value_bits": 2}),
    (3, 100, 0.1, [0, 2], {"group": 32, "residual": 8, "sink": 2}),
])  # fmt: skip
@pytest.mark.parametrize("writes", ["counts read", "tensor ops"])
@pytest.mark.parametrize("reads", ["codes", "dequantized"])
def test_static_razor_token_layer_attends_as_the_growing_one(sink, window, frac, retrieval, storage, writes, reads,
                                                             monkeypatch):  # fmt: skip
    """Chunks and single decode tokens (a left-padded row, the sink filling, windows growing with ``frac``) give each
    step what ``RazorLayer`` in the token layout gives it, and the compensation sums end equal: the windows' fronts
    move by whole units at the same counts and the units leave into the sums as the growing store hands them over.
    Read from the codes by the CPU's int4 kernel where it reads them (the windows' ring in the same pass), or with no
    int4 kernel, both sides dequantizing (then to float32's rounding); written with the count read or with tensor
    ops only (a compiled step's writes)."""
    if reads == "dequantized":
        monkeypatch.setattr(kvconvert_tokenlayout, "cpu_int4_rows", lambda: None)
    elif cpu_int4_rows() is None:
        pytest.skip("this machine has no int4 kernel that reads the token layout")
    if writes == "tensor ops":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    rings = []
    int4_decode = kvconvert_razor_token.int4_decode

    def counted(*args, **kwargs):
        rings.append(kwargs.get("ring", False))
        return int4_decode(*args, **kwargs)

    monkeypatch.setattr(kvconvert_razor_token, "int4_decode", counted)
    quant = QuantSpec(bits=4, layout="token", **storage)
    machine = cpu_int4_rows()
    codes = reads == "codes" and machine is not None and storage["group"] % machine.block == 0
    # both read by the kernel; or the growing stores only (a group of 32 tokens under AVX-512's 64-row blocks packs
    # the static stores pairwise, which they dequantize): the kernel's own bfloat16 error against float32 (measured
    # 3.6e-3 of outputs of ~1 on an AMD EPYC); neither: float32's rounding, and a value's float16 zero that may round
    # one step apart (below): 1.7e-5 of outputs of ~0.5 on an Intel Xeon with AMX, where 1e-5 had held on AMD EPYCs
    tolerance = KERNEL_TOLERANCE if codes else 1e-2 if reads == "codes" else 1e-4
    # the sums: a value's float16 zero may round one step apart where the two stores quantize a block from
    # differently shaped operands (its rotation's rounding: test_static_token_layout's store test), which the
    # rotation back spreads over a channel group (measured: 1.3e-4 of sums of ~200 tokens, groups of 32)
    razor_static_steps(sink, window, frac, retrieval, tolerance=tolerance, quant=quant, chunks=CHUNKS, dim=64,
                       sums_atol=1e-3)  # fmt: skip
    # both kinds of head (every case has both but one, which keeps no head whole) read from their codes wherever
    # the kernel reads the keys' rows
    assert (True in rings) == codes
    assert (False in rings) == (codes and bool(retrieval))


@pytest.mark.parametrize("storage, window, reason", [
    ({"group": 64, "residual": 16}, 96, None),
    ({"group": 64, "residual": 16}, 64, "64 tokens, shorter than residual + group (80)"),
    ({"group": 64, "residual": 0, "value_bits": 2}, 64, None),
])  # fmt: skip
def test_razor_in_the_token_layout_has_a_static_layer_for_windows_wide_enough(storage, window, reason):
    """A window at least residual + group wide only ever drops tokens already in blocks, so its blocks follow the
    positions (a narrower one may drop the float tail too, shifting them): a static layer, or the reason."""
    from kvconvert.runtime.kvconvert_common import static_refusal

    spec = {"method": "razor", "kv_quant": QuantSpec(bits=4, layout="token", **storage).to_spec(),
            "razor": {"retrieval_kv_heads": [[0], [1]], "window": window}}  # fmt: skip
    said = static_refusal(spec, static_windows=True)
    assert said is None if reason is None else said is not None and reason in said, said


RAZOR_TOKEN = {
    "4-bit, residual 16": ("--kv-residual", "16"),
    "values 2-bit, sink 4": ("--kv-residual", "0", "--kv-sink", "4", "--kv-value-bits", "2"),
}


@pytest.fixture(scope="module")
def razor_token(tokenized_model_dir, tmp_path_factory):
    made = {}
    for name, args in RAZOR_TOKEN.items():
        made[name] = tmp_path_factory.mktemp("static-razor-token") / "out"
        # windows of 96 tokens: over prompts of 200 a unit leaves at prefill and another while it decodes
        convert("razor", tokenized_model_dir("llama_gqa64"), made[name], "--profile-tokens", "16", "--induction-frac",
                "0.1", "--echo-frac", "0", "--window", "96", "--kv-bits", "4", "--kv-layout", "token", "--kv-group",
                "64", *args)  # fmt: skip
    return made


def _generate(model, new: int = 40, **kwargs):
    ids, mask = left_padded(200)
    torch.manual_seed(7)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip


def _same_or_near_tie(dynamic, static, name: str) -> None:
    """The same tokens; where the int4 kernel reads both caches, tokens may part only at a step whose logits, the
    same tokens read until then, agree within the kernel's error (a near-tie: test_static_token_layout's rule)."""
    if cpu_int4_rows() is None or torch.equal(static.sequences, dynamic.sequences):
        assert torch.equal(static.sequences, dynamic.sequences), name
        return
    prompt = static.sequences.shape[1] - len(static.logits)
    step = int((static.sequences != dynamic.sequences).any(0).nonzero()[0]) - prompt
    a, b = dynamic.logits[step], static.logits[step]
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    assert diff <= KERNEL_TOLERANCE * scale, f"{name}, step {step}: |Δlogit| {diff:.3g} of {scale:.3g}"


@pytest.mark.parametrize("name", RAZOR_TOKEN)
def test_razor_in_the_token_layout_has_a_static_cache_that_decodes_as_its_growing_one(name, razor_token):
    """Every search on a left-padded batch gives the growing cache's tokens; the static cache is what generate used."""
    model = load_converted(razor_token[name])
    searches = {"greedy": {"do_sample": False}, "beams": {"num_beams": 2, "do_sample": False},
                "sampling, 2 returned": {"do_sample": True, "top_k": 20, "num_return_sequences": 2}}  # fmt: skip
    for search, kwargs in searches.items():
        dynamic = _generate(model, **kwargs)
        static = _generate(model, cache_implementation="static", **kwargs)
        _same_or_near_tie(dynamic, static, f"{name}, {search}")
    kinds = {type(layer).__name__ for layer in static.past_key_values.layers}
    assert kinds == {"StaticRazorTokenLayer"} and static.past_key_values.is_compileable


def test_compiled_decode_from_razor_in_the_token_layout(razor_token):
    """generate compiles the decode step (fullgraph: the int4 kernel calls, the ring's masks, the block writes and a
    unit's compensation in one graph) and decodes what the eager growing cache decodes."""
    model = load_converted(razor_token["4-bit, residual 16"])
    eager = _generate(model, new=12)
    compiled = compiled_generate(model, lambda m, **kw: _generate(m, new=12, **kw))
    _same_or_near_tie(eager, compiled, "compiled")


def test_razor_in_the_token_layout_decodes_from_its_static_cache_in_bfloat16(razor_token):
    """A bfloat16 model (the exact columns, the ring's bias and the compensation token in the model's dtype, the int4
    kernel's products in float32): finite logits, and greedy tokens as the growing cache's or parting at a near-tie
    of bfloat16's own error."""
    model = load_converted(razor_token["values 2-bit, sink 4"]).to(torch.bfloat16)
    dynamic, static = _generate(model, new=16), _generate(model, new=16, cache_implementation="static")
    assert all(torch.isfinite(step).all() for step in static.logits)
    if not torch.equal(static.sequences, dynamic.sequences):
        prompt = static.sequences.shape[1] - len(static.logits)
        step = int((static.sequences != dynamic.sequences).any(0).nonzero()[0]) - prompt
        a, b = dynamic.logits[step].float(), static.logits[step].float()
        assert (a - b).abs().max() <= 0.02 * a.abs().max(), f"step {step}"


def test_a_static_razor_token_step_replays_as_a_cuda_graph(razor_token):
    """A decode step captured as a CUDA graph and replayed (on a CPU, the same loop uncaptured) decodes what eager
    steps decode, from a prompt past the window: no step copies from the host or reads a device value."""
    replays_as_a_cuda_graph(load_converted(razor_token["4-bit, residual 16"]), "razor + 4-bit token layout", 200)


def test_razor_in_the_token_layout_on_gemma3_has_a_static_cache(tokenized_model_dir, tmp_path):
    """Gemma 3 (one KV head, QK-norm, sliding-window layers left stock in transformers' own static windows, scaled
    queries; no head kept whole, so the global layers' one KV head is windowed): greedy decoding of a left-padded batch
    from the static cache gives the growing cache's tokens (or parts at a near-tie of the int4 kernel's error), the
    global layers in ``StaticRazorTokenLayer``, a unit leaving their windows."""
    convert("razor", tokenized_model_dir("gemma3_64"), tmp_path / "out", "--profile-tokens", "16", "--induction-frac",
            "0", "--echo-frac", "0", "--window", "96", "--kv-bits", "4", "--kv-layout", "token", "--kv-group", "64",
            "--kv-residual", "16")  # fmt: skip
    model = load_converted(tmp_path / "out")
    dynamic, static = _generate(model, new=24), _generate(model, new=24, cache_implementation="static")
    _same_or_near_tie(dynamic, static, "gemma3")
    kinds = {type(layer).__name__ for layer in static.past_key_values.layers}
    assert "StaticRazorTokenLayer" in kinds and static.past_key_values.is_compileable, kinds
    counts = [
        layer.comp_count for layer in static.past_key_values.layers if getattr(layer, "comp_count", None) is not None
    ]
    assert counts and all(count.sum() > 0 for count in counts)  # its windows slid: a unit left into the sums
