"""Static caches: ``generate(cache_implementation="static")`` gives the latent-cache methods (lorc, zack, slim) and
fp8 storage a preallocated cache with fixed shapes and addresses, which ``torch.compile`` (fullgraph: CUDA-graph
ready) decodes from; the other methods say so and keep their growing cache. On CPU through generate's own compile
path (``CompileConfig._compile_all_devices``, what transformers provides for testing it off GPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from default_methods import COMPRESSING, LOSSLESS
from helpers import assert_same_logits, left_padded, load_converted, load_reference
from transformers import CompileConfig, StaticCache

STATIC = ("lorc", "slim", "zack")  # the methods with a static cache
SEARCHES = {
    "greedy": {"do_sample": False},
    "beams": {"num_beams": 2, "do_sample": False},
    "sampling, 2 returned": {"do_sample": True, "top_k": 20, "num_return_sequences": 2},
}


def _generate(model, **kwargs):
    ids, mask = left_padded()
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
            assert "StaticLatentLayer" in _layer_classes(static) and static.past_key_values.is_compileable
            assert "StaticLatentLayer" not in _layer_classes(dynamic)


@pytest.mark.parametrize("method", STATIC)
def test_static_cache_at_lossless_settings_equals_the_stock_static_cache(method, converted):
    """Independent reference: the stock model with transformers' own StaticCache."""
    src, out = converted(method, "lossless")
    got = _generate(load_converted(out), cache_implementation="static")
    expected = _generate(load_reference(src), cache_implementation="static")
    assert torch.equal(got.sequences, expected.sequences)


@pytest.mark.parametrize("method", STATIC)
def test_compiled_decode_from_the_static_cache(method, converted):
    """generate compiles the decode step (fullgraph: no graph break anywhere in the step) and decodes what the eager
    growing cache decodes."""
    model = load_converted(converted(method, "compressing")[1])
    eager = _generate(model)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # transformers' switch to compile on CPU (its tests use it too)
    torch._dynamo.reset()
    compiled = _generate(model, cache_implementation="static", compile_config=config)
    assert getattr(model, "_compiled_call", None) is not None  # generate really took the compiled path
    assert torch.equal(compiled.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(eager.logits, compiled.logits, strict=True)):
        assert_same_logits(a, b, f"{method} step {step}")


@pytest.mark.parametrize("method", sorted(set(COMPRESSING) - set(STATIC)))
def test_methods_without_a_static_cache_say_so_and_decode_as_before(method, converted):
    model = load_converted(converted(method, "compressing")[1])
    dynamic = _generate(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        static = _generate(model, cache_implementation="static")
    said = [str(w.message) for w in caught if "kvconvert" in str(w.message)]
    assert len(said) == 1 and "the static cache asked for is not used" in said[0], said
    assert torch.equal(static.sequences, dynamic.sequences)
    assert not static.past_key_values.is_compileable


def test_quantized_storage_keeps_the_growing_cache_and_says_why(tokenized_model_dir, tmp_path):
    from helpers import convert

    out = tmp_path / "lorc-4bit"
    convert("lorc", tokenized_model_dir("llama_gqa"), out, "--kv-budget", "0.5", "--schedule", "uniform",
            "--kv-bits", "4")  # fmt: skip
    model = load_converted(out)
    with pytest.warns(UserWarning, match="quantized storage re-packs blocks"):
        static = _generate(model, cache_implementation="static")
    assert "StaticLatentLayer" not in _layer_classes(static)


def test_a_static_cache_too_short_is_one_clear_error(converted):
    model = load_converted(converted("lorc", "compressing")[1])
    ids, mask = left_padded()
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        assert "StaticLatentLayer" in {type(layer).__name__ for layer in cache.layers}
        with pytest.raises(ValueError, match=r"holds 26 tokens and already has 24: 3 more do not fit"):
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)


def test_compiled_speed_is_measured_only_for_static_caches(converted, tokenized_model_dir):
    """``side_by_side(compiled=True)`` (``make bench-speed --compiled``) times the source and the methods with a
    static cache; a method without one gets no figure rather than a recompiling, growing one."""
    from kvconvert.eval.speed import side_by_side

    models = {"source": load_reference(tokenized_model_dir("llama_gqa")),
              "zack": load_converted(converted("zack", "compressing")[1]),
              "quant": load_converted(converted("quant", "compressing")[1])}  # fmt: skip
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = side_by_side(models, context=40, steps=2, rounds=1, compiled=True)
    assert set(measured) == {"source", "zack"}
    assert measured["zack"]["cache_bytes"] < measured["source"]["cache_bytes"]
    assert all(row["decode_tokens_per_s"] > 0 for row in measured.values())
    with pytest.raises(ValueError, match="batch 1"):
        side_by_side(models, context=40, batch=2, compiled=True)


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
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = _generate(model, cache_implementation="static", compile_config=config)
    assert getattr(model, "_compiled_call", None) is not None
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
