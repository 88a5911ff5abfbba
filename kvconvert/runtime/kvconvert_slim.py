"""Slim attention runtime (Graef & Wasielewski, "Slim attention: cut your context memory in half").

Only K is cached; values are V = K·W_KV (paper eq. 4). Keys are cached *before* RoPE (paper §3,
option 1) so they can be multiplied by W_KV directly, and rotated when read: each head's channels
are cached with RoPE's pairs side by side (``pair_order``), so that rotating every cached key at each
step is one complex product instead of rotate-half's three passes. Copied verbatim into every slim
output directory; imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .kvconvert_common import (
    CompressedCache,
    LatentAttention,
    default_position_ids,
    latent_layers,
    pairs_for_keys,
    qk_norms,
    query_scores,
    rotary_for_keys,
    softmax_rows,
)
from .kvconvert_compiled import compiled_call
from .kvconvert_folded import fuses
from .kvconvert_kernels import use_kernels
from .kvconvert_prefill import additive_mask, prefill_attention
from .kvconvert_products import cache_mix
from .kvconvert_rope import (
    from_pairs,
    rotate_in_pairs,
    rotate_pairs,
    scores_by_piece,
    to_pairs,
    turned_scores,
    turns_on_query_side,
)


class SlimAttention(LatentAttention):
    """Drop-in replacement for an MHA attention module whose cache holds only K.

    Parameters (``nn.Linear``, weights ``[out, in]``): ``q_proj [e, d]``, ``k_proj [e, d]``,
    ``kv_proj [e, e]`` (W_KV: maps a full pre-RoPE key row to all heads' values), ``o_proj [d, e]``.
    Any V bias was folded into ``o_proj.bias`` at conversion, exactly. A QK-norm model's ``q_norm``/``k_norm``
    apply before RoPE as the source applies them; the cache keeps the keys before the norm (the values are linear
    in them), and a step normalises the keys it scores.
    """

    def __init__(self, spec: dict[str, Any], layer_idx: int, rotary: nn.Module | None):
        super().__init__(layer_idx, rotary)
        self.num_heads = int(spec["num_heads"])
        self.head_dim = int(spec["head_dim"])
        self.scaling = float(spec["scaling"][layer_idx])
        width = self.num_heads * self.head_dim
        hidden = int(spec["hidden_size"])
        self.q_proj = nn.Linear(hidden, width, bias=bool(spec["q_bias"]))
        self.k_proj = nn.Linear(hidden, width, bias=bool(spec["k_bias"]))
        self.kv_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, hidden, bias=bool(spec["o_bias"]))
        norms = qk_norms(spec, self.num_heads, self.num_heads, self.head_dim)  # QK-norm (RoPE models only)
        if norms is not None:
            self.q_norm, self.k_norm = norms

    def _scored(self, keys: torch.Tensor, rotated: int) -> torch.Tensor:
        """Cached keys ``[b, n, e]`` (each head's channels in ``pair_order``) as the source scores them before RoPE:
        through its key norm, whose weight is taken in the same order; as they are without QK-norm."""
        norm = getattr(self, "k_norm", None)
        if norm is None:
            return keys
        h = self.num_heads
        weight = to_pairs(norm.weight if norm.head_dim is None else norm.weight.repeat(h), h, rotated)
        return norm(keys, weight if norm.head_dim is None else weight.view(h, -1))

    def _decode_order_is_cheaper(self, q_len: int, kv_len: int) -> bool:
        """Paper eq. 5: option 2 ((softmax·K)·W_KV) vs option 1 (softmax·(K·W_KV)), in multiply-adds."""
        h, e = self.num_heads, self.num_heads * self.head_dim
        option1 = kv_len * e * e + h * q_len * kv_len * self.head_dim
        option2 = h * q_len * kv_len * e + q_len * e * e
        return option2 < option1

    def head_columns(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Head h scores its own dk key columns and sums whole key rows (e wide)."""
        h, dk = self.num_heads, self.head_dim
        return [i * dk for i in range(h)], [dk] * h, [0] * h, [h * dk] * h

    def attend(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        h, dk = self.num_heads, self.head_dim
        rotary = self.rotary
        kernel = q_len == 1 and use_kernels(hidden_states)

        query = self.q_proj(hidden_states)  # [b, q, e]
        if hasattr(self, "q_norm"):
            query = self.q_norm(query)
        new_keys = self.k_proj(hidden_states)  # [b, q, e], before RoPE
        rotated = 0  # channels per head that RoPE turns (0: a model without RoPE)
        scores: torch.Tensor | None = None
        if rotary is not None:
            if position_embeddings is None:
                if position_ids is None:
                    position_ids = default_position_ids(cache, self.layer_idx, q_len, hidden_states.device)
                position_embeddings = rotary(hidden_states, position_ids)
            cos, sin = position_embeddings
            rotated = cos.shape[-1]
            # cached in pair order: the weighted key rows go back to the model's order before W_KV (``from_pairs``)
            query, new_keys = to_pairs(query, h, rotated), to_pairs(new_keys, h, rotated)
        keys, _, position_ids, key_positions = self.append_step(cache, new_keys, None, position_ids)
        kv_len = keys.shape[1]

        def model_order(rows: torch.Tensor) -> torch.Tensor:
            """Key rows (or weighted sums of them) from the cache's pair order back to the model's, for W_KV."""
            return rows if rotary is None else from_pairs(rows, h, rotated)

        if rotary is not None:
            query = rotate_in_pairs(query, cos, sin, h)  # [b, h, q, dk]
            assert key_positions is not None
            key_cos, key_sin = rotary_for_keys(cache, rotary, keys, key_positions)
            pairs = pairs_for_keys(cache, key_cos, key_sin)
            one_query = q_len == 1 and not kernel and self._decode_order_is_cheaper(q_len, kv_len)  # option 2, torch
            if one_query and fuses(keys):
                # eagerly on a CPU, RoPE on the query side in one compiled pass (``turned_scores``: 1 × 4K of 16 heads
                # 0.46 ms a layer where turning and scoring a piece at a time takes 1.55, AMD EPYC). Where it cannot
                # build: a piece at a time if the keys have complex pairs (not in half precision), else all turned
                # first. Option 2 then reads the keys unturned
                scores = compiled_call("turned_scores", turned_scores, query, self._scored(keys, rotated),
                                       key_cos, key_sin, True)  # fmt: skip
            if scores is None and one_query and pairs is not None:
                scores = scores_by_piece(query, kv_len, h * dk, lambda at, to: rotate_pairs(
                    self._scored(keys[:, at:to], rotated), pairs[:, at:to], h))  # fmt: skip
            elif scores is None and one_query and turns_on_query_side(keys, q_len):
                scores = turned_scores(query, self._scored(keys, rotated), key_cos, key_sin, paired=True)
            elif scores is None:
                key_heads = rotate_in_pairs(self._scored(keys, rotated), key_cos, key_sin, h, pairs)
        else:
            query = query.view(batch, q_len, h, dk).transpose(1, 2)  # [b, h, q, dk]
            key_heads = keys.view(batch, kv_len, h, dk).transpose(1, 2)  # [b, h, n, dk]

        if kernel:
            bias = additive_mask(attention_mask, q_len, kv_len, query.dtype, query.device)
            # option 2 in one launch: scores on the RoPE'd keys, weights applied to the pre-RoPE rows
            rotated_rows = key_heads.transpose(1, 2).reshape(batch, kv_len, h * dk)
            mixed = self.decode_with_kernel(query.reshape(batch, h * dk), rotated_rows, keys, bias)
            mixed = mixed.view(batch, h, h * dk).to(keys.dtype)
            mixed = model_order(mixed)
            kv_per_head = self.kv_proj.weight.view(h, dk, h * dk)
            out = torch.einsum("bhe,hde->bhd", mixed, kv_per_head)
            return self.o_proj(out.reshape(batch, 1, h * dk))
        if self._decode_order_is_cheaper(q_len, kv_len):
            scores = (query_scores(query, key_heads) if scores is None else scores) * self.scaling  # [b, h, q, n]
            bias = additive_mask(attention_mask, q_len, kv_len, query.dtype, query.device)
            if bias is not None:
                scores = scores + bias
            probs = softmax_rows(scores, query.dtype)
            # option 2, softmax·K first; one bmm over all heads ([b, h·q, n] @ [b, n, e]) because a
            # broadcast matmul against keys[:, None] would copy K once per head.
            mixed_keys = cache_mix(probs.reshape(batch, h * q_len, -1), keys, blocks=False).view(batch, h, q_len, -1)
            mixed_keys = model_order(mixed_keys)
            kv_per_head = self.kv_proj.weight.view(h, dk, h * dk)  # [h, dk, e]
            out = torch.einsum("bhqe,hde->bhqd", mixed_keys, kv_per_head)
        else:
            values = self.kv_proj(model_order(keys))  # option 1: V = K·W_KV
            values = values.view(batch, kv_len, h, dk).transpose(1, 2)
            out = prefill_attention(query, key_heads, values, attention_mask, self.scaling)
        out = out.transpose(1, 2).reshape(batch, q_len, h * dk)
        return self.o_proj(out)


def make_cache(spec: dict[str, Any], max_cache_len: int | None = None) -> CompressedCache:
    """Per layer only the pre-RoPE keys (``LatentLayer`` with no values); static when ``max_cache_len`` is given."""
    layers = latent_layers(spec, [True] * len(spec["attention_modules"]), max_cache_len)
    return CompressedCache(layers, track_positions=spec.get("rotary_module") is not None)
