"""GPT-NeoX / Pythia: fused, head-interleaved QKV, partial rotary, biases everywhere."""

from __future__ import annotations

import re

import torch

from kvconvert.arch.base import ArchAdapter, AttentionLayout, AttentionWeights


class GPTNeoXAdapter(ArchAdapter):
    family = "gpt_neox"
    model_types = ("gpt_neox",)
    attention_name_pattern = re.compile(
        r"^(?P<prefix>(?:gpt_neox\.)?layers\.(?P<layer>\d+)\.attention\.)(?P<local>.+)$"
    )
    attention_module_template = "gpt_neox.layers.{i}.attention"
    layer_cache_name = "layer_past"
    stored_head = "embed_out"  # transformers 5 loads it as lm_head

    def layout(self) -> AttentionLayout:
        c = self.config
        head_dim = c.hidden_size // c.num_attention_heads
        return AttentionLayout(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_attention_heads,
            head_dim=head_dim,
            scaling=(head_dim**-0.5,) * c.num_hidden_layers,
            rotary=True,
            rotary_module="gpt_neox.rotary_emb",
            context=c.max_position_embeddings,
        )

    def read_attention(self, tensors: dict[str, torch.Tensor]) -> AttentionWeights:
        layout = self.layout()
        heads, head_dim, d = layout.num_heads, layout.head_dim, layout.hidden_size
        # query_key_value rows are ordered [head, (q|k|v), head_dim]
        qkv_w = tensors["query_key_value.weight"].view(heads, 3, head_dim, d)
        qkv_b = tensors.get("query_key_value.bias")
        qkv_b = None if qkv_b is None else qkv_b.view(heads, 3, head_dim)

        def part(i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = qkv_w[:, i].reshape(heads * head_dim, d).contiguous()
            b = None if qkv_b is None else qkv_b[:, i].reshape(heads * head_dim).contiguous()
            return w, b

        (q_w, q_b), (k_w, k_b), (v_w, v_b) = part(0), part(1), part(2)
        return AttentionWeights(
            q_weight=q_w,
            k_weight=k_w,
            v_weight=v_w,
            o_weight=tensors["dense.weight"],
            q_bias=q_b,
            k_bias=k_b,
            v_bias=v_b,
            o_bias=tensors.get("dense.bias"),
        )
