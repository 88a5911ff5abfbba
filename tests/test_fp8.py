"""``kvconvert quant --kv-format fp8``: the serving engines' KV-cache format (compressed-tensors'
``kv_cache_scheme`` + ``self_attn.k_scale`` / ``v_scale``). The independent references: compressed-tensors'
own schema for the config, and stock transformers with compressed-tensors (its own fp8 KV-cache numerics,
no kvconvert code) for the outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import convert, generate_in_every_mode, load_converted, load_reference, run_cli
from safetensors import safe_open

import kvconvert
from kvconvert.eval.memory import kv_bytes_per_token
from kvconvert.methods.quant.fp8 import scales_from_amax
from kvconvert.runtime.kvconvert_codec import FP8_MAX, QuantSpec, fp8_read, fp8_store

FP8_ARGS = ("--kv-format", "fp8", "--calib-tokens", "1024")


@pytest.fixture(scope="module")
def exports(tokenized_model_dir, tmp_path_factory):
    """strategy -> (source, output) of the GQA tiny model exported with fp8 scales per tensor / per head."""
    src = tokenized_model_dir("llama_gqa")
    made = {}
    for strategy in ("tensor", "head"):
        out = tmp_path_factory.mktemp(f"fp8-{strategy}") / "out"
        convert("quant", src, out, *FP8_ARGS, "--kv-scale-strategy", strategy)
        made[strategy] = (src, out)
    return made


def _scales(out: Path) -> dict[str, torch.Tensor]:
    with safe_open(out / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if name.endswith(("k_scale", "v_scale"))}


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_the_export_is_compressed_tensors_kv_cache_scheme(exports, strategy):
    """The config validates against compressed-tensors' own schema; one k_scale and v_scale per attention
    block where engines look for them, in its shape for the strategy; the source architecture's
    model_type so engines build it; the runtime spec's scales are the tensors' values."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    _, out = exports[strategy]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).kv_cache_scheme
    assert scheme is not None and scheme.num_bits == 8 and scheme.type == "float"
    assert not scheme.dynamic and scheme.symmetric
    assert scheme.strategy == (QuantizationStrategy.ATTN_HEAD if strategy == "head" else QuantizationStrategy.TENSOR)
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    scales = _scales(out)
    assert sorted(scales) == sorted(f"model.layers.{i}.self_attn.{side}_scale" for i in range(layers) for side in "kv")
    spec = config["kvconvert"]["kv_quant"]["scales"]
    for i in range(layers):
        for side, tensor in enumerate(scales[f"model.layers.{i}.self_attn.{s}_scale"] for s in "kv"):
            assert tensor.shape == ((heads, 1, 1) if strategy == "head" else (1,))
            assert bool((tensor > 0).all())
            assert tensor.flatten().tolist() == spec[i][side]


@pytest.mark.parametrize("strategy", ["tensor", "head"])
@torch.no_grad()
def test_kvconvert_computes_what_stock_transformers_with_compressed_tensors_computes(exports, strategy):
    """Stock transformers loads the export without remote code and, with compressed-tensors installed,
    fake-quantizes keys and values with the checkpoint's scales: kvconvert's runtime, which stores the
    codes, gives the same greedy tokens and logits (1e-5), prefill and every decode step; and differs from
    the source, so the scales are applied."""
    pytest.importorskip("compressed_tensors")
    import transformers

    src, out = exports[strategy]
    stock = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(stock).__name__ == "LlamaForCausalLM"
    ids = torch.randint(3, 90, (2, 48), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=0)  # fmt: skip
    ours, theirs = kvconvert.load(out).eval().generate(**kwargs), stock.generate(**kwargs)
    source = load_reference(src).generate(**kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(ours.logits, source.logits, strict=True)) > 1e-4


@torch.no_grad()
def test_it_loads_both_ways_generates_in_every_mode_and_its_cache_holds_a_byte_per_value(exports):
    src, out = exports["head"]
    remote = load_converted(out)
    assert type(remote).__name__.startswith("KVConvert")  # trust_remote_code=True reaches kvconvert's runtime
    ids = torch.randint(3, 90, (1, 160), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(remote(ids).logits, kvconvert.load(out).eval()(ids).logits, rtol=0, atol=0)
    generate_in_every_mode(remote)
    cache = remote(ids[:, :8], use_cache=True).past_key_values
    assert all(layer.key_codes.dtype == torch.float8_e4m3fn for layer in cache.layers)
    measured = kv_bytes_per_token(remote, ids, 64, 160) / kv_bytes_per_token(load_reference(src), ids, 64, 160)
    report = json.loads((out / "kvconvert.json").read_text())
    assert report["kv_budget_expected_vs_16bit"] == 0.5
    assert measured == pytest.approx(0.25)  # one byte per value against the float32 source's four


def test_fp8_numerics_match_plain_torch():
    """``fp8_store`` / ``fp8_read`` against the definition: x / scale saturated at ±448, rounded to e4m3."""
    x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(0)) * 5
    x[0, 0, 0, 0] = 1e6  # past the calibrated range: saturates
    scale = torch.tensor([0.01, 0.02, 0.05])
    codes = fp8_store(x, scale)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    reference = torch.clamp(x / scale.view(1, 3, 1, 1), -448, 448).to(torch.float8_e4m3fn).float() * scale.view(
        1, 3, 1, 1
    )
    torch.testing.assert_close(fp8_read(codes, scale, torch.float32), reference, rtol=0, atol=0)
    assert fp8_read(codes, scale, torch.float32)[0, 0, 0, 0].item() == pytest.approx(448 * 0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_read_of_every_code_is_torchs_conversion(dtype):
    """All 254 finite e4m3 codes (subnormals, ±0, ±448 included), read back through the CPU's bit-moving path, equal
    torch's own float8 conversion times the per-head scale, rounded once to ``dtype``."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()].view(1, 1, -1, 1).expand(1, 3, -1, 2)
    scale = torch.tensor([0.013, 1.7, 3e-4])
    expected = (codes.float() * scale.view(1, 3, 1, 1)).to(dtype)
    assert codes.shape[2] == 254
    torch.testing.assert_close(fp8_read(codes, scale, dtype), expected, rtol=0, atol=0)


def test_scales_map_the_calibrated_maximum_onto_fp8s_largest_value_without_clipping_it():
    amax = torch.tensor([3.0, 0.0, 1000.0], dtype=torch.float64)
    per_head = scales_from_amax(amax, "head", torch.bfloat16)
    assert per_head.dtype == torch.bfloat16 and per_head[1].item() == 1.0  # an all-zero head
    assert bool((amax / per_head.double() <= FP8_MAX).all())  # rounded up in bfloat16, never down
    assert per_head[0].item() == pytest.approx(3.0 / FP8_MAX, rel=1e-2)
    assert scales_from_amax(amax, "tensor", torch.float32).tolist() == pytest.approx([1000.0 / FP8_MAX])


@pytest.mark.parametrize(
    ("command", "kind", "extra", "says"),
    [
        ("razor", "llama_gqa", ("--kv-format", "fp8"), "quant's"),
        ("quant", "gpt2", ("--kv-format", "fp8"), "no place"),
        ("quant", "llama_gqa", ("--kv-format", "fp8", "--kv-budget", "0.3"), "no --kv-budget"),
        ("quant", "llama_gqa", ("--kv-format", "fp8", "--kv-sink", "4"), "--kv-sink"),
        ("quant", "llama_gqa", ("--kv-format", "fp8", "--kv-bits", "4"), "no --kv-bits but 8"),
    ],
)
def test_fp8_where_it_cannot_be_served_is_one_line_and_writes_nothing(
    tokenized_model_dir, tmp_path, command, kind, extra, says
):
    out = tmp_path / "out"
    result = run_cli(command, "--model", str(tokenized_model_dir(kind)), "--out", str(out), "--quiet", *extra)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("kvconvert: error:") and says in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_an_fp8_export_is_not_taken_as_a_source(exports, tmp_path):
    """Its weights are the source's, but its quantization_config says quantized: converting it again would
    carry scales calibrated for another cache."""
    result = run_cli("quant", "--model", str(exports["tensor"][1]), "--out", str(tmp_path / "x"), "--kv-bits", "4")
    assert result.exit_code == 2 and "quantized checkpoint" in result.output


def test_the_recipe_says_fp8_and_reads_back():
    from kvconvert.recipe import storage_spec

    spec = storage_spec({"kv_format": "fp8", "kv_scale_strategy": "head"}, "test")
    assert spec == QuantSpec(bits=8, residual=0, format="fp8", scale_strategy="head")
    assert QuantSpec.from_spec({"kv_quant": spec.to_spec()}) == spec  # the runtime spec, read back


@torch.no_grad()
def test_its_16bit_bytes_counted_on_a_float32_run_keep_the_float32_scales(exports):
    """The scales are float32 in any model dtype (``Fp8Reads._keep_in_fp32``): counted as they are when a float32
    run's cache is quoted as deployed in 16 bits, as the model loaded in bfloat16 holds them."""
    from kvconvert.eval.memory import deployed_nbytes
    from kvconvert.eval.runner import bytes_after_context, cache_after_context

    out = exports["tensor"][1]
    ids = torch.randint(3, 90, (1, 96), generator=torch.Generator().manual_seed(3))
    wide, half = kvconvert.load(out).eval(), kvconvert.load(out, dtype=torch.bfloat16).eval()
    counted = deployed_nbytes(cache_after_context(wide, ids, 32), wide)
    assert counted == bytes_after_context(half, ids, 32) == bytes_after_context(wide, ids, 32)
