"""ZACK runtime (Zhang & Shen, "ZACK: Zero-Overhead LLM Inference Acceleration via Dimensionality
Compression of the Key-Value Cache").

Every KV head g has its own widths r_k,g and r_v,g; the cache packs the heads side by side, so a
token costs Σ_g (r_k,g + r_v,g) values per layer and nothing is padded. Keys and queries meet in
the rotated, truncated space (with RoPE the rotation ``qk_basis`` is applied after RoPE; without,
it is folded into q_proj/k_proj); values stay compressed and W_O, rotated offline, reads them.
Copied verbatim into every zack output directory; imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .kvconvert_common import (
    CompressedCache,
    LatentAttention,
    LatentLayer,
    StaticLatentLayer,
    default_position_ids,
    family_rotary,
    latent_layers,
    qk_norms,
    softmax_rows,
)
from .kvconvert_folded import kivi_decode_folded, value_rotation
from .kvconvert_kernels import use_kernels
from .kvconvert_prefill import additive_mask, prefill_attention
from .kvconvert_products import cache_mix, cache_scores
from .kvconvert_quant import kivi_decode, kivi_kernel_reads, static_kivi_decode, static_reads_codes
from .kvconvert_rope import apply_rotary
from .kvconvert_tokenstatic import SixCodes, static_codes
from .kvconvert_tokenstore import TokenStore, decode_columns

# A decode step from the codes reads each KV head's query rows against that head's columns alone (``kivi_decode_heads``)
# once this saves 10⁸ multiply-adds a layer over the packed product, which scores every query head against every
# column: there Llama-3.1-8B's shapes (8 KV heads) at 1 × 4K save 1.2·10⁸ and decode 1.21 → 1.26× the source, at
# 8 × 4K 0.62 → 0.89× (bfloat16); below it a reader's calls a head cost more than they save: SmolLM2 (3 KV heads) at
# 8 × 4K saves 3·10⁷ and went 0.83 → 0.68×, at 1 × 1K 0.82 → 0.68× (2 AMD EPYC cores, one process,
# ``bench/results/ab-zack4-heads-*-2026-12-07.md``); with each head's values read group by group, 1.05 → 1.06× at
# 8 × 4K, 0.84 → 0.69× at 8 × 1K (``ab-zack4-heads-apart-smollm2-again-2026-12-07.md``).
HEADS_APART_MIN = 10**8


class ZackAttention(LatentAttention):
    """Parameters (H query heads, Hkv KV heads, G = H / Hkv, dk head dim, d hidden):
    ``v_proj [Σ_g r_v,g, d]``, ``o_proj [d, Σ_h r_v,g(h)]``; with RoPE ``q_proj [H·dk, d]``,
    ``k_proj [Hkv·dk, d]``, ``qk_basis [dk, Σ_g r_k,g]`` (and the source's ``q_norm``/``k_norm`` where it has
    QK-norm, applied before RoPE as it applies them); without, ``q_proj [Σ_h r_k,g(h), d]``
    and ``k_proj [Σ_g r_k,g, d]``.
    """

    def __init__(self, spec: dict[str, Any], layer_idx: int, rotary: nn.Module | None):
        super().__init__(layer_idx, rotary)
        layer = spec["zack_layers"][layer_idx]
        self.heads, self.kv_heads, self.head_dim = (
            int(spec["num_heads"]),
            int(spec["num_kv_heads"]),
            int(spec["head_dim"]),
        )
        self.group = self.heads // self.kv_heads
        self.scaling = float(spec["scaling"][layer_idx])
        self.rank_k: list[int] = [int(r) for r in layer["rank_k"]]
        self.rank_v: list[int] = [int(r) for r in layer["rank_v"]]
        biases = set(layer["biases"])
        hidden = int(spec["hidden_size"])
        if rotary is not None:
            self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias="q_proj" in biases)
            self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias="k_proj" in biases)
            self.qk_basis = nn.Parameter(torch.empty(self.head_dim, sum(self.rank_k)), requires_grad=False)
        else:
            self.q_proj = nn.Linear(hidden, self.group * sum(self.rank_k), bias="q_proj" in biases)
            self.k_proj = nn.Linear(hidden, sum(self.rank_k), bias="k_proj" in biases)
        self.v_proj = nn.Linear(hidden, sum(self.rank_v), bias="v_proj" in biases)
        self.o_proj = nn.Linear(self.group * sum(self.rank_v), hidden, bias="o_proj" in biases)
        # RoPE on interleaved pairs: the family's own function (each lays out cos/sin its own way)
        self.family_rotary = family_rotary(spec) if rotary is not None and spec.get("interleaved_rope") else None
        norms = qk_norms(spec, self.heads, self.kv_heads, self.head_dim)  # QK-norm (RoPE models only)
        if norms is not None:
            self.q_norm, self.k_norm = norms

    def _rotated_queries_and_keys(
        self, query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:  # fmt: skip
        """The QK-norm (if any), RoPE, then each head's basis: queries per group ``[b, G, q, r_k,g]``, packed keys
        ``[b, q, Σ r_k]``."""
        batch, q_len, _ = query.shape
        if hasattr(self, "q_norm"):
            query, key = self.q_norm(query), self.k_norm(key)
        query = query.view(batch, q_len, self.heads, self.head_dim).transpose(1, 2)
        key = key.view(batch, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        rotary = self.rotary
        assert rotary is not None
        cos, sin = position_embeddings if position_embeddings is not None else rotary(query, position_ids)
        if self.family_rotary is not None:
            query, key = self.family_rotary(query, key, cos, sin)
        else:
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        bases = self.qk_basis.split(self.rank_k, dim=1)  # Hkv × [dk, r_k,g]
        queries = [query[:, g * self.group : (g + 1) * self.group] @ bases[g] for g in range(self.kv_heads)]
        keys = torch.cat([key[:, g] @ bases[g] for g in range(self.kv_heads)], dim=-1)
        return queries, keys

    def head_columns(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Query head h (group g = h // G) reads the key columns of KV head g and its r_v,g value columns."""
        groups = [h // self.group for h in range(self.heads)]
        return ([sum(self.rank_k[:g]) for g in groups], [self.rank_k[g] for g in groups],
                [sum(self.rank_v[:g]) for g in groups], [self.rank_v[g] for g in groups])  # fmt: skip

    def attend(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        query, key = self.q_proj(hidden_states), self.k_proj(hidden_states)
        if self.rotary is not None:
            if position_ids is None:
                position_ids = default_position_ids(cache, self.layer_idx, q_len, hidden_states.device)
            queries, new_keys = self._rotated_queries_and_keys(query, key, position_ids, position_embeddings)
        else:
            # packed [b, q, Σ_h r_k,g(h)]: the G heads of group g take G·r_k,g columns, head after head
            queries = [
                block.view(batch, q_len, self.group, -1).transpose(1, 2)
                for block in query.split([self.group * r for r in self.rank_k], dim=-1)
            ]
            new_keys = key
        new_values = self.v_proj(hidden_states)
        layer = codes_layer(cache, self.layer_idx, hidden_states, new_keys.shape[-1])
        if layer is not None and layer.value_store is not None:  # a CPU decode step: the codes
            key_1, value_1 = new_keys[:, None], new_values[:, None]
            if isinstance(layer, StaticLatentLayer):  # every slot, fixed shapes (compiled steps)
                stores = (layer.key_store, layer.value_store, layer.filled, layer.max_cache_len)
                if self._heads_apart(batch, layer.max_cache_len):
                    codes, bias_q, exact = static_codes(*stores[:2], key_1, value_1, attention_mask, *stores[2:])
                    mixed = heads_decode(queries, codes, bias_q, exact, *stores[:2], self.scaling, self.rank_k,
                                         self.rank_v)  # fmt: skip
                else:  # as one KV head
                    packed = static_kivi_decode(self._packed_queries(queries), key_1, value_1, attention_mask,
                                                self.scaling, *stores)  # fmt: skip
                    mixed = self._head_values(packed)
            else:
                bias = additive_mask(attention_mask, 1, len(layer.key_store) + 1, torch.float32, hidden_states.device)
                if self._heads_apart(batch, len(layer.key_store) + 1):
                    mixed = kivi_decode_heads(queries, key_1, value_1, bias, layer.key_store, layer.value_store,
                                              self.scaling, self.rank_k, self.rank_v)  # fmt: skip
                else:
                    packed = kivi_decode(self._packed_queries(queries), key_1, value_1, bias, layer.key_store,
                                         layer.value_store, self.scaling, kernel=False)  # fmt: skip
                    mixed = self._head_values(packed)
            layer.append(new_keys, new_values)
            return self.o_proj(mixed.to(hidden_states.dtype))
        keys, values, _, _ = self.append_step(cache, new_keys, new_values, position_ids)
        assert values is not None
        kv_len = keys.shape[1]
        if q_len <= 4:  # a decode step (or a few tokens)
            bias = additive_mask(attention_mask, q_len, kv_len, hidden_states.dtype, hidden_states.device)
            if q_len == 1 and use_kernels(hidden_states):
                packed_query = torch.cat([q.reshape(batch, -1) for q in queries], dim=-1)  # [b, Σ_h r_k,g(h)]
                out = self.decode_with_kernel(packed_query, keys, values, bias)
                return self.o_proj(out.to(hidden_states.dtype)[:, None])
            return self.o_proj(self._decode_packed(queries, keys, values, bias))
        outputs = []
        per_head = zip(keys.split(self.rank_k, dim=-1), values.split(self.rank_v, dim=-1), strict=True)
        for g, (key_g, value_g) in enumerate(per_head):  # a chunk: the fused kernel, group by group
            out = prefill_attention(queries[g], key_g[:, None], value_g[:, None], attention_mask, self.scaling)
            outputs.append(out.transpose(1, 2).reshape(batch, q_len, -1))  # [b, q, G·r_v,g]: W_O undoes the rotation
        return self.o_proj(torch.cat(outputs, dim=-1))

    def _heads_apart(self, rows: int, tokens: int) -> bool:
        """A decode step from the codes reads each KV head's columns apart (``kivi_decode_heads``, ``heads_decode``)
        where that saves ``HEADS_APART_MIN`` multiply-adds or more: below it a reader's calls for every KV head cost
        more than the packed product's extra arithmetic (compiled from a static cache, SmolLM2 at 1 × 4K: 1.01× the
        compiled source packed, 0.99× heads apart, ``ab-zack4-heads-compiled-2026-12-07.md``)."""
        saved = (self.heads - self.group) * rows * tokens * (sum(self.rank_k) + sum(self.rank_v))
        return saved >= HEADS_APART_MIN

    def _decode_packed(
        self, queries: list[torch.Tensor], keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention for a few query positions in two matmuls over the packed cache: each head's query
        is zero outside its group's key columns (``[b, H·q, Σ r_k]``), so one product scores every head
        and the cache is read once, contiguously; each head then keeps its group's value columns.
        Decoding is bound by reading the cache, so the Hkv-fold arithmetic is free; prefill loops
        over groups instead. ``queries`` per group ``[b, G, q, r_k,g]``, ``keys [b, n, Σ r_k]``,
        ``values [b, n, Σ r_v]``; returns ``[b, q, Σ_h r_v,g(h)]``, o_proj's input."""
        batch, _, q_len, _ = queries[0].shape
        kv_len = keys.shape[1]
        packed = self._packed_queries(queries).view(batch, self.heads * q_len, -1)
        scores = cache_scores(packed, keys) * self.scaling
        if bias is not None:
            scores = (scores.view(batch, self.heads, q_len, kv_len) + bias).view(batch, -1, kv_len)
        mixed = cache_mix(softmax_rows(scores, values.dtype), values).view(batch, self.heads, q_len, -1)
        return self._head_values(mixed)

    def _packed_queries(self, queries: list[torch.Tensor]) -> torch.Tensor:
        """Queries per group ``[b, G, q, r_k,g]`` as ``[b, H, q, Σ r_k]``, each head zero outside its group's key
        columns: one product with the packed keys scores every head."""
        batch, _, q_len, _ = queries[0].shape
        packed = queries[0].new_zeros(batch, self.heads, q_len, sum(self.rank_k))
        k_off = 0
        for g, query_g in enumerate(queries):
            packed[:, g * self.group : (g + 1) * self.group, :, k_off : k_off + self.rank_k[g]] = query_g
            k_off += self.rank_k[g]
        return packed

    def _head_values(self, mixed: torch.Tensor) -> torch.Tensor:
        """Every head's weighted sum over the packed values ``[b, H, q, Σ r_v]`` down to its group's value columns,
        o_proj's input ``[b, q, Σ_h r_v,g(h)]`` (still rotated: W_O undoes it)."""
        batch, _, q_len, _ = mixed.shape
        outputs, v_off = [], 0
        for g in range(self.kv_heads):  # [b, G, q, r_v,g] per group
            out = mixed[:, g * self.group : (g + 1) * self.group, :, v_off : v_off + self.rank_v[g]]
            outputs.append(out.transpose(1, 2).reshape(batch, q_len, -1))
            v_off += self.rank_v[g]
        return torch.cat(outputs, dim=-1)


def kivi_decode_heads(
    queries: list[torch.Tensor], key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None, keys: TokenStore,
    values: TokenStore, scaling: float, rank_k: list[int], rank_v: list[int],
) -> torch.Tensor:  # fmt: skip
    """``heads_decode`` over growing stores: this step's packed ``key/value [b, 1, 1, Σ r]``, ``bias [b|1, 1, 1, n]``
    or None over the tokens held."""
    kb, vb = keys.blocks, values.blocks
    assert kb is not None and vb is not None
    bias_q, exact_k, exact_v, exact_bias = decode_columns(bias, keys, values, key, value)
    codes = (kb.codes, kb.scale, kb.zero, vb.codes, vb.scale, vb.zero)
    return heads_decode(queries, codes, bias_q, (exact_k, exact_v, exact_bias), keys, values, scaling, rank_k, rank_v)


def heads_decode(
    queries: list[torch.Tensor], codes: SixCodes, bias_q: torch.Tensor | None,
    exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], keys: Any, values: Any, scaling: float,
    rank_k: list[int], rank_v: list[int],
) -> torch.Tensor:  # fmt: skip
    """A decode step from the codes of ZACK's packed latents (``kivi_decode_folded``: ``codes`` keys' codes, scales,
    zeros, then values', ``bias_q`` theirs, ``exact`` the exact tokens, of ``keys``/``values``, ``TokenStore``s or
    ``StaticTokenStore``s), each KV head's query rows (``queries`` per group ``[b, G, 1, r_k,g]``) against its own
    columns only. The packed product (``_decode_packed``, ``kivi_decode``) scores every query head against every
    column, Hkv times the arithmetic, which reading 4-bit codes makes the step's cost: ZACK 0.5 + 4-bit on
    Llama-3.1-8B's shapes at 8 × 4K decoded at 0.64× the source (zack 0.5 alone 1.17×).
    Returns o_proj's input ``[b, 1, Σ_h r_v,g(h)]`` float32."""
    kc, ks, kz, vc, vs, vz = codes
    exact_k, exact_v, exact_bias = exact
    width = exact_v.shape[-1]
    rotated = value_rotation(values, width, kc.device)
    outputs, k_at, v_at = [], 0, 0
    for query, r_k, r_v in zip(queries, rank_k, rank_v, strict=True):
        k_cols, v_cols = slice(k_at, k_at + r_k), slice(v_at, v_at + r_v)
        acc, ml = kivi_decode_folded(query.transpose(1, 2).float(), kc[:, :, :, k_cols], ks[..., k_cols],
                                     kz[..., k_cols], vc, vs, vz, bias_q, scaling, keys.quant.bits, values.quant.bits,
                                     value_rotation=rotated, value_width=width,
                                     exact=(exact_k[..., k_cols], exact_v[..., v_cols], exact_bias),
                                     value_span=(v_at, v_at + r_v))  # fmt: skip
        outputs.append((acc / ml[..., 1:]).flatten(1))  # [b, G · r_v,g]: head after head, as o_proj reads them
        k_at, v_at = k_at + r_k, v_at + r_v
    return torch.cat(outputs, dim=-1)[:, None]


def codes_layer(
    cache: Cache | None, layer_idx: int, states: torch.Tensor, width: int
) -> LatentLayer | StaticLatentLayer | None:
    """The layer whose quantized latents this decode step reads from their codes (``kivi_decode`` in torch, or
    ``static_kivi_decode`` from a static cache: KIVI's widths and blocks, ``kivi_kernel_reads`` /
    ``static_reads_codes``), on a CPU with no kernels asked for; None elsewhere (16-bit latents, no quantized block
    yet, a prefill chunk, a GPU: the latents read back dequantized). ``width``: the packed keys'."""
    if not isinstance(cache, CompressedCache) or states.shape[1] != 1 or states.device.type != "cpu":
        return None
    layer = cache.layers[layer_idx]
    if use_kernels(states):
        return None
    if isinstance(layer, StaticLatentLayer) and layer.value_store is not None:
        return layer if static_reads_codes(layer.key_store, layer.value_store, width) else None
    if not isinstance(layer, LatentLayer) or layer.value_store is None:
        return None
    return layer if kivi_kernel_reads(layer.key_store, layer.value_store, width, kernel=False) else None


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: nn.Module | None) -> ZackAttention | None:
    """None for a sliding-window layer: it keeps the stock attention (and transformers' windowed cache)."""
    return None if layer_idx in (spec.get("local_layers") or ()) else ZackAttention(spec, layer_idx, rotary)


def make_cache(spec: dict[str, Any], max_cache_len: int | None = None) -> CompressedCache:
    # keys are cached after RoPE and rotation: no positions to remember
    local = set(spec.get("local_layers") or ())
    compressed = [layer not in local for layer in range(len(spec["zack_layers"]))]
    return CompressedCache(latent_layers(spec, compressed, max_cache_len), track_positions=False)
