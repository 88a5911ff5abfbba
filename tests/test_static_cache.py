"""Static caches: ``generate(cache_implementation="static")`` gives the latent-cache methods (lorc, zack, slim),
quantized storage (KIVI's layout, fp8) and razor at 16 bits a preallocated cache with fixed shapes and addresses,
which ``torch.compile`` (fullgraph: CUDA-graph ready) decodes from; the other methods say so and keep their growing
cache. On CPU through generate's own compile
path (``CompileConfig._compile_all_devices``, what transformers provides for testing it off GPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from default_methods import COMPRESSING, LOSSLESS
from helpers import (
    STORE_CHUNKS,
    assert_same_logits,
    compiled_generate,
    left_padded,
    load_converted,
    load_reference,
    razor_static_steps,
    replays_as_a_cuda_graph,
    static_store_steps,
)
from transformers import StaticCache

from kvconvert.runtime.kvconvert_common import static_refusal

STATIC = ("lorc", "slim", "zack", "quant", "razor")  # the methods with a static cache
STATIC_LAYERS = {
    "StaticLatentLayer",
    "StaticStoreLayer",
    "StaticKiviLayer",
    "StaticFp8Layer",
    "StaticRazorLayer",
    "StaticRazorKiviLayer",
    "StaticSubspaceState",
}  # kvconvert's
SEARCHES = {
    "greedy": {"do_sample": False},
    "beams": {"num_beams": 2, "do_sample": False},
    "sampling, 2 returned": {"do_sample": True, "top_k": 20, "num_return_sequences": 2},
}


def _generate(model, length: int = 24, **kwargs):
    ids, mask = left_padded(length)
    torch.manual_seed(7)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip


def _layer_classes(out) -> set[str]:
    return {type(layer).__name__ for layer in out.past_key_values.layers}


@pytest.mark.parametrize("method", STATIC)
def test_static_cache_decodes_as_the_growing_one(method, converted):
    """Every search on a left-padded batch: the same tokens (and greedy logits) from the static cache as from the
    growing one, and the static cache is what generate used."""
    model = load_converted(converted(method, "compressing")[1])
    for name, kwargs in SEARCHES.items():
        dynamic, static = _generate(model, **kwargs), _generate(model, cache_implementation="static", **kwargs)
        assert torch.equal(static.sequences, dynamic.sequences), f"{method}, {name}"
        if name == "greedy":
            for step, (a, b) in enumerate(zip(dynamic.logits, static.logits, strict=True)):
                assert_same_logits(a, b, f"{method} step {step}")  # the same sums over more (masked) slots
            assert _layer_classes(static) & STATIC_LAYERS and static.past_key_values.is_compileable
            assert not _layer_classes(dynamic) & STATIC_LAYERS


@pytest.mark.parametrize("method", STATIC)
def test_static_cache_at_lossless_settings_equals_the_stock_static_cache(method, converted):
    """Independent reference: the stock model with transformers' own StaticCache."""
    src, out = converted(method, "lossless")
    got = _generate(load_converted(out), cache_implementation="static")
    expected = _generate(load_reference(src), cache_implementation="static")
    assert torch.equal(got.sequences, expected.sequences)


# What a cache's code must get through to be compiled is Dynamo's fullgraph trace (no graph break, no device value
# read) and AOT autograd's functionalization (buffers written in place): the "aot_eager" backend runs both, then the
# traced graph eagerly. Inductor adds its own code generation, which costs 10-50 s a test on a cold kernel cache (as on
# CI's fresh machines, where these tests were a third of the suite's time): it compiles one cache of each storage kind
# (KIVI's layout and fp8 here, the token layout in test_static_token_layout.py); the others trace with aot_eager.
INDUCTOR = "inductor"
TRACED = "aot_eager"


@pytest.mark.parametrize("method", STATIC)
def test_compiled_decode_from_the_static_cache(method, converted):
    """generate compiles the decode step (fullgraph: no graph break anywhere in the step) and decodes what the eager
    growing cache decodes."""
    backend = INDUCTOR if method == "quant" else TRACED
    _compiled_decodes_as_eager(load_converted(converted(method, "compressing")[1]), method, backend=backend)


@pytest.mark.parametrize(("method", "kind"), [("slim", "olmo2"), ("zack", "qwen3"), ("zack", "olmo3")])
def test_qk_norm_models_decode_compiled_from_static_caches(method, kind, tokenized_model_dir, tmp_path):
    """Slim's and ZACK's own modules apply a QK-norm model's norms (over all heads on OLMo 2 and 3, per head on Qwen3);
    the compiled step from their static caches decodes what the eager growing cache decodes (OLMo 3's sliding-window
    layers in transformers' static windows, 10 steps past the 8-token window)."""
    from helpers import convert

    convert(method, tokenized_model_dir(kind), tmp_path / "out", *COMPRESSING[method][1])
    _compiled_decodes_as_eager(load_converted(tmp_path / "out"), f"{method} on {kind}")


@pytest.mark.parametrize(("method", "kind"), [("slim", "gpt_neox"), ("lorc", "qwen2_gqa"), ("lorc", "qwen3")])
def test_keys_turned_on_the_query_side_decode_compiled_as_eager(method, kind, tokenized_model_dir, tmp_path):
    """Compiled for a CPU, slim's and LoRC's steps score their unturned keys with RoPE moved onto the query side
    (``turned_scores``) instead of turning every key: partial rotary (GPT-NeoX), key biases and GQA (Qwen2) and
    QK-norm (Qwen3) decode what the eager growing cache decodes."""
    from helpers import convert

    options = ("--kv-budget", "0.5", "--schedule", "uniform") if method == "lorc" else ()
    convert(method, tokenized_model_dir(kind), tmp_path / "out", *options)
    _compiled_decodes_as_eager(load_converted(tmp_path / "out"), f"{method} on {kind}")


def _compiled_decodes_as_eager(model, name: str, length: int = 24, backend: str = TRACED) -> None:
    """Greedy from a static cache through generate's compiled step: the eager growing cache's tokens and logits."""
    eager = _generate(model, length)
    compiled = compiled_generate(model, lambda m, **kw: _generate(m, length, **kw), backend)
    assert torch.equal(compiled.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(eager.logits, compiled.logits, strict=True)):
        assert_same_logits(a, b, f"{name} step {step}")


@pytest.mark.parametrize("method", sorted(set(COMPRESSING) - set(STATIC)))
def test_methods_without_a_static_cache_say_so_and_decode_as_before(method, converted):
    model = load_converted(converted(method, "compressing")[1])
    dynamic = _generate(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        static = _generate(model, cache_implementation="static")
    said = [str(w.message) for w in caught if "kvconvert" in str(w.message)]
    assert len(said) == 1 and "the static cache asked for is not used" in said[0], said
    reason = static_refusal(model.config.kvconvert)  # why, quoted (MiniCache's default merge: SLERP)
    assert reason and reason in said[0], said
    assert torch.equal(static.sequences, dynamic.sequences)
    assert not static.past_key_values.is_compileable


# quantized storage: prompts of 200 tokens, so that prefill quantizes whole blocks and decode fills one more
QUANTIZED = {
    "quant 4-bit": ("quant", ("--kv-bits", "4", "--kv-residual", "16")),
    "quant 3-bit, sink + rotation, groups of 32": ("quant", ("--kv-bits", "3", "--kv-residual", "0", "--kv-sink", "4",
                                                             "--kv-rotate", "--kv-group", "32")),
    "lorc 0.5 + 4-bit": ("lorc", ("--kv-budget", "0.5", "--schedule", "uniform", "--kv-bits", "4",
                                  "--kv-residual", "8")),
    # windows of 48 tokens (at least residual + group): the window slides over quantized blocks while it decodes
    "razor + 4-bit, sink + rotation": ("razor", ("--profile-tokens", "16", "--induction-frac", "0.1", "--echo-frac",
                                                 "0", "--window", "48", "--kv-bits", "4", "--kv-residual", "8",
                                                 "--kv-group", "32", "--kv-sink", "2", "--kv-rotate")),
}  # fmt: skip


@pytest.fixture(scope="module")
def quantized(tokenized_model_dir, tmp_path_factory):
    from helpers import convert

    made = {}
    for name, (method, args) in QUANTIZED.items():
        made[name] = tmp_path_factory.mktemp("static-quantized") / "out"
        convert(method, tokenized_model_dir("llama_gqa"), made[name], *args)
    return made


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_storage_has_a_static_cache_that_holds_what_the_growing_one_holds(name, quantized):
    """Blocks quantized at prefill and during decode, sinks, rotation, residual tokens: every search gives the
    growing quantized cache's tokens, and greedy its logits (the stores hold the same values bit for bit,
    ``test_static_store_holds_what_the_growing_store_holds``). Logits of the unpadded row: a left-padded row's
    padding states are garbage (a fully masked query averages over every slot, and a static cache has more), and
    per-channel key blocks take their range over the padding too, so its real tokens' codes may differ a little."""
    model = load_converted(quantized[name])
    method = QUANTIZED[name][0]
    for search, kwargs in SEARCHES.items():
        dynamic = _generate(model, 200, **kwargs)
        static = _generate(model, 200, cache_implementation="static", **kwargs)
        assert torch.equal(static.sequences, dynamic.sequences), f"{name}, {search}"
        if search == "greedy":
            for step, (a, b) in enumerate(zip(dynamic.logits, static.logits, strict=True)):
                assert_same_logits(a[0], b[0], f"{name} step {step}")
            assert static.past_key_values.is_compileable
            assert _layer_classes(static) & STATIC_LAYERS
            if method == "razor":  # its windows slid over quantized blocks, and what left them was compensated
                layers = [layer for layer in static.past_key_values.layers if hasattr(layer, "window_keys")]
                assert any(layer.others for layer in layers)
                assert all(layer.comp_count.min() > 0 for layer in layers if layer.others)


@pytest.mark.parametrize("name", ["quant 3-bit, sink + rotation, groups of 32", "razor + 4-bit, sink + rotation"])
def test_compiled_decode_from_a_static_quantized_cache(name, quantized):
    _compiled_decodes_as_eager(load_converted(quantized[name]), name, 200)


# MiniCache's subspace pairs (the merge whose state has fixed shapes): 16-bit latents, and 4-bit ones whose blocks
# fill during prefill and decode, with exact sinks both of the pair's states (--sink) and of the latents' store
SUBSPACE = {
    "minicache subspace": ("--merge", "subspace", "--kv-budget", "0.6", "--calib-tokens", "256", "--sink", "3"),
    "minicache subspace + 4-bit": ("--merge", "subspace", "--kv-budget", "0.5", "--calib-tokens", "256", "--kv-bits",
                                   "4", "--kv-residual", "8", "--kv-group", "16", "--sink", "2", "--kv-sink", "3"),
}  # fmt: skip


@pytest.fixture(scope="module")
def subspace(tokenized_model_dir, tmp_path_factory):
    from helpers import convert

    made = {}
    for name, args in SUBSPACE.items():
        made[name] = tmp_path_factory.mktemp("static-subspace") / "out"
        convert("minicache", tokenized_model_dir("llama_gqa"), made[name], *args)
    return made


@pytest.mark.parametrize("name", SUBSPACE)
def test_minicache_subspace_pairs_have_a_static_cache_that_decodes_as_the_growing_one(name, subspace):
    """Prompts of 47 tokens (past the sink; 4-bit blocks quantized at prefill and one while decoding): every search
    gives the growing pair's tokens, greedy its logits (scores over more, masked, slots: the same sums), and the static
    layers are what generate used; the unpaired layers' static forms too."""
    model = load_converted(subspace[name])
    for search, kwargs in SEARCHES.items():
        dynamic = _generate(model, 47, **kwargs)
        static = _generate(model, 47, cache_implementation="static", **kwargs)
        assert torch.equal(static.sequences, dynamic.sequences), f"{name}, {search}"
        if search == "greedy":
            for step, (a, b) in enumerate(zip(dynamic.logits, static.logits, strict=True)):
                assert_same_logits(a, b, f"{name} step {step}")
            layers = static.past_key_values.layers
            assert static.past_key_values.is_compileable and "StaticSubspaceState" in _layer_classes(static)
            assert int(layers[1].filled) == 47 + 9 and all(t.abs().sum() > 0 for t in layers[1].exact[0])


@pytest.mark.parametrize("name", SUBSPACE)
def test_compiled_decode_from_minicache_subspace_static_cache(name, subspace):
    _compiled_decodes_as_eager(load_converted(subspace[name]), name, 47)


@pytest.mark.parametrize("name", SUBSPACE)
@torch.no_grad()
def test_minicache_subspace_static_cache_takes_chunks_of_any_length(name, subspace):
    """Chunks of 1–17 tokens, as chunked prefill and speculative steps feed them: a chunk of up to 16 queries reads
    the latents (several new tokens at once, some into the sink), a longer one restores the past for SDPA; the
    logits equal the growing cache's after every chunk."""
    model = load_converted(subspace[name])
    ids = torch.randint(3, 90, (2, 48), generator=torch.Generator().manual_seed(5))
    caches = [None, StaticCache(config=model.config, max_cache_len=56)]
    start = 0
    for size in (2, 3, 17, 1, 5, 16, 1, 3):
        outs = []
        for i, cache in enumerate(caches):
            out = model(input_ids=ids[:, start : start + size], past_key_values=cache, use_cache=True)
            caches[i], _ = out.past_key_values, outs.append(out.logits)
        assert_same_logits(outs[0], outs[1], f"{name}, chunk of {size} at {start}")
        start += size
    assert "StaticSubspaceState" in {type(layer).__name__ for layer in caches[1].layers}


def test_a_static_minicache_subspace_cache_too_short_is_one_clear_error(subspace):
    model = load_converted(subspace["minicache subspace + 4-bit"])
    ids, mask = left_padded()
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).past_key_values
        assert "StaticSubspaceState" in {type(held).__name__ for held in cache.layers}
        with pytest.raises(ValueError, match=r"holds 26 tokens and already has 24: 3 more do not fit"):
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="cannot be cropped"):
            cache.crop(-10)


def test_a_static_minicache_subspace_stepreplays_as_a_cuda_graph(subspace):
    replays_as_a_cuda_graph(load_converted(subspace["minicache subspace + 4-bit"]), "minicache subspace", 47)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("bits, group, residual, sink, rotate", [
    (4, 64, 128, 0, False), (3, 32, 0, 4, True), (2, 32, 32, 4, False), (8, 64, 16, 0, True), (16, 64, 128, 0, False),
])  # fmt: skip
@pytest.mark.parametrize("writes", ["counts read", "tensor ops"])
def test_static_store_holds_what_the_growing_store_holds(bits, group, residual, sink, rotate, per_channel, writes,
                                                         monkeypatch):  # fmt: skip
    """Independent of how tokens arrive (prefill chunks, single decode tokens), ``StaticTokenStore`` gives each step
    exactly what ``TokenStore.extend`` gives it: bit for bit, except that a rotation is a float matrix product whose
    rounding may differ with the operand's layout, which can move a value across a rounding boundary (one code).
    A decode token is written with the count read (eagerly on a CPU) or with tensor ops only (what a compiled or
    captured step runs: taken here by reporting a compile)."""
    from kvconvert.runtime.kvconvert_codec import QuantSpec
    from kvconvert.runtime.kvconvert_staticstore import StaticTokenStore
    from kvconvert.runtime.kvconvert_tokenstore import TokenStore

    if writes == "tensor ops":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    spec = QuantSpec(bits=bits, group=group, residual=residual, sink=sink, rotate=rotate)
    growing, static = TokenStore(spec, per_channel), StaticTokenStore(spec, per_channel, sum(STORE_CHUNKS) + 5)
    for filled, got, expected, _ in static_store_steps(growing, static):
        if rotate:
            assert (got != expected).float().mean() < 1e-3, f"after {filled} tokens"
        else:
            assert torch.equal(got, expected), f"after {filled} tokens"


@pytest.mark.parametrize(
    "storage",
    [
        ("--kv-bits", "4", "--kv-residual", "8"),
        ("--kv-bits", "3", "--kv-residual", "0", "--kv-sink", "2", "--kv-rotate"),
    ],
)
def test_interleaved_sliding_layers_keep_transformers_static_window(storage, tokenized_model_dir, tmp_path):
    """Gemma 3 (local layers of 8 tokens between global ones): quant's global layers are preallocated, its local
    ones get transformers' own static window, and decoding past the window gives the growing cache's tokens."""
    from helpers import convert

    out = tmp_path / "gemma3"
    convert("quant", tokenized_model_dir("gemma3"), out, *storage)
    model = load_converted(out)
    for search, kwargs in SEARCHES.items():
        dynamic = _generate(model, 100, **kwargs)
        static = _generate(model, 100, cache_implementation="static", **kwargs)
        assert torch.equal(static.sequences, dynamic.sequences), search
    assert "StaticSlidingWindowLayer" in _layer_classes(static) and _layer_classes(static) & STATIC_LAYERS
    assert static.past_key_values.is_compileable


def test_razor_on_interleaved_sliding_layers_keeps_transformers_static_window(tokenized_model_dir, tmp_path):
    """Gemma 3 with razor: its global layers get razor's static layer, its local ones transformers' static window
    (razor leaves them stock), and every search decodes past the window as the growing cache does."""
    from helpers import convert

    out = tmp_path / "gemma3-razor"
    convert("razor", tokenized_model_dir("gemma3"), out, "--profile-tokens", "16", "--induction-frac", "0.3",
            "--echo-frac", "0", "--window", "8")  # fmt: skip
    model = load_converted(out)
    for search, kwargs in SEARCHES.items():
        dynamic = _generate(model, 60, **kwargs)
        static = _generate(model, 60, cache_implementation="static", **kwargs)
        assert torch.equal(static.sequences, dynamic.sequences), search
    assert {"StaticSlidingWindowLayer", "StaticRazorLayer"} <= _layer_classes(static)
    assert static.past_key_values.is_compileable


def test_a_static_quantized_cache_refuses_to_crop_below_what_it_holds(quantized):
    model = load_converted(quantized["quant 4-bit"])
    ids, mask = left_padded(100)
    cache = StaticCache(config=model.config, max_cache_len=120)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-10)


@pytest.mark.parametrize("method, layer", [("lorc", "StaticLatentLayer"), ("razor", "StaticRazorLayer")])
def test_a_static_cache_too_short_is_one_clear_error(method, layer, converted):
    model = load_converted(converted(method, "compressing")[1])
    ids, mask = left_padded()
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        assert layer in {type(held).__name__ for held in cache.layers}
        with pytest.raises(ValueError, match=r"holds 26 tokens and already has 24: 3 more do not fit"):
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)


def test_compiled_speed_is_measured_only_for_static_caches(converted, tokenized_model_dir):
    """``side_by_side(compiled=True)`` (``make bench-speed --compiled``) times the source and the methods with a
    static cache; a method without one gets no figure rather than a recompiling, growing one (``static=True``: the
    same caches, eagerly)."""
    from kvconvert.eval.speed import side_by_side

    models = {"source": load_reference(tokenized_model_dir("llama_gqa")),
              "zack": load_converted(converted("zack", "compressing")[1]),
              "minicache": load_converted(converted("minicache", "compressing")[1])}  # fmt: skip
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = side_by_side(models, context=40, steps=2, rounds=1, compiled=True)
    assert set(measured) == {"source", "zack"}
    assert measured["zack"]["cache_bytes"] < measured["source"]["cache_bytes"]
    assert all(row["decode_tokens_per_s"] > 0 for row in measured.values())
    with pytest.raises(ValueError, match="batch 1"):
        side_by_side(models, context=40, batch=2, compiled=True)
    eager = side_by_side(models, context=40, steps=2, rounds=1, static=True)  # the same caches, not compiled
    assert set(eager) == {"source", "zack"} and eager["zack"]["cache_bytes"] == measured["zack"]["cache_bytes"]


@pytest.fixture(scope="module")
def fp8_export(tokenized_model_dir, tmp_path_factory):
    """(source, output) of the GQA tiny model exported with fp8 scales per KV head (vLLM's format)."""
    from helpers import convert

    src = tokenized_model_dir("llama_gqa")
    out = tmp_path_factory.mktemp("fp8-static") / "out"
    convert("quant", src, out, "--kv-format", "fp8", "--kv-scale-strategy", "head", "--calib-tokens", "1024")
    return src, out


@torch.no_grad()
def test_fp8_storage_has_a_static_cache_that_decodes_as_its_growing_one(fp8_export):
    """fp8 stores each token alone (static scales), so it is preallocated like transformers' StaticCache: every
    search on a left-padded batch gives the tokens (and greedy logits) of the growing fp8 cache."""
    model = load_converted(fp8_export[1])
    for name, kwargs in SEARCHES.items():
        dynamic, static = _generate(model, **kwargs), _generate(model, cache_implementation="static", **kwargs)
        assert torch.equal(static.sequences, dynamic.sequences), name
        if name == "greedy":
            for step, (a, b) in enumerate(zip(dynamic.logits, static.logits, strict=True)):
                assert_same_logits(a, b, f"fp8 step {step}")
            assert _layer_classes(static) == {"StaticFp8Layer"} and static.past_key_values.is_compileable
            assert _layer_classes(dynamic) == {"Fp8Layer"}


@torch.no_grad()
def test_fp8_static_cache_equals_stock_transformers_with_compressed_tensors(fp8_export):
    """Independent reference: stock transformers loads the export without remote code, compressed-tensors
    fake-quantizes keys and values with its scales, into transformers' own StaticCache."""
    pytest.importorskip("compressed_tensors")
    import transformers

    stock = transformers.AutoModelForCausalLM.from_pretrained(fp8_export[1]).eval()
    ours = _generate(load_converted(fp8_export[1]), cache_implementation="static")
    theirs = _generate(stock, cache_implementation="static")
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_compiled_decode_from_the_fp8_static_cache(fp8_export):
    model = load_converted(fp8_export[1])
    eager = _generate(model)
    compiled = compiled_generate(model, _generate, INDUCTOR)  # fp8 codes through Inductor's kernels
    assert torch.equal(compiled.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(eager.logits, compiled.logits, strict=True)):
        assert_same_logits(a, b, f"fp8 step {step}")


def test_a_static_fp8_cache_too_short_is_one_clear_error(fp8_export):
    model = load_converted(fp8_export[1])
    ids, mask = left_padded()
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"holds 26 tokens and already has 24: 3 more do not fit"):
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)


def test_lossless_table_covers_the_static_methods():
    assert set(STATIC) <= set(LOSSLESS)


@pytest.mark.parametrize("sink, window, frac, retrieval", [(2, 6, 0.25, [1]), (0, 4, 0.0, []), (3, 5, 0.5, [0, 2])])
def test_static_razor_layer_attends_as_the_growing_one(sink, window, frac, retrieval):
    """Independent of the model: chunks of several tokens and single decode tokens (the sink still filling, the
    window growing with ``frac`` so that some steps drop nothing, padded tokens leaving the window) give each step
    what ``RazorLayer`` gives it, and the compensation sums end equal."""
    razor_static_steps(sink, window, frac, retrieval, tolerance=1e-5)


# razor's long chunks: a prefill past the window, decode tokens filling blocks, a chunk that drops many at once
RAZOR_KIVI_CHUNKS = [1, 1, 5, *[1] * 12, 40, *[1] * 30, 23, *[1] * 20]


@pytest.mark.parametrize("sink, window, frac, retrieval, storage", [
    (2, 16, 0.25, [1], {"bits": 4, "group": 8, "residual": 8}),
    (3, 24, 0.5, [0, 2], {"bits": 3, "group": 8, "residual": 0, "sink": 2, "rotate": True}),
    (0, 20, 0.0, [], {"bits": 2, "group": 4, "residual": 16, "sink": 3}),
    (4, 16, 0.2, [0, 1, 2], {"bits": 4, "group": 8, "residual": 8, "sink": 1}),
])  # fmt: skip
@pytest.mark.parametrize("writes", ["counts read", "tensor ops"])
@pytest.mark.parametrize("windows", ["codes", "dequantized"])
def test_static_razor_layer_in_kivi_storage_attends_as_the_growing_one(sink, window, frac, retrieval, storage, writes,
                                                                       windows, monkeypatch):  # fmt: skip
    """The same with ``--kv-bits`` in KIVI's layout (``StaticRazorKiviLayer``): blocks quantized at chunks and at
    decode tokens, windows sliding over quantized blocks (a ring of them), the store's own exact sink, dropped tokens
    compensated as the growing store hands them over (dequantized). Decode tokens written with the count read
    (eagerly on a CPU) or with tensor ops only (a compiled step's writes: taken here by reporting a compile); the
    windows' ring read from its codes (the CPU's reader) or every slot dequantized (elsewhere)."""
    from kvconvert.runtime.kvconvert_codec import QuantSpec
    from kvconvert.runtime.kvconvert_razor_kivi import StaticRazorKiviLayer

    if writes == "tensor ops":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    if windows == "dequantized":
        monkeypatch.setattr(StaticRazorKiviLayer, "_window_reads_codes", lambda self, dim: False)

    razor_static_steps(sink, window, frac, retrieval, tolerance=1e-5, quant=QuantSpec(**storage),
                       chunks=RAZOR_KIVI_CHUNKS)  # fmt: skip


@pytest.mark.parametrize("storage, window, reason", [
    ({"bits": 4, "group": 32, "residual": 16}, 48, None),
    ({"bits": 4, "group": 32, "residual": 16, "layout": "token"}, 48, None),
    ({"bits": 4, "group": 32, "residual": 32}, 48, "48 tokens, shorter than residual + group (64)"),
    ({"bits": 4, "group": 32, "residual": 16, "layers": ((4, 4), (4, 16))}, 48, "some at 16 bits"),
])  # fmt: skip
def test_razor_with_quantized_storage_says_when_it_has_no_static_layer(storage, window, reason):
    """Windows at least residual + group long get a static layer (``StaticRazorKiviLayer``, in the token layout
    ``StaticRazorTokenLayer``); a shorter window (its growing store would drop tokens from the float tail, shifting its
    blocks) or a layer kept at 16 bits get the growing cache, and the reason (which generate's one-line warning
    quotes)."""
    from kvconvert.runtime.kvconvert_codec import QuantSpec
    from kvconvert.runtime.kvconvert_common import static_refusal

    spec = {"method": "razor", "kv_quant": QuantSpec(**storage).to_spec(),
            "razor": {"retrieval_kv_heads": [[0], [1]], "window": window}}  # fmt: skip
    said = static_refusal(spec, static_windows=True)
    assert said is None if reason is None else said.startswith("razor's windows: ") and reason in said, said
    # razor's quantized windows with a static layer still leave sliding-window layers to their own rule
    assert static_refusal({**spec, "local_layers": [0]}) is not None


@pytest.mark.parametrize("merge", ["slerp", "average", "subspace"])
def test_minicache_has_a_static_cache_only_for_subspace_pairs(merge):
    """SLERP and average pairs keep as many tokens exact as the data asks for: no fixed shapes, so the growing cache
    and the reason; a subspace pair has one (and sliding-window layers still their own rule)."""
    spec = {"method": "minicache", "minicache": {"merge": merge, "pairs": [[0, 1]]}}
    said = static_refusal(spec)
    assert (said is None) == (merge == "subspace"), said
    assert merge == "subspace" or "keep as many tokens exact as the data asks for" in str(said)
    assert static_refusal({**spec, "local_layers": [0]}) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", STATIC)
def test_static_cache_decodes_on_a_gpu(method, converted):
    """On a GPU, which the CPU tests cannot stand in for (tensors left on the CPU, SDPA refusing a mask of another dtype
    than its query's): in float32 the static cache decodes the left-padded batch as the growing one does; in
    bfloat16 it decodes with finite logits."""
    model = load_converted(converted(method, "compressing")[1]).to("cuda")
    ids, mask = (t.to("cuda") for t in left_padded())

    def generate(**kwargs):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                              pad_token_id=0, do_sample=False, return_dict_in_generate=True, output_logits=True,
                              **kwargs)  # fmt: skip

    dynamic, static = generate(), generate(cache_implementation="static")
    assert torch.equal(static.sequences, dynamic.sequences) and static.past_key_values.is_compileable
    model.to(torch.bfloat16)
    half = generate(cache_implementation="static")
    assert all(torch.isfinite(step).all() for step in half.logits)


@pytest.mark.parametrize("method", STATIC)
def test_a_static_decode_stepreplays_as_a_cuda_graph(method, converted):
    """One decode step captured as a CUDA graph (``bench/kernels_bench.py``'s ``captured_decode``, as serving engines
    decode: a fixed input tensor, positions from the cache's own counters) and replayed gives the logits the eager
    steps give from a twin cache; nothing in a step may copy from the host or read a device value, which a capture
    refuses. On a CPU the same loop runs uncaptured."""
    replays_as_a_cuda_graph(load_converted(converted(method, "compressing")[1]), method, 24)


def test_a_static_razor_kivi_stepreplays_as_a_cuda_graph(quantized):
    """The same for razor with 4-bit KIVI storage (``StaticRazorKiviLayer``), from a prompt long enough that its
    windows slide over quantized blocks."""
    replays_as_a_cuda_graph(load_converted(quantized["razor + 4-bit, sink + rotation"]), "razor + 4-bit", 120)
