"""ZACK with quantized latents (``--kv-bits``) decodes on a CPU from their codes: its packed columns as one KV head of
KIVI's layout (``kivi_decode``), against the same cache read back dequantized."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_same_logits, left_padded, run_cli

# (source, bits): with RoPE (keys rotated after it) and without (the rotation folded into the weights)
CASES = [("llama_gqa", "4"), ("llama_gqa", "2"), ("llama_gqa", "8"), ("gpt2", "4"), ("gpt2", "2")]


@pytest.mark.parametrize(("kind", "bits"), CASES)
@torch.no_grad()
def test_zack_decodes_its_quantized_latents_from_their_codes(kind, bits, tokenized_model_dir, tmp_path, monkeypatch):
    """Greedy decoding of a left-padded batch whose latents hold quantized blocks, a sink and a float tail: every
    step of every layer whose widths KIVI's reader takes reads the codes (``kivi_decode`` in the ZACK runtime), and
    gives the tokens and logits of reading them back dequantized; the cache holds the same bytes either way."""
    import kvconvert
    import kvconvert.runtime.kvconvert_folded as kvconvert_folded
    import kvconvert.runtime.kvconvert_quant as quant
    import kvconvert.runtime.kvconvert_zack as zack
    from kvconvert.eval.memory import cache_nbytes

    if torch.cuda.is_available():
        pytest.skip("a GPU reads the latents dequantized (or through its kernel)")
    monkeypatch.delenv("KVCONVERT_KERNELS", raising=False)
    monkeypatch.setattr(kvconvert_folded, "BYTE_CODES_MIN", 0)  # 8-bit codes are read from a cache size these are not
    result = run_cli("zack", "--model", str(tokenized_model_dir(kind)), "--out", str(tmp_path / "m"), "--quiet",
                     "--removal-rate", "0.1", "--calib-tokens", "2048", "--kv-bits", bits, "--kv-group", "8",
                     "--kv-residual", "4", "--kv-sink", "2", "--kv-rotate")  # fmt: skip
    assert result.exit_code == 0, result.output
    model = kvconvert.load(tmp_path / "m").eval()
    ids, mask = left_padded(length=60, pad=9, seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)  # fmt: skip
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return quant.kivi_decode(*a, **k)

    monkeypatch.setattr(zack, "kivi_decode", counted)
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
