"""Slim attention runtime (Graef & Wasielewski, "Slim attention: cut your context memory in half").

Only K is cached; values are V = K·W_KV (paper eq. 4). Keys are cached *before* RoPE (paper §3,
option 1) so they can be multiplied by W_KV directly, and rotated when read. Copied verbatim
into every slim output directory; imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from .kvconvert_common import additive_mask, apply_rotary, softmax_rows


class KeyOnlyLayer(DynamicLayer):
    """One layer's cache: pre-RoPE keys ``[b, n, e]`` and nothing else (``values`` stays None)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty((key_states.shape[0], 0, key_states.shape[-1]))
        self.values = None
        self.is_initialized = True

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        self.keys = torch.cat([self._keys(), key_states], dim=-2)
        return self.keys, None

    def _keys(self) -> torch.Tensor:
        assert self.keys is not None, "cache layer used before its first update"
        return self.keys

    def reset(self) -> None:
        self.keys, self.values, self.is_initialized = None, None, False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop() takes a negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self.keys = self._keys()[:, :tokens_to_remove]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.keys = self._keys().repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.keys = self._keys()[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            keys = self._keys()
            self.keys = keys.index_select(0, beam_idx.to(keys.device))

    def offload(self) -> None:
        if self.is_initialized:
            self.keys = self._keys().to("cpu", non_blocking=True)

    def prefetch(self) -> None:
        if self.is_initialized and self._keys().device != self.device:
            self.keys = self._keys().to(self.device, non_blocking=True)


class KeyOnlyCache(Cache):
    """Slim attention's cache: per layer the pre-RoPE keys, plus one ``[b, n]`` int32 position
    table shared by all layers (RoPE is applied at read time, and left padding makes positions
    differ per row). No value tensor exists anywhere in it.
    """

    def __init__(self, num_layers: int, track_positions: bool):
        self.key_layers = [KeyOnlyLayer() for _ in range(num_layers)]
        super().__init__(layers=list(self.key_layers))
        self.track_positions = track_positions
        self.positions: torch.Tensor | None = None
        # cos/sin of all cached positions, computed by the first layer of a forward pass and
        # reused by the others; released when the forward pass ends (never kept between steps).
        self._rope_step: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope_for_keys(self, rotary: nn.Module, keys: torch.Tensor, positions: torch.Tensor):
        """(cos, sin) ``[b, n, r]`` for the cached keys, shared by all layers of one step."""
        if self._rope_step is None or self._rope_step[0].shape[1] != positions.shape[1]:
            self._rope_step = rotary(keys, positions.long())
        return self._rope_step

    def end_step(self) -> None:
        self._rope_step = None

    def update_keys(
        self, new_keys: torch.Tensor, layer_idx: int, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``new_keys [b, q, e]``; return all keys ``[b, n, e]`` and positions ``[b, n]``."""
        keys, _ = self.key_layers[layer_idx].update(new_keys)
        if not self.track_positions:
            return keys, None
        if self.positions is None or self.positions.shape[1] < keys.shape[1]:
            # The first layer of a forward pass appends; later layers read the same table.
            assert position_ids is not None
            batch, q_len = new_keys.shape[0], new_keys.shape[1]
            new_positions = position_ids.to(torch.int32).expand(batch, q_len)
            self.positions = (
                new_positions if self.positions is None else torch.cat([self.positions, new_positions], dim=1)
            )
        return keys, self.positions[:, : keys.shape[1]]

    def reset(self) -> None:
        super().reset()
        self.positions = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.positions is not None and tokens_to_remove:
            self.positions = self.positions[:, :tokens_to_remove]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))


class SlimAttention(nn.Module):
    """Drop-in replacement for an MHA attention module whose cache holds only K.

    Parameters (``nn.Linear``, weights ``[out, in]``): ``q_proj [e, d]``, ``k_proj [e, d]``,
    ``kv_proj [e, e]`` (W_KV: maps a full pre-RoPE key row to all heads' values), ``o_proj [d, e]``.
    Any V bias was folded into ``o_proj.bias`` at conversion, exactly.
    """

    def __init__(self, spec: dict[str, Any], layer_idx: int, rotary: nn.Module | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = int(spec["num_heads"])
        self.head_dim = int(spec["head_dim"])
        self.scaling = float(spec["scaling"][layer_idx])
        width = self.num_heads * self.head_dim
        hidden = int(spec["hidden_size"])
        self.q_proj = nn.Linear(hidden, width, bias=bool(spec["q_bias"]))
        self.k_proj = nn.Linear(hidden, width, bias=bool(spec["k_bias"]))
        self.kv_proj = nn.Linear(width, width, bias=False)
        self.o_proj = nn.Linear(width, hidden, bias=bool(spec["o_bias"]))
        # The rotary module is owned by the model; keep a plain reference, not a submodule.
        self.__dict__["_rotary"] = rotary

    def _decode_order_is_cheaper(self, q_len: int, kv_len: int) -> bool:
        """Paper eq. 5: option 2 ((softmax·K)·W_KV) vs option 1 (softmax·(K·W_KV)), in multiply-adds."""
        h, e = self.num_heads, self.num_heads * self.head_dim
        option1 = kv_len * e * e + h * q_len * kv_len * self.head_dim
        option2 = h * q_len * kv_len * e + q_len * e * e
        return option2 < option1

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        layer_past: Cache | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cache = past_key_values if past_key_values is not None else layer_past
        batch, q_len, _ = hidden_states.shape
        h, dk = self.num_heads, self.head_dim
        rotary = self.__dict__["_rotary"]

        query = self.q_proj(hidden_states).view(batch, q_len, h, dk).transpose(1, 2)  # [b, h, q, dk]
        new_keys = self.k_proj(hidden_states)  # [b, q, e], before RoPE
        if position_ids is None:
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            position_ids = torch.arange(past, past + q_len, device=hidden_states.device)[None]

        if isinstance(cache, KeyOnlyCache):
            keys, key_positions = cache.update_keys(new_keys, self.layer_idx, position_ids)
        else:
            keys, key_positions = new_keys, position_ids.expand(batch, q_len)
        kv_len = keys.shape[1]
        key_heads = keys.view(batch, kv_len, h, dk).transpose(1, 2)  # [b, h, n, dk]

        if rotary is not None:
            cos, sin = position_embeddings if position_embeddings is not None else rotary(query, position_ids)
            query = apply_rotary(query, cos, sin)
            assert key_positions is not None
            if isinstance(cache, KeyOnlyCache):
                key_cos, key_sin = cache.rope_for_keys(rotary, keys, key_positions)
            else:
                key_cos, key_sin = rotary(keys, key_positions.long())
            key_heads = apply_rotary(key_heads, key_cos, key_sin)

        bias = additive_mask(attention_mask, q_len, kv_len, query.dtype, query.device)
        if self._decode_order_is_cheaper(q_len, kv_len):
            scores = (query @ key_heads.transpose(-1, -2)) * self.scaling  # [b, h, q, n]
            if bias is not None:
                scores = scores + bias
            probs = softmax_rows(scores, query.dtype)
            # option 2, softmax·K first; one bmm over all heads ([b, h·q, n] @ [b, n, e]) because a
            # broadcast matmul against keys[:, None] would copy K once per head.
            mixed_keys = torch.bmm(probs.reshape(batch, h * q_len, kv_len), keys).view(batch, h, q_len, h * dk)
            kv_per_head = self.kv_proj.weight.view(h, dk, h * dk)  # [h, dk, e]
            out = torch.einsum("bhqe,hde->bhqd", mixed_keys, kv_per_head)
        else:
            values = self.kv_proj(keys).view(batch, kv_len, h, dk).transpose(1, 2)  # option 1: V = K·W_KV
            out = nn.functional.scaled_dot_product_attention(
                query, key_heads, values, attn_mask=bias, scale=self.scaling
            )
        out = out.transpose(1, 2).reshape(batch, q_len, h * dk)
        return self.o_proj(out), None


def make_cache(spec: dict[str, Any]) -> KeyOnlyCache:
    return KeyOnlyCache(len(spec["attention_modules"]), track_positions=spec.get("rotary_module") is not None)
