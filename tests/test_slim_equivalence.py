"""Slim conversion through the CLI, reload through trust_remote_code, compare with transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch

import kvconvert
from tests.helpers import assert_equivalent, convert_slim, kv_budget, load_converted, load_reference

# QK-norm: per head (a Qwen3 with as many KV heads as query heads) and over all heads (OLMo 2); a layer without RoPE
# between rotary ones (SmolLM3)
MHA_KINDS = ["llama", "llama_bias", "llama_wide", "mistral", "qwen2", "gpt_neox", "gpt2", "qwen3_mha", "olmo2",
             "smollm3_mha"]  # fmt: skip


def left_padded_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding of different lengths
    mask[2, :2] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("kind", MHA_KINDS)
def test_slim_matches_transformers(kind, tiny_model_dir, tmp_path):
    src = tiny_model_dir(kind)
    dst = tmp_path / "slim"
    convert_slim(src, dst)
    reference, converted = load_reference(src), load_converted(dst)
    assert type(converted).__name__.startswith("KVConvert")

    ids, mask = left_padded_batch(reference.config.vocab_size)
    out = assert_equivalent(reference, converted, ids, mask)

    cache = out.past_key_values
    assert all(layer.values is None for layer in cache.layers), "a V tensor survived in the cache"
    budget = kv_budget(reference, converted, torch.randint(3, 90, (2, 64)))
    assert budget == pytest.approx(0.5, abs=0.01)


def test_unbatched_prefill_and_decode(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_bias")
    convert_slim(src, tmp_path / "slim")
    reference, converted = load_reference(src), load_converted(tmp_path / "slim")
    assert_equivalent(reference, converted, torch.randint(3, 90, (1, 40)))


def test_kvconvert_load_uses_installed_runtime(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    convert_slim(src, tmp_path / "slim")
    model = kvconvert.load(tmp_path / "slim").eval()
    assert type(model).__module__ == "kvconvert.runtime.modeling_kvconvert"
    assert_equivalent(load_reference(src), model, torch.randint(3, 90, (2, 16)))


def test_loading_without_trust_remote_code_fails_loudly(tiny_model_dir, tmp_path):
    """Stock Llama would load with v_proj missing (random); config.json must prevent that."""
    from transformers import AutoModelForCausalLM

    convert_slim(tiny_model_dir("llama"), tmp_path / "slim")
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "slim", trust_remote_code=False)


def test_output_directory_contract(tiny_model_dir, tmp_path):
    src = tiny_model_dir("gpt_neox")
    dst = tmp_path / "slim"
    convert_slim(src, dst)
    names = {p.name for p in dst.iterdir()}
    assert {"config.json", "model.safetensors", "kvconvert.json", "README.md", "modeling_kvconvert.py"} <= names
    config = json.loads((dst / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kvconvert.KVConvertForCausalLM"
    assert config["kvconvert"]["method"] == "slim"
    report = json.loads((dst / "kvconvert.json").read_text())
    assert len(report["layers"]) == 3 and all(r["kappa_k"] >= 1 for r in report["layers"])
    assert set(report["source"]["sha256"]) == {"model.safetensors"}
    card = (dst / "README.md").read_text()
    assert "library_name: transformers" in card and "trust_remote_code=True" in card
    assert "base_model:" not in card  # a local path is not a Hub model id
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.split(".")[-2] in ("query_key_value", "v_proj") for k in keys), "W_V must be replaced by W_KV"
    assert any(k.endswith("attention.kv_proj.weight") for k in keys)


def test_dtype_option_casts_output(tiny_model_dir, tmp_path):
    convert_slim(tiny_model_dir("llama"), tmp_path / "bf16", "--dtype", "bfloat16", "--max-v-error", "1")
    model = load_converted(tmp_path / "bf16")
    assert model.model.layers[0].self_attn.kv_proj.weight.dtype == torch.bfloat16
    out = model.generate(torch.randint(3, 90, (1, 8)), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 12)


def test_value_error_check_measures_the_cached_dtype_and_conditioning():
    """slim's V-error check: exact (≈ 1e-15) with float64 keys whatever the biases, the checkpoint dtype's
    rounding with a well-conditioned W_K, and growing with κ(W_K) (what it exists to catch)."""
    from kvconvert import linalg
    from kvconvert.methods.slim.method import SlimMethod

    gen = torch.Generator().manual_seed(0)
    d = 64
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    v_weight = torch.randn(d, d, generator=gen, dtype=torch.float64) / 8
    k_bias, v_bias = torch.randn(2, d, generator=gen, dtype=torch.float64)
    method = SlimMethod()

    def errors(kappa: float, dtype: torch.dtype) -> tuple[float, float]:
        k_weight = basis * torch.logspace(0, -math.log10(kappa), d, dtype=torch.float64)  # σ from 1 to 1/κ
        kv_weight = linalg.key_to_value_map(k_weight, v_weight)
        return method._value_error(0, k_weight, v_weight, k_bias, v_bias, kv_weight, dtype)

    assert errors(1e3, torch.float64)[0] < 1e-12  # biases taken off and put back exactly
    well, stored = errors(1.0, torch.bfloat16)
    assert 0.1 * stored < well < 10 * stored  # bf16 keys: bf16-sized error, no more
    assert errors(1e4, torch.bfloat16)[0] > 30 * well
