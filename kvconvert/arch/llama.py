"""Llama family: Llama, Mistral, Qwen2 (separate q/k/v/o projections, rotate-half RoPE)."""

from __future__ import annotations

import re

import torch

from kvconvert.arch.base import ArchAdapter, AttentionLayout, AttentionWeights


class LlamaAdapter(ArchAdapter):
    family = "llama"
    model_types = ("llama", "mistral", "qwen2")
    attention_name_pattern = re.compile(r"^(?P<prefix>(?:model\.)?layers\.(?P<layer>\d+)\.self_attn\.)(?P<local>.+)$")
    attention_module_template = "model.layers.{i}.self_attn"

    def layout(self) -> AttentionLayout:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return AttentionLayout(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
            head_dim=head_dim,
            scaling=(head_dim**-0.5,) * c.num_hidden_layers,
            rotary=True,
            rotary_module="model.rotary_emb",
            context=c.max_position_embeddings,
        )

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
        )
