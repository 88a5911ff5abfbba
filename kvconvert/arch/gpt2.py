"""GPT-2: fused Conv1D c_attn (weights stored [in, out]), learned positions, biases."""

from __future__ import annotations

import re

import torch

from kvconvert.arch.base import ArchAdapter, AttentionLayout, AttentionWeights


class GPT2Adapter(ArchAdapter):
    family = "gpt2"
    model_types = ("gpt2",)
    attention_name_pattern = re.compile(r"^(?P<prefix>(?:transformer\.)?h\.(?P<layer>\d+)\.attn\.)(?P<local>.+)$")
    attention_module_template = "transformer.h.{i}.attn"

    def layout(self) -> AttentionLayout:
        c = self.config
        head_dim = c.hidden_size // c.num_attention_heads
        scaling = []
        for layer in range(c.num_hidden_layers):
            scale = head_dim**-0.5 if c.scale_attn_weights else 1.0
            if c.scale_attn_by_inverse_layer_idx:
                scale /= float(layer + 1)
            scaling.append(scale)
        return AttentionLayout(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_attention_heads,
            head_dim=head_dim,
            scaling=tuple(scaling),
            rotary=False,
            rotary_module=None,
            context=c.n_positions,
        )

    def read_attention(self, tensors: dict[str, torch.Tensor]) -> AttentionWeights:
        d = self.config.hidden_size
        # Conv1D stores [in, out]; transpose to Linear's [out, in] before splitting q|k|v.
        qkv_w = tensors["c_attn.weight"].T
        qkv_b = tensors["c_attn.bias"]
        q_w, k_w, v_w = (qkv_w[i * d : (i + 1) * d].contiguous() for i in range(3))
        q_b, k_b, v_b = (qkv_b[i * d : (i + 1) * d].contiguous() for i in range(3))
        return AttentionWeights(
            q_weight=q_w,
            k_weight=k_w,
            v_weight=v_w,
            o_weight=tensors["c_proj.weight"].T.contiguous(),
            q_bias=q_b,
            k_bias=k_b,
            v_bias=v_b,
            o_bias=tensors["c_proj.bias"],
        )
