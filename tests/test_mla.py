"""``lorc --latent mla``: a standard DeepSeek-V3 (MLA) checkpoint. The independent references: stock
transformers' own ``DeepseekV3ForCausalLM`` (no remote code) for the export, the source model where the
layout is exact (one KV head at full budget), plain torch for the per-frequency algebra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import convert, generate_in_every_mode, kv_budget, left_padded, load_converted, load_reference, run_cli

import kvconvert
from kvconvert.methods.lorc.mla import complex_pairs, half_rows, interleaved_rows, mean_rotation, shared_rotary_key

MLA = ("--latent", "mla", "--calib-tokens", "2048")


@pytest.fixture(scope="module")
def exports(tokenized_model_dir, tmp_path_factory):
    """(kind, budget) -> (source, output)."""
    made = {}
    for kind, budget in (("llama_mqa", "1.0"), ("llama_gqa", "0.5"), ("llama_gqa", "1.0")):
        src = tokenized_model_dir(kind)
        out = tmp_path_factory.mktemp(f"mla-{kind}-{budget}") / "out"
        convert("lorc", src, out, *MLA, "--kv-budget", budget)
        made[kind, budget] = (src, out)
    return made


def _stock(out: Path):
    """The export as stock transformers builds it, by its own class name (no kvconvert code, no remote code)."""
    config = transformers.AutoConfig.from_pretrained(out)
    assert type(config).__name__ == "DeepseekV3Config"
    return transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@torch.no_grad()
def test_one_kv_head_at_full_budget_is_the_source(exports):
    """With one KV head the shared RoPE key is the key itself and a latent of the head width holds the value:
    stock transformers' DeepSeek-V3 computes the source's logits (the latent norm is linear to ~5e-6 relative,
    float32 sums: 1e-4 of the largest logit)."""
    src, out = exports["llama_mqa", "1.0"]
    ids, mask = left_padded()
    reference = load_reference(src)(input_ids=ids, attention_mask=mask).logits
    exported = _stock(out)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (exported - reference)[valid].abs().max() <= 1e-4 * reference.abs().max()


def test_rope_is_written_as_the_identity_yarn_with_the_sources_frequencies(exports, tokenized_model_dir, tmp_path):
    """Plain RoPE goes out as YaRN with factor 1 (vLLM's CPU build turns MLA's strided q/k wrongly with its plain
    rotary): transformers computes the source's frequencies from it, unscaled. A narrower RoPE key keeps the
    fastest ones (base θ^(ρ/d))."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    src, out = exports["llama_gqa", "0.5"]
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 1.0
    exported, source = (
        DeepseekV3RotaryEmbedding(config),
        LlamaRotaryEmbedding(transformers.AutoConfig.from_pretrained(src)),
    )
    assert exported.attention_scaling == 1.0
    assert torch.allclose(exported.inv_freq.double(), source.inv_freq.double(), rtol=1e-6)
    narrow = tmp_path / "narrow"
    convert("lorc", tokenized_model_dir("llama_gqa"), narrow, *MLA, "--kv-budget", "0.5", "--mla-rope-dim", "8")
    config = transformers.AutoConfig.from_pretrained(narrow)
    assert config.qk_rope_head_dim == 8 and config.kv_lora_rank == 32 - 8
    assert torch.allclose(DeepseekV3RotaryEmbedding(config).inv_freq.double(), source.inv_freq.double()[:4], rtol=1e-6)


def test_a_tied_output_head_is_stored_untied(exports):
    """vLLM's and SGLang's DeepSeek-V3 never tie lm_head to the embedding: the export stores it, equal to the
    source's embedding, and says it is not tied."""
    from safetensors import safe_open

    src, out = exports["llama_mqa", "1.0"]
    assert json.loads((src / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(src / "model.safetensors", "pt") as g:
        assert "lm_head.weight" not in g.keys()
        assert torch.equal(f.get_tensor("lm_head.weight"), g.get_tensor("model.embed_tokens.weight"))


@pytest.mark.parametrize("budget", ["0.5", "1.0"])
def test_the_export_is_a_standard_deepseek_v3_checkpoint(exports, budget):
    """config.json builds DeepSeek-V3 with every layer dense; the checkpoint holds exactly the tensors that
    class expects (nothing missing or left over), in its shapes; the latent width is the budget's."""
    _, out = exports["llama_gqa", budget]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "quantization_config" not in config
    heads, d, layers = config["num_attention_heads"], 16, config["num_hidden_layers"]
    assert config["kv_lora_rank"] == round(float(budget) * 2 * 2 * d) - d  # 2 KV heads of 16
    assert config["qk_rope_head_dim"] == config["qk_nope_head_dim"] == config["v_head_dim"] == d
    assert config["first_k_dense_replace"] == layers and config["q_lora_rank"] is None
    model = transformers.DeepseekV3ForCausalLM(transformers.AutoConfig.from_pretrained(out))
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    assert stored == expected
    assert stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (config["kv_lora_rank"] + d, 64)
    assert stored["model.layers.0.self_attn.q_proj.weight"] == (heads * 2 * d, 64)


@torch.no_grad()
def test_stock_transformers_and_both_kvconvert_loaders_agree(exports):
    """No remote code, trust_remote_code=True and kvconvert.load run the same model: equal logits (1e-5)."""
    _, out = exports["llama_gqa", "0.5"]
    ids, mask = left_padded()
    stock = _stock(out)(input_ids=ids, attention_mask=mask).logits
    for model in (load_converted(out), kvconvert.load(out).eval()):
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits, stock, atol=1e-5, rtol=0)


def test_generates_in_every_mode_and_caches_the_latent(exports):
    """Greedy, sampling, beams, left padding, batches, with both loaders; the cache holds per token and layer
    the latent and the shared RoPE key: (kv_lora_rank + d) / (2·Hkv·d) of the source's bytes, measured."""
    src, out = exports["llama_gqa", "0.5"]
    config = json.loads((out / "config.json").read_text())
    for model in (load_converted(out), _stock(out)):
        generate_in_every_mode(model)
    ids = torch.randint(3, 90, (2, 96), generator=torch.Generator().manual_seed(3))
    expected = (config["kv_lora_rank"] + 16) / (2 * 2 * 16)
    report = json.loads((out / "kvconvert.json").read_text())
    assert report["kv_budget_expected"] == pytest.approx(expected)
    for model in (_stock(out), kvconvert.load(out).eval()):
        with torch.no_grad():
            assert kv_budget(load_reference(src), model, ids) == pytest.approx(expected)


@torch.no_grad()
def test_greedy_decode_through_the_cache_equals_one_forward(exports):
    """The cached latent and RoPE key give the logits of a forward over the whole sequence."""
    _, out = exports["llama_gqa", "0.5"]
    model = _stock(out)
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(4))
    whole = model(ids).logits
    first = model(ids[:, :25], use_cache=True)
    rest = model(ids[:, 25:], past_key_values=first.past_key_values).logits
    assert torch.allclose(rest, whole[:, 25:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_decode_steps_in_the_latent_space_equal_the_expanded_attention(exports):
    """kvconvert's runtime decodes a DeepSeek-V3 export without expanding the cache (scores against the latent
    through W_UK, outputs through W_UV): on a left-padded batch every step's logits equal stock transformers',
    which rebuilds every head's keys and values, to 1e-5, and so do the greedy tokens."""
    from kvconvert.runtime.kvconvert_lorc import absorbed_mla_forward

    _, out = exports["llama_gqa", "0.5"]
    ours, stock = kvconvert.load(out).eval(), _stock(out)
    assert all(m.self_attn.forward.__func__ is absorbed_mla_forward for m in ours.model.layers)
    ids, mask = left_padded()
    caches = [m(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values for m in (ours, stock)]
    token = torch.tensor([[5], [9]])
    for _ in range(8):
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        logits = []
        for model, cache in zip((ours, stock), caches, strict=True):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
            logits.append(model(input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                use_cache=True).logits[:, -1])  # fmt: skip
        assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=0)
        token = logits[1].argmax(-1, keepdim=True)
    ids, mask = left_padded()
    greedy = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
              for m in (ours, stock)]  # fmt: skip
    assert torch.equal(greedy[0], greedy[1])


def test_latent_products_widen_where_onednn_has_no_half_kernels(monkeypatch):
    """On a CPU whose oneDNN has no bfloat16 products (AVX2), the absorbed decode's products over a bfloat16 latent
    are float32 ones (``widened``): exactly the float32 attention over the same rounded operands, returned in
    bfloat16; a left-padded row's masked tokens included."""
    from kvconvert.runtime import kvconvert_lorc as lorc

    torch.manual_seed(0)
    tensors = [torch.randn(2, 4, 1, 16), torch.randn(2, 4, 1, 8), torch.randn(2, 1, 70, 16), torch.randn(2, 1, 70, 8)]
    half = [t.bfloat16() for t in tensors]
    mask = torch.ones(2, 1, 1, 70, dtype=torch.bool)
    mask[1, ..., :5] = False
    expected = lorc.latent_attention(*(t.float() for t in half), mask, 0.25).bfloat16()
    monkeypatch.setattr(lorc, "widened", lambda tensor: True)
    got = lorc.latent_attention(*half, mask, 0.25)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_absorbed_step_widens_its_weight_products_where_onednn_has_no_half_kernels(exports, monkeypatch):
    """A bfloat16 export on a CPU whose oneDNN has no bfloat16 products (``onednn_half`` false, as on AVX2 CPUs): a
    decode step's batched products (the per-head W_UK / W_UV ones and the latent's) are float32 ones, where torch's
    batched bfloat16 loop would run element by element; with oneDNN's kernels they stay bfloat16 (so the check sees
    them when they are there). Either way the heads' output reaches o_proj contiguous: as the transposed view it
    was, the bfloat16 product took a path 10x slower under AVX2."""
    from kvconvert.runtime import kvconvert_products as products
    from tests.test_runtime_ops import _HalfProducts

    _, out = exports["llama_gqa", "0.5"]
    model = kvconvert.load(out).eval().to(torch.bfloat16)
    contiguous: list[bool] = []
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(lambda _, args: contiguous.append(args[0].is_contiguous()))
    ids = torch.randint(3, model.config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(5))
    for has_half in (True, False):
        monkeypatch.setattr(products, "onednn_half", lambda dtype, has_half=has_half: has_half)
        with torch.no_grad():
            cache = model(input_ids=ids[:, :40], use_cache=True).past_key_values
            contiguous.clear()
            with _HalfProducts() as recorded:
                model(input_ids=ids[:, 40:], past_key_values=cache, use_cache=True)
        batched = [shapes for shapes in recorded.shapes if len(shapes[0]) == 3]  # the linears' products are 2-D
        assert bool(batched) == has_half, (has_half, batched)
        assert contiguous and all(contiguous)


def test_shared_rotary_key_is_exact_for_keys_that_share_one_direction():
    """Keys of 3 heads that are one complex key times per-head complex factors (per frequency): the shared
    key keeps all of it, and a·(bᴴ z) rebuilds every head; a second independent direction is partly lost."""
    torch.manual_seed(0)
    pairs, hidden, heads = 4, 10, 3
    base = torch.randn(pairs, hidden, dtype=torch.complex128)
    factors = torch.randn(heads, pairs, dtype=torch.complex128)
    keys = factors[:, :, None] * base[None]
    gram = torch.eye(hidden, dtype=torch.float64)
    a, b, kept = shared_rotary_key(keys, gram, torch.rand(heads, pairs) + 0.1)
    shared = torch.einsum("fh,hfx->fx", b.conj(), keys)
    assert torch.allclose(torch.einsum("fh,fx->hfx", a, shared), keys, atol=1e-10)
    assert torch.allclose(kept, torch.ones(pairs, dtype=torch.float64))
    noisy = keys + torch.randn(heads, pairs, hidden, dtype=torch.complex128)
    assert (shared_rotary_key(noisy, gram, torch.ones(heads, pairs))[2] < 1).all()


def test_row_layouts_and_mean_rotation():
    """Rotate-half rows -> complex pairs -> rows is the identity; interleaved rows put pair f at rows 2f, 2f+1
    (DeepSeek's layout); the mean rotation is 1 at distance 1 and averages e^{iΔθ} over the distances."""
    weight = torch.randn(2 * 8, 5, dtype=torch.float64)
    pairs = complex_pairs(weight, 2, 8)
    assert torch.equal(half_rows(pairs).reshape(16, 5), weight)
    inter = interleaved_rows(pairs)
    assert torch.equal(inter[0, 2], weight[1]) and torch.equal(inter[0, 3], weight[5])
    theta = torch.tensor([0.0, 0.5, 3.0], dtype=torch.float64)
    assert torch.allclose(mean_rotation(theta, torch.ones(1)), torch.ones(3, dtype=torch.complex128))
    expected = sum(torch.exp(1j * k * theta) for k in range(7)) / 7
    assert torch.allclose(mean_rotation(theta, torch.ones(7)), expected)
    spread = torch.tensor([[3.0, 1.0, 0.0]])  # attention 3:1 on distances 0 and 1
    assert torch.allclose(mean_rotation(theta, spread), ((3 + torch.exp(1j * theta)) / 4)[None])


@pytest.mark.parametrize(
    ("kind", "extra", "says"),
    [
        ("qwen2_gqa", (), "attention biases"),
        ("qwen3", (), "qk_norm"),
        ("mixtral", (), "differs outside attention"),
        ("gpt2", (), "differs outside attention"),
        ("llama_gqa", ("--kv-bits", "4"), "no --kv-* storage"),
        ("llama_gqa", ("--dtype", "float16"), "float32 or bfloat16"),
        ("llama_gqa", ("--schedule", "auto"), "--schedule auto"),
        ("llama_gqa", ("--kv-budget", "0.2"), "below what MLA can hold"),
        ("llama_gqa", ("--mla-rope-dim", "32"), "at most the head width 16"),
        ("llama_gqa", ("--mla-rope-dim", "7"), "an even width >= 2 or auto"),
        ("llama_gqa", ("--mla-rope-dim", "wide"), "'wide' is neither a whole number nor auto"),
        ("llama_gqa", ("--kv-budget", "0.05", "--mla-rope-dim", "auto"), "RoPE key alone is 0.062"),
        # Llama 3.1's rope scaling slows all but the fastest of this tiny model's frequencies
        ("llama3_rope", ("--mla-rope-dim", "8"), "rope scaling (llama3) changes"),
        # and a key padded past the head width turns its pairs at plain RoPE's frequencies
        ("llama3_rope", ("--mla-sizes", "vllm"), "padded to 64 dims (--mla-sizes) turns its"),
        ("llama_kv1024", ("--kv-budget", "0.7", "--mla-sizes", "vllm"), "use a budget of at most 0.5625"),
    ],
)
def test_what_the_layout_cannot_express_is_refused_in_one_line(tokenized_model_dir, tmp_path, kind, extra, says):
    src, out = tokenized_model_dir(kind), tmp_path / "out"
    budget = () if "--kv-budget" in extra else ("--kv-budget", "0.5")
    result = run_cli("lorc", "--model", str(src), "--out", str(out), "--quiet", *MLA, *budget, *extra)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvconvert: error:") and says in lines[0], result.stderr
    assert not out.exists()


@torch.no_grad()
def test_mla_forward_is_stock_deepseek_v3_attention():
    """``mla_forward`` (what ``--refine-steps`` fits through) computes stock transformers' ``DeepseekV3Attention``
    from the same tensors: interleaved RoPE, the latent's RMSNorm (float32 inside, as stock), the per-head
    rebuild, the causal softmax, W_O (float64, random weights, 1e-6 of the largest output)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from kvconvert.methods.lorc.mla import mla_forward, mla_parts, mla_tensors

    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, kv_lora_rank=12, q_lora_rank=None, rope_interleave=True, num_hidden_layers=1,
        vocab_size=100, intermediate_size=64, rms_norm_eps=1e-6,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, 0).double().eval()
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.2)
    rotary = DeepseekV3RotaryEmbedding(config).double()
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    future = torch.full((10, 10), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    stock = attention(x, rotary(x, torch.arange(10)[None].expand(2, -1)), future)[0]
    tensors = {f"{name}.weight": getattr(attention, name).weight for name in ("q_proj", "kv_a_proj_with_mqa",
                                                                              "kv_b_proj")}  # fmt: skip
    parts = mla_parts(tensors, 4, 16, 12)
    assert all(torch.equal(mla_tensors(parts)[name], t) for name, t in tensors.items())
    ours = mla_forward(parts, attention.kv_a_layernorm.weight, attention.o_proj.weight, x, rotary.inv_freq.double(),
                       attention.scaling, attention.kv_a_layernorm.variance_epsilon)  # fmt: skip
    assert (ours - stock).abs().max() <= 1e-6 * stock.abs().max()


@pytest.mark.slow
def test_refinement_lowers_each_layers_loss_and_the_export_carries_it(tokenized_model_dir, tmp_path):
    """--refine-steps with --latent mla: every layer's attention-output loss on its calibration chunks ends at
    or below the closed form's and falls overall, the checkpoint holds the refined tensors (stock transformers
    loads it, both kvconvert loaders agree with it), and on text it was not fitted on the export is closer to
    the source than the closed form at the same budget (KL of the next-token distributions)."""
    from safetensors.torch import load_file

    from kvconvert.io.source import open_source
    from kvconvert.methods.lorc.config import LorcConfig
    from kvconvert.methods.lorc.method import LorcMethod
    from kvconvert.methods.lorc.mla import mla_tensors
    from kvconvert.pipeline import convert as convert_checkpoint

    src = tokenized_model_dir("llama_gqa")
    runs = {}
    for steps in (0, 40):
        config = LorcConfig(kv_budget=0.5, latent="mla", calib_tokens=2048, refine_steps=steps)
        runs[steps] = convert_checkpoint(open_source(str(src)), LorcMethod(config), tmp_path / f"r{steps}",
                                         progress=False)  # fmt: skip
    report, plan = runs[40].report, runs[40].plan
    assert report["plan"]["calibration"]["refine"]["steps"] == 40 and not runs[0].plan.refined
    layers = report["layers"]
    assert all(r["refine_loss_after"] <= r["refine_loss_before"] for r in layers)
    assert sum(r["refine_loss_after"] for r in layers) < 0.9 * sum(r["refine_loss_before"] for r in layers)
    stored = load_file(tmp_path / "r40" / "model.safetensors")
    for layer, parts in plan.refined.items():
        for name, tensor in mla_tensors(parts).items():
            assert torch.equal(
                stored[f"model.layers.{layer}.self_attn.{name}"],
                tensor.to(stored[f"model.layers.{layer}.self_attn.{name}"].dtype),
            )
    kls = _held_out_kl(src, {steps: tmp_path / f"r{steps}" for steps in runs})
    assert kls[40] < kls[0], kls


@pytest.mark.slow
def test_distillation_lowers_the_kl_and_rewrites_only_the_attention_projections(tokenized_model_dir, tmp_path):
    """--distill-steps: the export, as stock transformers builds it, fitted through the whole model on the source's
    next-token distribution: the calibration KL falls, only each layer's q_proj / kv_a_proj_with_mqa / kv_b_proj /
    o_proj change in the checkpoint (every other tensor byte for byte the undistilled export's), the latent stays in
    kv_a_layernorm's linear range, stock transformers and both kvconvert loaders still agree, the report and the
    model card say what ran; and on text it was not fitted on it is closer to the source than before."""
    from safetensors.torch import load_file

    from kvconvert.io.source import open_source
    from kvconvert.methods.lorc.config import LorcConfig
    from kvconvert.methods.lorc.method import LorcMethod
    from kvconvert.pipeline import convert as convert_checkpoint

    src = tokenized_model_dir("llama_gqa")
    runs = {}
    for steps in (0, 40):
        config = LorcConfig(kv_budget=0.5, latent="mla", calib_tokens=2048, distill_steps=steps, distill_chunks=4,
                            distill_len=128)  # fmt: skip
        runs[steps] = convert_checkpoint(open_source(str(src)), LorcMethod(config), tmp_path / f"d{steps}",
                                         progress=False)  # fmt: skip
    assert "refit" not in runs[0].report
    distilled = runs[40].report["refit"]["distill"]
    assert distilled["kept"] and distilled["kl_after"] < 0.9 * distilled["kl_before"], distilled
    assert distilled["steps"] == 40 and distilled["chunks"] == 4 and distilled["chunk_len"] == 128
    assert distilled["latent_mean_square_over_eps"] < 1e-2
    assert json.loads((tmp_path / "d40" / "kvconvert.json").read_text())["refit"]["distill"] == distilled
    assert "distilled through the whole model for 40 steps" in (tmp_path / "d40" / "README.md").read_text()
    before, after = load_file(tmp_path / "d0" / "model.safetensors"), load_file(tmp_path / "d40" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    fitted = {f"model.layers.{i}.self_attn.{p}.weight" for i in range(runs[40].plan.layout.num_layers)
              for p in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}  # fmt: skip
    assert changed == fitted
    kls = _held_out_kl(src, {steps: tmp_path / f"d{steps}" for steps in runs})
    assert kls[40] < kls[0], kls


@pytest.mark.slow
@torch.no_grad()
def test_rope_width_auto_keeps_the_width_whose_export_is_closest_to_the_source(tokenized_model_dir, tmp_path):
    """--mla-rope-dim auto: every candidate width (a quarter to all of the head width) is built as it would be
    written, refinement included, and scored; the KL it records for each equals that of the export written at that
    width explicitly, as stock transformers runs it on the same held-out calibration chunks; it keeps the lowest,
    and its checkpoint is byte for byte the explicit export of that width."""
    from safetensors.torch import load_file

    from kvconvert.calib.text import calibration_set

    src = tokenized_model_dir("llama_gqa")
    options = (*MLA, "--kv-budget", "0.5", "--refine-steps", "10")
    convert("lorc", src, tmp_path / "auto", *options, "--mla-rope-dim", "auto")
    report = json.loads((tmp_path / "auto" / "kvconvert.json").read_text())
    search = report["plan"]["calibration"]["rope_search"]
    widths = [c["rope_dim"] for c in search["candidates"]]
    head_dim = transformers.AutoConfig.from_pretrained(src).head_dim
    assert widths == [head_dim // 4, head_dim // 2, head_dim * 3 // 4, head_dim], widths
    assert all(c["kv_lora_rank"] + c["rope_dim"] == search["candidates"][0]["kv_lora_rank"] + widths[0]
               for c in search["candidates"])  # fmt: skip
    assert any(r["refine_loss_after"] < r["refine_loss_before"] for r in report["layers"])  # the fit is scored
    best = min(search["candidates"], key=lambda c: c["kl"])
    assert transformers.AutoConfig.from_pretrained(tmp_path / "auto").qk_rope_head_dim == best["rope_dim"]
    chunks = calibration_set(src, None, 2048, search["chunk_len"], 0).held_out[: search["chunks"]]
    assert chunks.shape[0] == search["chunks"] == 4
    reference = load_reference(src)(chunks).logits.log_softmax(-1)
    for candidate in search["candidates"]:
        out = tmp_path / str(candidate["rope_dim"])
        convert("lorc", src, out, *options, "--mla-rope-dim", str(candidate["rope_dim"]))
        logits = _stock(out)(chunks).logits.log_softmax(-1)
        kl = float((reference.exp() * (reference - logits)).sum(-1).mean())
        assert kl == pytest.approx(candidate["kl"], rel=1e-5), (candidate, kl)
    chosen, explicit = load_file(tmp_path / "auto" / "model.safetensors"), load_file(
        tmp_path / str(best["rope_dim"]) / "model.safetensors")  # fmt: skip
    assert chosen.keys() == explicit.keys() and all(torch.equal(chosen[n], explicit[n]) for n in chosen)
    card = (tmp_path / "auto" / "README.md").read_text()
    assert f"one RoPE key of {best['rope_dim']} values" in card and "(--mla-rope-dim auto)" in card


@pytest.mark.parametrize("option", [("--distill-steps", "5"), ("--mla-rope-dim", "auto"), ("--mla-sizes", "vllm")])
def test_the_mla_options_need_the_mla_export(tokenized_model_dir, tmp_path, option):
    src, out = tokenized_model_dir("llama_gqa"), tmp_path / "out"
    result = run_cli("lorc", "--model", str(src), "--out", str(out), "--quiet", "--kv-budget", "0.5", *option)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and option[0] in lines[0] and "needs --latent mla" in lines[0], result.stderr
    assert not out.exists()


@torch.no_grad()
@pytest.mark.parametrize(
    ("kind", "extra"), [("llama_gqa", ()), ("llama_gqa64", ("--mla-rope-dim", "32", "--refine-steps", "3"))]
)
def test_vllm_sizes_pad_the_export_into_the_same_model(tokenized_model_dir, tmp_path, kind, extra):
    """``--mla-sizes vllm``: the budget's export written at kv_lora_rank 512 + a 64-wide RoPE key (a head width of
    16 below it, or a refined 32-wide key in a head of 64), the latent and the key zero-padded: stock transformers
    computes the budget-sized export's logits (the latent norm then averages over the padded zeros: ~1e-5
    relative), both kvconvert loaders agree with it, the padded rows and columns are zero, and the cache holds 576
    values per token and layer (measured)."""
    src = tokenized_model_dir(kind)
    extra = ("--kv-budget", "0.5", *extra)
    plain, padded = tmp_path / "budget", tmp_path / "vllm"
    convert("lorc", src, plain, *MLA, *extra)
    convert("lorc", src, padded, *MLA, *extra, "--mla-sizes", "vllm")
    before, config = (json.loads((out / "config.json").read_text()) for out in (plain, padded))
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["head_dim"]) == (512, 64, 64)
    rank, kept, d = before["kv_lora_rank"], before["qk_rope_head_dim"], before["qk_nope_head_dim"]
    kv_width = json.loads((src / "config.json").read_text())["num_key_value_heads"] * d  # the source's
    assert kept == (32 if "--mla-rope-dim" in extra else d) and rank + kept == kv_width  # 0.5: half of K and V
    from safetensors.torch import load_file

    tensors = load_file(padded / "model.safetensors")
    heads = config["num_attention_heads"]
    kv_a = tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a[rank:512].abs().max() == 0 and kv_a[512 + kept :].abs().max() == 0 and kv_a[512:576].abs().max() > 0
    assert tensors["model.layers.1.self_attn.kv_b_proj.weight"][:, rank:].abs().max() == 0
    query = tensors["model.layers.1.self_attn.q_proj.weight"].view(heads, d + 64, -1)
    assert query[:, d + kept :].abs().max() == 0 and query[:, d : d + kept].abs().max() > 0
    ids, mask = left_padded()
    reference = _stock(plain)(input_ids=ids, attention_mask=mask).logits
    stock = _stock(padded)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    # 1.2e-5 of the largest logit measured, in float64 too: the norm averaging over the padded zeros (averaged over
    # the budget's coordinates alone it is 3e-7); two RoPE pairs swapped in the padded key moved them by 5.6
    assert (stock - reference)[valid].abs().max() <= 1e-4 * reference.abs().max()
    for model in (load_converted(padded), kvconvert.load(padded).eval()):
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits, stock, atol=1e-5, rtol=0)
    expected = 576 / (2 * kv_width)
    report = json.loads((padded / "kvconvert.json").read_text())
    card = (padded / "README.md").read_text()
    assert report["plan"]["mla"]["written"] == {"kv_lora_rank": 512, "rope_dim": 64, "for": "vllm"}
    assert "(--mla-sizes vllm)" in card and report["params"]["mla_sizes"] == "vllm"
    sample = torch.randint(3, 90, (2, 96), generator=torch.Generator().manual_seed(3))
    assert report["kv_budget_expected"] == pytest.approx(expected)
    assert kv_budget(load_reference(src), _stock(padded), sample) == pytest.approx(expected)


@torch.no_grad()
def _held_out_kl(src: Path, outputs: dict[int, Path]) -> dict[int, float]:
    """Per export: KL of its next-token distribution from the source's on random ids it was not fitted on, after
    checking that stock transformers and both kvconvert loaders compute the same logits (1e-5)."""
    ids = torch.randint(3, 90, (2, 48), generator=torch.Generator().manual_seed(11))
    reference = load_reference(src)(ids).logits.log_softmax(-1)
    kls = {}
    for steps, out in outputs.items():
        logits = _stock(out)(ids).logits
        for model in (load_converted(out), kvconvert.load(out).eval()):
            assert torch.allclose(model(ids).logits, logits, atol=1e-5, rtol=0)
        kls[steps] = float((reference.exp() * (reference - logits.log_softmax(-1))).sum(-1).mean())
    return kls
