"""What a DeepSeek-V3 (multi-head latent attention) checkpoint of a source model must say, for ``lorc --latent
mla``: the config transformers, vLLM and SGLang build ``DeepseekV3ForCausalLM`` from, and the source's RoPE
frequencies the shared rotary key keeps. The only place that knows DeepSeek-V3's config fields.

A Llama-family decoder layer (RMSNorm → attention → RMSNorm → gated SiLU MLP) is a DeepSeek-V3 dense layer
(``first_k_dense_replace`` = every layer) with the same tensor names outside attention, so only the attention
block is rewritten. DeepSeek's RoPE part has ``qk_rope_head_dim`` dims at frequencies ``θ^(−2f/r)``: with
``r`` = the source's head width and the source's ``rope_parameters``, pair ``f`` turns at exactly the source's
frequency ``f`` (any rope type that transformers computes from the head width: default, linear, llama3, yarn).
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


def check_mla_source(adapter: ArchAdapter, layout: AttentionLayout) -> None:
    """Refuse, in one line, a source whose attention DeepSeek-V3's layout cannot express."""
    if layout.features:
        raise KVConvertError(f"--latent mla cannot express this model's {', '.join(layout.features)} in DeepSeek-V3's "
                             "attention")  # fmt: skip
    model_type = adapter.config.model_type
    if model_type not in MLA_MODEL_TYPES:
        raise KVConvertError(
            f"--latent mla writes a DeepSeek-V3 checkpoint, whose decoder layers are Llama's ({', '.join(MLA_MODEL_TYPES)}); "
            f"{model_type} differs outside attention"
        )
    if rope_frequencies(adapter.config, layout).numel() != layout.head_dim // 2:
        raise KVConvertError("--latent mla needs RoPE on every dimension of a head (this model rotates only part of it: "
                             "partial_rotary_factor)")  # fmt: skip


def rope_frequencies(config: Any, layout: AttentionLayout) -> torch.Tensor:
    """The source's RoPE angular frequencies (radians per token) ``[pairs]`` float64, as transformers computes
    them for Llama-family configs (rope scaling included); pair ``f`` rotates dims ``(f, f + d/2)``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config).inv_freq.to(torch.float64)


def deepseek_v3_config(config: Any, layout: AttentionLayout, kv_lora_rank: int) -> dict[str, Any]:
    """``config.json`` entries (over the source's) of the DeepSeek-V3 export: every layer dense, no query
    LoRA, one latent of ``kv_lora_rank`` plus a shared rotary key of the source's head width, keys and
    values of the source's head width per query head, RoPE pairs interleaved (DeepSeek's layout, the one
    vLLM's MLA kernels assume)."""
    d = layout.head_dim
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_key_value_heads": layout.num_heads,  # kv_b_proj rebuilds keys and values for every query head
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": None,
        "qk_rope_head_dim": d,
        "qk_nope_head_dim": d,
        "v_head_dim": d,
        "head_dim": d,
        "rope_interleave": True,
        "first_k_dense_replace": layout.num_layers,  # every decoder layer keeps the source's dense MLP
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
        "rms_norm_eps": LATENT_NORM_EPS,
    }


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
