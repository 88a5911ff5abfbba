"""The families people run today (issue 19): every method at its lossless settings reproduces
transformers' own model — prefill, greedy and sampled decoding of a left-padded batch — or refuses
with the exact reason its capability matrix gives, writing nothing."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers
from helpers import assert_equivalent, left_padded, load_converted, load_reference, run_cli
from test_cache_protocol import LOSSLESS

from kvconvert.arch import FEATURES, adapter_for
from kvconvert.methods import METHODS

FAMILIES = ("qwen3", "qwen3_sliding", "olmo2", "gemma3", "gemma2", "phi3", "gemma", "granite", "starcoder2",
            "seed_oss", "olmo3", "arcee", "apertus", "smollm3", "helium", "cohere", "glm", "glm4",
            "ernie4_5", "cohere2")  # fmt: skip
EXPECTED_FEATURES = {
    "qwen3": ("qk_norm",),
    "qwen3_sliding": ("qk_norm", "local_layers"),
    "olmo2": ("qk_norm",),
    "gemma3": ("qk_norm", "local_layers", "layer_rope"),
    "gemma2": ("local_layers", "softcap"),
    "phi3": (),
    "olmo3": ("qk_norm", "local_layers"),
    "apertus": ("qk_norm",),
    "smollm3": ("nope_layers",),
    "cohere2": ("local_layers", "nope_layers", "interleaved_rope"),
    **{kind: ("interleaved_rope",) for kind in ("helium", "cohere", "glm", "glm4", "ernie4_5")},
    **{kind: () for kind in ("gemma", "granite", "starcoder2", "seed_oss", "arcee")},
}


# families that bring no new attention feature (or Qwen3's, tested above): the methods that depend on
# what they change (RoPE scaling: the methods that re-rotate keys; MoE: conversions next to expert MLPs)
PLAIN = [("llama3_rope", "slim"), ("llama3_rope", "lorc"), ("mixtral", "lorc"),
         ("mixtral", "razor"), ("qwen2_moe", "lorc"), ("qwen2_moe", "quant"), ("qwen3_moe", "quant"),
         ("granitemoe", "lorc"), ("granitemoe", "razor")]  # fmt: skip


@pytest.mark.parametrize(("kind", "method"), PLAIN)
@torch.no_grad()
def test_rope_scaling_and_moe_models_convert_through_the_llama_adapter(kind, method, tokenized_model_dir, tmp_path):
    src = tokenized_model_dir(kind)
    calibrates = method == "razor"  # its head profile runs the model: Mixtral's experts are stored renamed
    with pytest.warns(UserWarning, match="converts while loading") if calibrates else contextlib.nullcontext():
        result = run_cli(method, "--model", str(src), "--out", str(tmp_path / "out"), "--quiet",
                         *LOSSLESS[method][1])  # fmt: skip
    assert result.exit_code == 0, result.output
    ids, mask = left_padded()
    assert_equivalent(load_reference(src), load_converted(tmp_path / "out"), ids, mask)


@pytest.mark.parametrize("kind", FAMILIES)
def test_adapters_see_each_family_s_attention_features(kind, tiny_model_dir):
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir(kind))
    layout = adapter_for(config).layout()
    assert layout.features == EXPECTED_FEATURES[kind]
    assert set(layout.features) <= set(FEATURES)
    if "local_layers" in layout.features:
        kinds = config.layer_types
        assert layout.local_layers == tuple(i for i, t in enumerate(kinds) if t == "sliding_attention")
        assert layout.global_layers and layout.sliding_window == 8


@pytest.mark.parametrize("method", sorted(LOSSLESS))
@pytest.mark.parametrize("kind", FAMILIES)
@torch.no_grad()
def test_every_method_reproduces_the_family_or_refuses_with_its_reason(kind, method, tokenized_model_dir, tmp_path):
    src = tokenized_model_dir(kind)
    layout = adapter_for(transformers.AutoConfig.from_pretrained(src)).layout()
    blocked = [f for f in layout.features if f in METHODS[method].method.unsupported]
    dst = tmp_path / "out"
    result = run_cli(method, "--model", str(src), "--out", str(dst), "--quiet", *LOSSLESS[method][1])
    if blocked:
        reason = METHODS[method].method.unsupported[blocked[0]]
        assert result.exit_code == 2 and reason in result.output.replace("\n", " "), result.output
        assert not dst.exists()
        return
    if method == "slim" and layout.num_kv_heads != layout.num_heads:
        assert result.exit_code == 2 and "multi-head attention" in result.output
        return
    assert result.exit_code == 0, result.output
    ids, mask = left_padded()
    assert_equivalent(load_reference(src), load_converted(dst), ids, mask)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_sliding"])
@torch.no_grad()
def test_quantized_sliding_layers_keep_the_window_exactly(kind, tokenized_model_dir, tmp_path):
    """--kv-include-local: sliding-window layers get a quantized cache that forgets like transformers'
    own; with nothing old enough to quantize (residual 256) the model is transformers' exactly, while
    32 decode steps slide far past the 8-token window."""
    src = tokenized_model_dir(kind)
    dst = tmp_path / "out"
    result = run_cli("quant", "--model", str(src), "--out", str(dst), "--quiet", "--kv-bits", "8", "--kv-residual",
                     "256", "--kv-include-local")  # fmt: skip
    assert result.exit_code == 0, result.output
    converted = load_converted(dst)
    ids, mask = left_padded()
    assert_equivalent(load_reference(src), converted, ids, mask)
    cache = converted(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
    local = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
    assert local and all(type(layer).__name__ == "QuantizedSlidingLayer" for layer in local)
    assert all(len(layer.key_store) == 7 for layer in local)  # window − 1 tokens held after the prompt


def test_quantized_local_layers_hold_a_bounded_cache(tokenized_model_dir, tmp_path):
    """With --kv-include-local the cache grows per token by the quantized global layer only: the local
    layers' quantized stores stay bounded by the window."""
    from kvconvert.eval.memory import kv_bytes_per_token

    src = tokenized_model_dir("gemma3")
    storage = ("--kv-bits", "4", "--kv-group", "4", "--kv-residual", "4")
    run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), "--quiet", *storage, "--kv-include-local")
    converted = load_converted(tmp_path / "q")
    ids = torch.randint(3, 90, (1, 96), generator=torch.Generator().manual_seed(0))
    # one global layer of 16 K and 16 V values per token: 4-bit codes + fp16 scale and zero per group of 4
    assert kv_bytes_per_token(converted, ids, 32, 96) == pytest.approx(16 * (0.5 + 4 / 4) * 2)


@torch.no_grad()
def test_sliding_window_layers_take_their_own_width(tokenized_model_dir, tmp_path):
    """--kv-local-bits quantizes the sliding-window layers (it implies --kv-include-local) at their own width while
    the global layer keeps --kv-bits: the stores say so, the report records it, the cache still grows by the global
    layer's 4-bit bytes only, and the model generates. Asked where it cannot apply: one line, nothing written."""
    import json

    from kvconvert.eval.memory import kv_bytes_per_token

    src = tokenized_model_dir("gemma3")  # layers: sliding, global, sliding
    storage = ("--kv-bits", "4", "--kv-local-bits", "8", "--kv-group", "4", "--kv-residual", "4")
    result = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), "--quiet", *storage)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q" / "kvconvert.json").read_text())
    assert report["kv_storage"]["local_bits"] == 8 and report["kv_storage"]["include_local"] is True
    converted = load_converted(tmp_path / "q")
    ids = torch.randint(3, 90, (1, 96), generator=torch.Generator().manual_seed(0))
    cache = converted(input_ids=ids, use_cache=True).past_key_values
    widths = {getattr(layer, "is_sliding", False): layer.key_store.quant.bits for layer in cache.layers}
    assert widths == {True: 8, False: 4}
    assert kv_bytes_per_token(converted, ids, 32, 96) == pytest.approx(16 * (0.5 + 4 / 4) * 2)
    ids, mask = left_padded()
    out = converted.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 28
    llama = tokenized_model_dir("llama")
    for model, extra in ((src, ("--kv-format", "fp8")), (src, ("--kv-layout", "token")), (src, ("--kv-budget", "0.3")),
                         (llama, ("--kv-bits", "4"))):  # fmt: skip
        bad = run_cli("quant", "--model", str(model), "--out", str(tmp_path / "bad"), "--quiet", "--kv-local-bits",
                      "8", *extra)  # fmt: skip
        assert bad.exit_code == 2 and "error:" in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output
        assert not (tmp_path / "bad").exists()


@torch.no_grad()
def test_token_layout_keys_beside_windows_in_kivis_layout(tokenized_model_dir, tmp_path):
    """``--kv-layout token --kv-value-bits 2 --kv-local-bits 8`` (Gemma 3 at long contexts: the global layers' keys in
    the token layout, the sliding windows at their own width): the windows go to KIVI's layout at 8 bits (a window is
    read whole by stock attention), the global layer keeps token-layout keys and 2-bit values, the cache grows by the
    global layer's bytes only, and the model generates."""
    from kvconvert.eval.memory import kv_bytes_per_token

    src = tokenized_model_dir("gemma3_64")  # layers: sliding, global, sliding
    storage = ("--kv-bits", "4", "--kv-value-bits", "2", "--kv-local-bits", "8", "--kv-layout", "token",
               "--kv-group", "32", "--kv-residual", "0", "--kv-sink", "4")  # fmt: skip
    result = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), "--quiet", *storage)
    assert result.exit_code == 0, result.output
    converted = load_converted(tmp_path / "q")
    ids = torch.randint(3, 90, (1, 96), generator=torch.Generator().manual_seed(0))
    cache = converted(input_ids=ids, use_cache=True).past_key_values
    sides = {getattr(layer, "is_sliding", False): (layer.key_store.quant, layer.value_store.quant)
             for layer in cache.layers}  # fmt: skip
    assert [(s.layout, s.bits) for s in sides[True]] == [("kivi", 8), ("kivi", 8)]
    assert [(s.layout, s.bits) for s in sides[False]] == [("token", 4), ("kivi", 2)]
    stores = [type(layer.key_store).__name__ for layer in cache.layers]  # the runtime's own classes, not kvconvert's
    assert stores == ["TokenStore", "TokenLayoutStore", "TokenStore"]
    # the global layer's 64 keys in 4-bit codes with a scale, zero per 32 and their block's center, 64 values in 2-bit
    # codes with a scale and zero per group of 32 channels (float16 each)
    per_token = 64 * 0.5 + 2 * 2 * 2 + 64 * 2 / 32 + 64 * 0.25 + 2 * 2 * 2
    assert kv_bytes_per_token(converted, ids, 32, 96) == pytest.approx(per_token)
    ids, mask = left_padded()
    out = converted.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 28


@torch.no_grad()
def test_the_budget_of_a_model_with_windows_counts_them_as_held(tokenized_model_dir, tmp_path):
    """On a model that interleaves sliding-window and global layers the report's long-context budget is the
    global layers' (the windows stay bounded while the context grows), and at a given length each window counts
    the tokens it holds: the cache measured after 200 tokens agrees with the report's figure there, and not with
    counting every layer alike (what the report said before: 0.917 here, for a cache of 0.773 at 200 tokens)."""
    import json

    from kvconvert.eval.runner import bytes_after_context, load_model
    from kvconvert.pipeline import storage_factor
    from kvconvert.runtime.kvconvert_codec import QuantSpec

    src = tokenized_model_dir("gemma3")  # layers: sliding, global, sliding (window 8); 1 KV head of 16; context 256
    storage = ("--kv-bits", "4", "--kv-group", "4", "--kv-residual", "4")
    result = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), "--quiet", *storage)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q" / "kvconvert.json").read_text())
    per_value = (0.5 + 4 / 4) / 2  # 4-bit codes + fp16 scale and zero per group of 4, ÷ 16 bits
    assert report["kv_budget_expected_vs_16bit"] == pytest.approx(per_value)  # the global layer's, at the limit
    at = report["kv_budget_at_tokens"]
    assert list(at) == ["256"] and at["256"] == pytest.approx((per_value * 256 + 2 * 8) / (256 + 2 * 8))
    assert "0.765 at 256 tokens" in result.output
    layout = adapter_for(transformers.AutoConfig.from_pretrained(src)).layout()
    assert storage_factor(QuantSpec(16), layout, 4096, compressed=0.5) == pytest.approx((0.5 * 4096 + 16) / 4112)
    ids = torch.randint(3, 90, (1, 200), generator=torch.Generator().manual_seed(0))
    half = {"dtype": torch.bfloat16}  # the report counts against a 16-bit cache
    measured = bytes_after_context(load_model(str(tmp_path / "q"), **half), ids) / bytes_after_context(
        load_model(str(src), **half), ids
    )
    spec = QuantSpec.from_spec({"kv_quant": report["kv_storage"]})
    expected = storage_factor(spec, layout, 200)
    # the newest 4-7 tokens of the global layer stay 16-bit (the residual and the partial block)
    assert expected <= measured <= expected + 8 / (200 + 16), (measured, expected)
    assert abs(measured - (2 + per_value) / 3) > 0.1  # every layer alike would have been far off


@torch.no_grad()
def test_widths_allocated_for_a_budget_go_to_the_global_layers(tokenized_model_dir, tmp_path):
    """quant --kv-budget on a model with sliding-window layers spends the (long-context) budget on the global
    layers: the windows, which stay bounded and stock in the runtime, are neither probed nor narrowed (before,
    the allocator counted them as growing with the context and simulated them quantized)."""
    import json

    src = tokenized_model_dir("gemma3")  # layers: sliding, global, sliding
    options = ("--quiet", "--kv-budget", "0.45", "--kv-residual", "4", "--calib-tokens", "512", "--kv-group")
    bad = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), *options, "4")
    assert bad.exit_code == 2 and "multiple of 8" in bad.output and len(bad.output.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()  # 3-bit widths need groups of 8 tokens: one line, nothing written
    result = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), *options, "8")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "q" / "kvconvert.json").read_text())
    layers = report["plan"]["layers"]
    assert layers[0] == layers[2] == [4, 4] and max(layers[1]) < 4  # --max-bits 4 by default
    assert report["plan"]["sensitivity"][0] == [{"4": 0.0}, {"4": 0.0}]  # not probed
    assert report["plan"]["window_layers"] == [0, 2]
    assert report["kv_budget_expected_vs_16bit"] <= 0.45
    converted = load_converted(tmp_path / "q")
    cache = converted(input_ids=torch.randint(3, 90, (1, 40)), use_cache=True).past_key_values
    assert [type(layer).__name__ == "QuantizedSlidingLayer" for layer in cache.layers] == [False, False, False]


def test_documented_capability_matrix_is_the_code_s():
    from pathlib import Path

    from kvconvert.methods import capability_matrix

    readme = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text()
    start, end = "<!-- capability-matrix:start -->\n", "<!-- capability-matrix:end -->"
    assert readme[readme.index(start) + len(start) : readme.index(end)] == capability_matrix()


def test_bytes_after_a_context_count_the_window_of_sliding_layers(tiny_model_dir):
    """The context protocol's memory figure is the steady state: a sliding-window layer holds its
    window, not the view of the whole prefill that transformers keeps until the next update."""
    from kvconvert.eval.runner import bytes_after_context

    model = load_reference(tiny_model_dir("gemma3"))  # layers: sliding (window 8), global, sliding
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    per_token = 2 * 1 * 16 * 4  # K and V, 1 KV head of 16 dims, fp32
    # the global layer holds all 40 tokens; each local one its window (transformers keeps the 7 it needs
    # as a view of the step's 8), plus a few scalars — not the 39-token prefill
    assert (40 + 2 * 7) * per_token <= bytes_after_context(model, ids) <= (40 + 2 * 8) * per_token + 64
