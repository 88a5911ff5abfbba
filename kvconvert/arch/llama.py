"""Llama family: Llama, Mistral, Mixtral, Qwen2 (separate q/k/v/o projections, rotate-half RoPE) and the blocks
that keep its attention (Gemma 1, Arcee, Seed-OSS, StarCoder2), and the families built on it since 2024: Qwen3,
Apertus and OLMo 2/3 (QK-norm), Gemma 2/3 (local layers, soft-capping, scaled queries), Granite (its own softmax
scale), SmolLM3 (layers without RoPE), Helium, Cohere, GLM and ERNIE 4.5 (RoPE on interleaved pairs), Cohere 2
(both) and Phi-3 (one fused QKV projection)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, ClassVar

import torch

from kvconvert.arch.base import ArchAdapter, AttentionLayout, AttentionWeights

# Llama's layout whose RoPE rotates channel pairs (2i, 2i + 1) (their rotate_half interleaves): the methods that keep
# the stock attention convert them, the ones that rotate keys themselves the rotate-half way refuse (a tiny Helium's
# LoRC and ZACK conversions did not reproduce it)
INTERLEAVED_ROPE = ("helium", "cohere", "glm", "glm4", "ernie4_5")


class LlamaAdapter(ArchAdapter):
    family = "llama"
    # Llama's attention as it is (q/k/v/o under model.layers.N.self_attn, head_dim^-1/2), whatever the rest of the
    # block does: Gemma 1 (a (1 + w) RMSNorm, scaled embeddings), Arcee (ReLU² MLP), Seed-OSS and StarCoder2 (q/k/v
    # biases; StarCoder2 an o bias and LayerNorms too), and with RoPE on interleaved pairs (INTERLEAVED_ROPE)
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "arcee",
                                              "seed_oss", "starcoder2", *INTERLEAVED_ROPE)  # fmt: skip
    attention_name_pattern = re.compile(r"^(?P<prefix>(?:model\.)?layers\.(?P<layer>\d+)\.self_attn\.)(?P<local>.+)$")
    attention_module_template = "model.layers.{i}.self_attn"
    writes_values = True

    def value_output_tensors(self, weights: AttentionWeights) -> dict[str, torch.Tensor]:
        tensors = {"v_proj.weight": weights.v_weight, "o_proj.weight": weights.o_weight}
        if weights.v_bias is not None:
            tensors["v_proj.bias"] = weights.v_bias
        return tensors

    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    def softmax_scale(self) -> float:
        return float(self.head_dim() ** -0.5)

    def layout(self) -> AttentionLayout:
        c = self.config
        local, window = self.local_layers()
        return AttentionLayout(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=self.head_dim(),
            scaling=(self.softmax_scale(),) * c.num_hidden_layers,
            rotary=True,
            rotary_module="model.rotary_emb",
            context=c.max_position_embeddings,
            qk_norm=self.qk_norm(),
            qk_norm_eps=float(c.rms_norm_eps) if self.qk_norm() else None,
            qk_norm_per_head=c.model_type not in ("olmo2", "olmo3"),
            local_layers=local,
            sliding_window=window,
            softcap=getattr(c, "attn_logit_softcapping", None),
            layer_rope=self.layer_rope(),
            interleaved_rope=self.interleaved_rope(),
            engine_kv_scales=True,
        )

    def qk_norm(self) -> bool:
        """An RMSNorm on queries and keys between projection and RoPE?"""
        return False

    def key_norm(self, attention: Any) -> tuple[Any, torch.Tensor, float] | None:
        norm = getattr(attention, "k_norm", None)  # Qwen3RMSNorm, Olmo2RMSNorm: weight · x / rms(x)
        return None if norm is None else (attention.k_proj, norm.weight.detach(), float(norm.variance_epsilon))

    def layer_rope(self) -> bool:
        """RoPE tables that differ between local and global layers?"""
        return False

    def interleaved_rope(self) -> bool:
        """RoPE on channel pairs (2i, 2i + 1) rather than rotate-half's (i, i + d/2)?"""
        return self.config.model_type in INTERLEAVED_ROPE

    def read_attention(self, tensors: dict[str, torch.Tensor]) -> AttentionWeights:
        return AttentionWeights(
            q_weight=tensors["q_proj.weight"],
            k_weight=tensors["k_proj.weight"],
            v_weight=tensors["v_proj.weight"],
            o_weight=tensors["o_proj.weight"],
            q_bias=tensors.get("q_proj.bias"),
            k_bias=tensors.get("k_proj.bias"),
            v_bias=tensors.get("v_proj.bias"),
            o_bias=tensors.get("o_proj.bias"),
            q_norm=tensors.get("q_norm.weight"),
            k_norm=tensors.get("k_norm.weight"),
        )


class QKNormAdapter(LlamaAdapter):
    """Qwen3 and Apertus (an RMSNorm per head), OLMo 2 and 3 (one RMSNorm over all heads; OLMo 3 with sliding-window
    layers between global ones): same tensors as Llama, plus q_norm/k_norm weights that methods keeping stock
    attention carry through unchanged."""

    family = "qk_norm"
    model_types = ("qwen3", "qwen3_moe", "olmo2", "olmo3", "apertus")

    def qk_norm(self) -> bool:
        return True


GEMMA3_NORM_OFFSET = 1.0  # Gemma3RMSNorm scales by (1 + weight): the stored weight is the scale less 1


class GemmaAdapter(LlamaAdapter):
    """Gemma 2 and Gemma 3 text models: queries scaled by query_pre_attn_scalar^-1/2, local
    (sliding-window) layers between global ones; Gemma 2 soft-caps attention logits, Gemma 3 has
    QK-norm and separate RoPE tables for local layers."""

    family = "gemma"
    model_types = ("gemma2", "gemma3_text")

    def softmax_scale(self) -> float:
        return float(self.config.query_pre_attn_scalar**-0.5)

    def qk_norm(self) -> bool:
        return self.config.model_type == "gemma3_text"

    def layout(self) -> AttentionLayout:
        return replace(super().layout(), qk_norm_offset=GEMMA3_NORM_OFFSET if self.qk_norm() else 0.0)

    def key_norm(self, attention: Any) -> tuple[Any, torch.Tensor, float] | None:
        norm = getattr(attention, "k_norm", None)
        if norm is None:
            return None
        return attention.k_proj, norm.weight.detach().float() + GEMMA3_NORM_OFFSET, float(norm.eps)

    def layer_rope(self) -> bool:
        return self.config.model_type == "gemma3_text"


class SmolLM3Adapter(LlamaAdapter):
    """SmolLM3: Llama's attention, but every fourth layer (``no_rope_layers[i] == 0``) applies no RoPE; its layer
    types slide only with ``use_sliding_window``."""

    family = "smollm3"
    model_types = ("smollm3",)

    def layout(self) -> AttentionLayout:
        rope = getattr(self.config, "no_rope_layers", None) or []
        return replace(super().layout(), nope_layers=tuple(i for i, used in enumerate(rope) if not used))

    def local_layers(self) -> tuple[tuple[int, ...], int | None]:
        return super().local_layers() if getattr(self.config, "use_sliding_window", False) else ((), None)


class Cohere2Adapter(LlamaAdapter):
    """Cohere 2 (Command R7B, Command A): sliding-window layers with RoPE on interleaved pairs between global layers
    that apply no RoPE at all."""

    family = "cohere2"
    model_types = ("cohere2",)

    def interleaved_rope(self) -> bool:
        return True

    def layout(self) -> AttentionLayout:
        layout = super().layout()
        nope = tuple(i for i in range(layout.num_layers) if i not in layout.local_layers)
        return replace(layout, nope_layers=nope if layout.local_layers else ())


class GraniteAdapter(LlamaAdapter):
    """IBM Granite 3.x (dense and MoE): Llama's attention scaled by ``attention_multiplier`` instead of
    head_dim^-1/2 (its embedding, residual and logit multipliers act outside attention, in the stock model)."""

    family = "granite"
    model_types = ("granite", "granitemoe")

    def softmax_scale(self) -> float:
        return float(self.config.attention_multiplier)


class Phi3Adapter(LlamaAdapter):
    """Phi-3: one fused ``qkv_proj`` whose rows are [q (H·dk) | k (Hkv·dk) | v (Hkv·dk)], and partial
    rotary (``partial_rotary_factor``) on some checkpoints."""

    family = "phi3"
    model_types = ("phi3",)
    writes_values = False  # v is rows of the fused qkv_proj

    def read_attention(self, tensors: dict[str, torch.Tensor]) -> AttentionWeights:
        layout = self.layout()
        q_rows, kv_rows = layout.num_heads * layout.head_dim, layout.kv_width
        q, k, v = tensors["qkv_proj.weight"].split([q_rows, kv_rows, kv_rows], dim=0)
        return AttentionWeights(q_weight=q, k_weight=k, v_weight=v, o_weight=tensors["o_proj.weight"])
