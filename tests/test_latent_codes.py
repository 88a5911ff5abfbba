"""ZACK with quantized latents (``--kv-bits``) decodes on a CPU from their codes: its packed columns as one KV head of
KIVI's layout (``kivi_decode``; ``static_kivi_decode`` from a static cache, compiled too) or each KV head's columns
apart (``kivi_decode_heads``, ``heads_decode``), against the same cache read back dequantized."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same_logits, compiled_generate, left_padded, run_cli

# (source, bits, heads apart): with RoPE (keys rotated after it) and without (the rotation folded into the weights);
# each KV head's columns read apart (``kivi_decode_heads``, what large caches take) or all heads against the packed row
CASES = [("llama_gqa", "4", True), ("llama_gqa", "4", False), ("llama_gqa", "2", True), ("llama_gqa", "3", True),
         ("llama_gqa", "8", False), ("gpt2", "4", True), ("gpt2", "2", False), ("gpt2", "3", True)]  # fmt: skip


@pytest.mark.parametrize(("kind", "bits", "apart"), CASES)
@torch.no_grad()
def test_zack_decodes_its_quantized_latents_from_their_codes(kind, bits, apart, tokenized_model_dir, tmp_path,
                                                             monkeypatch):  # fmt: skip
    """Greedy decoding of a left-padded batch whose latents hold quantized blocks, a sink and a float tail: every
    step of every layer whose widths KIVI's reader takes reads the codes (``kivi_decode`` or ``kivi_decode_heads`` in
    the ZACK runtime), and gives the tokens and logits of reading them back dequantized; the cache holds the same
    bytes either way."""
    import kvconvert.runtime.kvconvert_folded as kvconvert_folded
    import kvconvert.runtime.kvconvert_zack as zack
    from kvconvert.eval.memory import cache_nbytes

    monkeypatch.setattr(kvconvert_folded, "BYTE_CODES_MIN", 0)  # 8-bit codes are read from a cache size these are not
    monkeypatch.setattr(zack, "HEADS_APART_MIN", 0 if apart else 1 << 62)
    model = _converted(kind, bits, tokenized_model_dir, tmp_path, monkeypatch)
    ids, kwargs = _batch()
    calls = _counted(monkeypatch, "kivi_decode_heads" if apart else "kivi_decode")
    from_codes = model.generate(ids, **kwargs)
    layers = [layer for layer in from_codes.past_key_values.layers if type(layer).__name__ == "LatentLayer"]
    reads = sum(zack.kivi_kernel_reads(layer.key_store, layer.value_store, 0, kernel=False) for layer in layers)
    assert reads > 0 and len(calls) == 11 * reads  # the first token comes from the prefill
    monkeypatch.setattr(zack, "codes_layer", lambda *a: None)
    calls.clear()
    dequantized = model.generate(ids, **kwargs)
    assert not calls
    for step, (a, b) in enumerate(zip(dequantized.logits, from_codes.logits, strict=True)):
        assert_same_logits(a, b, f"zack {kind} {bits}-bit decode step {step}")
    assert torch.equal(dequantized.sequences, from_codes.sequences)
    assert cache_nbytes(from_codes.past_key_values) == cache_nbytes(dequantized.past_key_values)


def _batch():
    """A left-padded batch and greedy ``generate`` arguments that return every step's logits."""
    ids, mask = left_padded(length=60, pad=9, seed=3)
    return ids, dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                     return_dict_in_generate=True, output_logits=True)  # fmt: skip


def _counted(monkeypatch, name: str) -> list[int]:
    """The ZACK runtime's reader ``name`` counting its calls into the list returned."""
    import kvconvert.runtime.kvconvert_zack as zack

    calls, original = [], getattr(zack, name)

    def counted(*a, **k):
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(zack, name, counted)
    return calls


def _converted(kind, bits, tokenized_model_dir, tmp_path, monkeypatch):
    """ZACK at a small removal rate with ``bits``-bit latents in small blocks (a sink, a float tail, rotated values)."""
    import kvconvert

    if torch.cuda.is_available():
        pytest.skip("a GPU reads the latents dequantized (or through its kernel)")
    monkeypatch.delenv("KVCONVERT_KERNELS", raising=False)
    result = run_cli("zack", "--model", str(tokenized_model_dir(kind)), "--out", str(tmp_path / "m"), "--quiet",
                     "--removal-rate", "0.1", "--calib-tokens", "2048", "--kv-bits", bits, "--kv-group", "8",
                     "--kv-residual", "4", "--kv-sink", "2", "--kv-rotate")  # fmt: skip
    assert result.exit_code == 0, result.output
    return kvconvert.load(tmp_path / "m").eval()


@pytest.mark.parametrize(("kind", "bits", "apart"),
                         [("llama_gqa", "4", False), ("llama_gqa", "4", True), ("llama_gqa", "8", False),
                          ("gpt2", "2", True)])  # fmt: skip
@torch.no_grad()
def test_zack_decodes_its_quantized_latents_from_a_static_cache_s_codes(
    kind, bits, apart, tokenized_model_dir, tmp_path, monkeypatch
):
    """From a static cache (``generate(cache_implementation="static")``) every decode step of a layer whose widths
    KIVI's reader takes reads every slot's codes (as one KV head, ``static_kivi_decode``, or each KV head's columns
    apart, ``heads_decode``): the tokens and logits of the same static cache read back dequantized, and of the growing
    cache; compiled (fullgraph, traced), the same again."""
    import kvconvert.runtime.kvconvert_zack as zack

    monkeypatch.setattr(zack, "HEADS_APART_MIN", 0 if apart else 1 << 62)
    model = _converted(kind, bits, tokenized_model_dir, tmp_path, monkeypatch)
    ids, kwargs = _batch()
    calls = _counted(monkeypatch, "heads_decode" if apart else "static_kivi_decode")
    from_codes = model.generate(ids, cache_implementation="static", **kwargs)
    layers = [layer for layer in from_codes.past_key_values.layers if type(layer).__name__ == "StaticLatentLayer"]
    reads = sum(zack.static_reads_codes(layer.key_store, layer.value_store, 0) for layer in layers)
    assert reads > 0 and len(calls) == 11 * reads  # the first token comes from the prefill
    growing = model.generate(ids, **kwargs)
    monkeypatch.setattr(zack, "codes_layer", lambda *a: None)
    calls.clear()
    dequantized = model.generate(ids, cache_implementation="static", **kwargs)
    assert not calls
    for reference, name in ((dequantized, "dequantized"), (growing, "growing")):
        for step, (a, b) in enumerate(zip(reference.logits, from_codes.logits, strict=True)):
            assert_same_logits(a, b, f"zack {kind} {bits}-bit static decode step {step} against {name}")
        assert torch.equal(reference.sequences, from_codes.sequences)
    monkeypatch.undo()  # the compiled step traces the module's own functions
    monkeypatch.setattr(zack, "HEADS_APART_MIN", 0 if apart else 1 << 62)
    compiled = compiled_generate(model, lambda m, **kw: m.generate(ids, **kwargs, **kw), backend="aot_eager")
    for step, (a, b) in enumerate(zip(from_codes.logits, compiled.logits, strict=True)):
        assert_same_logits(a, b, f"zack {kind} {bits}-bit compiled step {step}")
    assert torch.equal(compiled.sequences, from_codes.sequences)
