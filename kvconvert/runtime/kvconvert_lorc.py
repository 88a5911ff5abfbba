"""LoRC runtime (Zhang et al., "LoRC: Low-Rank Compression for LLMs KV Cache").

The cache holds per layer the rank-r latents ``c_k = x·W_down,Kᵀ`` and ``c_v = x·W_down,Vᵀ``.
Values are never rebuilt: U_V is folded into the output projection, so each query head's
attention-weighted latent goes straight into ``o_proj``. Keys: without RoPE, U_K is folded into
the query projection and scores are taken against the latent directly; with RoPE, per-head keys
are rebuilt from the latent (``k_up``) and rotated at read time (positions come from the cache).
A joint layer (kvconvert's extension, MLA-style) caches one latent ``c = x·W_downᵀ`` that serves as both:
keys are rebuilt from it (or scored against it) and every head's weighted latent goes into ``o_proj``.
Layers the conversion left uncompressed keep transformers' own attention and a stock cache layer.
A DeepSeek-V3 export (``lorc --latent mla``) keeps transformers' DeepSeek-V3 modules and cache; only its decode
steps run here, in the latent space (``absorbed_mla_forward``).
Copied verbatim into every lorc output directory; imports only torch and transformers.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .kvconvert_common import (
    CompressedCache,
    LatentAttention,
    latent_layers,
    pairs_for_keys,
    qk_norms,
    rotary_for_keys,
    softmax_rows,
)
from .kvconvert_compiled import compiled_call
from .kvconvert_folded import fuses
from .kvconvert_kernels import use_kernels
from .kvconvert_prefill import additive_mask, prefill_attention
from .kvconvert_products import cache_mix, cache_scores, rebuild, widened, widened_bmm
from .kvconvert_rope import (
    KEY_PIECE_BYTES,
    apply_rotary,
    pair_order,
    rotate_pairs,
    scores_by_piece,
    turned_scores,
    turns_on_query_side,
)


class LorcAttention(LatentAttention):
    """Attention over a low-rank K/V cache (GQA-aware: query head i uses KV group i // G).

    Parameters, by what was factored (r_k, r_v ranks; H, Hkv heads; dk head dim; d hidden):
    K factored: ``k_down [r_k, d]``, and with RoPE ``k_up [Hkv·dk, r_k]`` + ``q_proj [H·dk, d]``,
    without RoPE ``q_proj [H·r_k, d]`` (U_K absorbed); K kept: ``k_proj``, ``q_proj`` as usual.
    V factored: ``v_down [r_v, d]``, ``o_proj [d, H·r_v]``; V kept: ``v_proj``, ``o_proj [d, H·dk]``.
    Joint (``r_k == r_v``): ``kv_down [r, d]`` in place of ``k_down`` and ``v_down``; the cache holds keys only.
    QK-norm (``spec["qk_norm"]``, RoPE models only): ``q_norm``/``k_norm`` applied to the projected queries and
    the rebuilt keys before RoPE, per head or over all heads, as the source applies them to its own.
    """

    def __init__(self, spec: dict[str, Any], layer_idx: int, rotary: nn.Module | None):
        super().__init__(layer_idx, rotary)
        layer = spec["lorc_layers"][layer_idx]
        self.heads, self.kv_heads, self.head_dim = (
            int(spec["num_heads"]),
            int(spec["num_kv_heads"]),
            int(spec["head_dim"]),
        )
        self.scaling = float(spec["scaling"][layer_idx])
        self.rank_k, self.rank_v = layer["rank_k"], layer["rank_v"]
        self.joint = bool(layer.get("joint", False))
        biases = set(layer["biases"])
        hidden, kv_width = int(spec["hidden_size"]), self.kv_heads * self.head_dim
        self.absorbed_keys = self.rank_k is not None and rotary is None
        q_width = self.heads * (self.rank_k if self.absorbed_keys else self.head_dim)
        self.q_proj = nn.Linear(hidden, q_width, bias="q_proj" in biases)
        if self.rank_k is None:
            self.k_proj = nn.Linear(hidden, kv_width, bias="k_proj" in biases)
        else:
            if self.joint:
                self.kv_down = nn.Linear(hidden, self.rank_k, bias=False)
            else:
                self.k_down = nn.Linear(hidden, self.rank_k, bias=False)
            if rotary is not None:
                self.k_up = nn.Linear(self.rank_k, kv_width, bias="k_up" in biases)
        if self.rank_v is None:
            self.v_proj = nn.Linear(hidden, kv_width, bias="v_proj" in biases)
        elif not self.joint:
            self.v_down = nn.Linear(hidden, self.rank_v, bias=False)
        self.o_proj = nn.Linear(self.heads * (self.rank_v or self.head_dim), hidden, bias="o_proj" in biases)
        norms = qk_norms(spec, self.heads, self.kv_heads, self.head_dim)
        if norms is not None:
            self.q_norm, self.k_norm = norms
        # k_up's rows (and the key norm's weight) in ``pair_order``, with what they were taken from (``_in_pairs``)
        self._pair_weights: tuple[Any, ...] | None = None

    def _normed(self, x: torch.Tensor, norm_name: str, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, n, heads·dk]`` through the QK-norm ``norm_name`` if the model has one (with ``weight`` in place of
        its own: the same norm over channels taken in another order)."""
        norm = getattr(self, norm_name, None)
        return x if norm is None else norm(x, weight)

    def _pair_rows(self, rotated: int) -> tuple[Any, ...]:
        """k_up's rows, its bias and the key norm's weight in ``pair_order`` (``rotated`` channels in pairs), and that
        order (the queries must take it too): taken once, and again only when k_up's weight changes."""
        weight = self.k_up.weight
        stamp = (weight.data_ptr(), weight._version, weight.dtype, rotated)
        if self._pair_weights is None or self._pair_weights[0] != stamp:
            order = pair_order(self.head_dim, rotated).to(weight.device)
            rows = (torch.arange(self.kv_heads, device=weight.device)[:, None] * self.head_dim + order).reshape(-1)
            bias = None if self.k_up.bias is None else self.k_up.bias[rows]
            norm = getattr(self, "k_norm", None)
            norm_weight = None if norm is None else norm.weight[rows if norm.head_dim is None else order]
            self._pair_weights = (stamp, weight[rows], bias, norm_weight, order)
        return self._pair_weights[1:]

    def _in_pairs(self, latent: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys rebuilt from ``latent [b, n, r_k]`` with each head's channels in ``pair_order``, normed and rotated
        as pairs (``rotate_pairs``): ``[b, Hkv, n, dk]``, and that order (``_pair_rows``)."""
        rows_weight, bias, norm_weight, order = self._pair_rows(2 * pairs.shape[-1])
        keys = self._normed(rebuild(latent, rows_weight, bias), "k_norm", norm_weight)
        return rotate_pairs(keys, pairs, self.kv_heads), order

    def _full_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The cached keys ``[b, n, ·]`` as full-width keys in the model's channel order, through the key norm where
        the model has one (before RoPE): rebuilt from the latent (``rebuild``: in bfloat16 where a CPU multiplies it
        faster), or as cached where K was kept."""
        full = keys if self.rank_k is None else rebuild(keys, self.k_up.weight, self.k_up.bias)
        return self._normed(full, "k_norm")

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, n, Hkv·dk]`` -> ``[b, Hkv, n, dk]``."""
        b, n, _ = x.shape
        return x.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)

    def head_columns(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """A latent is shared by all heads (offset 0); full-width keys or values are read per KV group."""
        groups = [h // (self.heads // self.kv_heads) for h in range(self.heads)]
        dk = self.head_dim
        k_off = [0 if self.absorbed_keys else g * dk for g in groups]
        v_off = [0 if self.rank_v else g * dk for g in groups]
        return k_off, [self.rank_k if self.absorbed_keys else dk] * self.heads, v_off, [self.rank_v or dk] * self.heads

    def attend(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        h, hkv = self.heads, self.kv_heads
        group = h // hkv
        rotary = self.rotary
        if self.joint:  # one latent, stored once, read as both
            new_keys, new_values = self.kv_down(hidden_states), None
        else:
            new_keys = self.k_proj(hidden_states) if self.rank_k is None else self.k_down(hidden_states)  # pre-RoPE
            new_values = self.v_proj(hidden_states) if self.rank_v is None else self.v_down(hidden_states)
        keys, values, position_ids, key_positions = self.append_step(cache, new_keys, new_values, position_ids)
        values = keys if self.joint else values
        assert values is not None
        kv_len = keys.shape[1]

        query = self._normed(self.q_proj(hidden_states), "q_norm")
        query = query.view(batch, q_len, h, -1).transpose(1, 2)  # [b, h, q, dk or r_k]
        kernel = q_len == 1 and use_kernels(hidden_states)
        scores: torch.Tensor | None = None
        if not self.absorbed_keys and rotary is not None:
            cos, sin = position_embeddings if position_embeddings is not None else rotary(query, position_ids)
            query = apply_rotary(query, cos, sin)
            assert key_positions is not None
            key_cos, key_sin = rotary_for_keys(cache, rotary, keys, key_positions)
            pairs = None if self.rank_k is None else pairs_for_keys(cache, key_cos, key_sin)
            rebuilt_bytes = 4 * batch * kv_len * hkv * self.head_dim
            whole = pairs is None or rebuilt_bytes <= 2 * KEY_PIECE_BYTES
            if q_len == 1 and not kernel and fuses(keys) and whole:
                # eagerly on a CPU, keys that are one or two pieces: rebuilt whole, then scored with RoPE on the query
                # side in one compiled pass (only the length symbolic: tighter loops). Measured against the pieces,
                # one process: 1 × 4K 0.71 → 0.81× the source, 8 × 1K 0.85 either way; 8 × 4K (25 MB) 0.80 → 0.76,
                # so larger caches keep the pieces, scored while still in the CPU's caches. Without pairs (half
                # precision, keys not compressed, a RoPE whose halves' angles differ) there are no pieces: the other
                # way turns every rebuilt key and writes it back first, at any size
                full_keys = self._full_keys(keys)
                scores = compiled_call("turned_scores_rebuilt", turned_scores, query, full_keys, key_cos, key_sin,
                                       False, dynamic=None)  # fmt: skip
            if scores is not None:
                scores = scores.view(batch, h, 1, kv_len)
            elif pairs is not None and q_len == 1 and not kernel:  # rebuilt, turned and scored a piece at a time
                order = self._pair_rows(2 * pairs.shape[-1])[-1]  # the keys' channel order
                grouped_query = query[..., order].reshape(batch, hkv, group, self.head_dim)
                scores = scores_by_piece(grouped_query, kv_len, hkv * self.head_dim,
                                         lambda at, to: self._in_pairs(keys[:, at:to], pairs[:, at:to])[0])  # fmt: skip
                scores = scores.view(batch, h, 1, kv_len)
            elif pairs is not None:  # the rebuild's output laid out for one complex product
                key_heads, order = self._in_pairs(keys, pairs)
                query = query[..., order]  # the keys' channel order: every score stays the same sum
            elif not kernel and turns_on_query_side(keys, q_len):  # compiled: RoPE on the query side, fused
                full_keys = self._full_keys(keys)
                scores = turned_scores(query, full_keys, key_cos, key_sin, paired=False)
            else:
                full_keys = self._full_keys(keys)
                key_heads = apply_rotary(self._grouped(full_keys), key_cos, key_sin, head_major=not kernel)
        elif not self.absorbed_keys:
            key_heads = self._grouped(self._full_keys(keys))
        if kernel:
            key_tokens = keys if self.absorbed_keys else key_heads.transpose(1, 2).reshape(batch, kv_len, -1)
            bias = additive_mask(attention_mask, 1, kv_len, torch.float32, keys.device)
            out = self.decode_with_kernel(query.reshape(batch, -1), key_tokens, values, bias)
            return self.o_proj(out.to(hidden_states.dtype)[:, None])
        if q_len > 1:  # a chunk: the fused kernel (keys per KV head or the shared latent, values likewise)
            k = keys[:, None] if self.absorbed_keys else key_heads
            v = self._grouped(values) if self.rank_v is None else values[:, None]
            out = prefill_attention(query, k, v, attention_mask, self.scaling)
            return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))
        if scores is None and self.absorbed_keys:
            # scores against the shared latent: [b, h·q, r_k] @ [b, r_k, n]
            scores = cache_scores(query.reshape(batch, h * q_len, -1), keys, blocks=False).view(batch, h, q_len, -1)
        elif scores is None:
            grouped_query = query.reshape(batch, hkv, group * q_len, self.head_dim)  # heads of a group are adjacent
            scores = cache_scores(grouped_query, key_heads, blocks=False).view(batch, h, q_len, kv_len)

        scores = scores * self.scaling
        bias = additive_mask(attention_mask, q_len, kv_len, scores.dtype, scores.device)
        if bias is not None:
            scores = scores + bias
        probs = softmax_rows(scores, hidden_states.dtype)  # [b, h, q, n]

        if self.rank_v is None:
            grouped = cache_mix(probs.reshape(batch, hkv, group * q_len, kv_len), self._grouped(values), blocks=False)
            out = grouped.view(batch, h, q_len, self.head_dim)
        else:
            # each head's weighted latent; U_V lives in o_proj
            out = cache_mix(probs.reshape(batch, h * q_len, kv_len), values, blocks=False).view(batch, h, q_len, -1)
        out = out.transpose(1, 2).reshape(batch, q_len, -1)
        return self.o_proj(out)


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: nn.Module | None) -> LorcAttention | None:
    """None for layers left uncompressed: they keep the stock transformers attention."""
    return None if spec["lorc_layers"][layer_idx] is None else LorcAttention(spec, layer_idx, rotary)


# query lengths up to this attend in the latent space; longer ones (prefill) expand keys and values as transformers does
ABSORB_MAX_QUERY = 16


def _absorbed_weights(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_UK [H, nope, r]`` and ``W_UV [H, v, r]``: views of ``kv_b_proj``'s weight, no copy of it kept."""
    heads, nope, rank = module.num_heads, module.qk_nope_head_dim, module.kv_lora_rank
    w_uk, w_uv = module.kv_b_proj.weight.view(heads, -1, rank).split([nope, module.v_head_dim], dim=1)
    return w_uk, w_uv


def latent_attention(query: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                     attention_mask: Any, scaling: float) -> torch.Tensor:  # fmt: skip
    """Every query head over the one shared latent: ``query [b, H, q, r]`` (``q_nope·W_UK``) and ``q_rot [b, H, q,
    rope]`` against the cached ``latent [b, 1, n, r]`` and ``k_rot [b, 1, n, rope]``; returns ``Σ p·c`` ``[b, q, H,
    r]``. Batched products straight over the cache tensors (their transposes are views): through transformers'
    attention functions the latent and the RoPE key were joined into one key tensor every step and, the value width
    differing, SDPA took its unfused path, which copied and scaled the whole key again (Llama-3-8B-shaped layers, 8
    rows × 1K, bfloat16, ``torch.profiler`` on 2 Intel Xeon cores: 13.6 ms a layer for those passes, 4.0 for these
    products). ``attention_mask``: transformers' boolean (True: attend) or additive ``[b, 1, q, n]``, or None.
    Softmax in float32; the products in float32 where oneDNN has none in the cache's half dtype (``widened``).
    Returns the latent's dtype."""
    dtype = latent.dtype
    if widened(latent):
        query, q_rot, latent, k_rot = (t.float() for t in (query, q_rot, latent, k_rot))
    batch, heads, q_len, rank = query.shape
    n, lat, rot = latent.shape[-2], latent[:, 0], k_rot[:, 0]
    rows = heads * q_len
    scores = torch.bmm(query.reshape(batch, rows, rank), lat.transpose(1, 2))
    scores = scores.baddbmm_(q_rot.reshape(batch, rows, -1), rot.transpose(1, 2)).float().mul_(scaling)
    scores = scores.view(batch, heads, q_len, n)
    if attention_mask is not None:
        mask = attention_mask[..., :n]  # a static cache's mask covers its whole length, as SDPA's slice says
        if mask.dtype == torch.bool:  # a row with nothing to attend (padding) weighs all alike instead of NaN
            scores = scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
        else:
            scores = scores.add_(mask.float())
    probs = torch.softmax(scores, dim=-1).to(lat.dtype)
    return torch.bmm(probs.view(batch, rows, n), lat).view(batch, heads, q_len, rank).transpose(1, 2).to(dtype)


def absorbed_mla_forward(
    self: Any, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: Any, past_key_values: Cache | None = None, cache: Cache | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """transformers' ``DeepseekV3Attention.forward``, the same cache and mask. A few query tokens attend without
    expanding the cache: scores are ``(q_nope·W_UK)·c + q_rope·k_rope`` and each head's output ``(Σ p·c)·W_UVᵀ``
    (MLA's weight absorption), so a decode step reads ``kv_lora_rank + qk_rope_head_dim`` values per cached token
    instead of rebuilding every head's keys and values from them (``latent_attention``). Longer chunks (prefill)
    expand them as the stock module does, the values zero-padded to the keys' width: with widths that differ SDPA
    takes its unfused path, which holds a float32 score for every query and key (8 rows × a 2048-token chunk over
    4K tokens, 32 heads: 8.6 GB) and on a CPU ran 11× slower (one row, 1K queries over 2K keys: 517 ms against 46)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as stock

    batch, q_len = hidden_states.shape[:-1]
    past_key_values = cache if cache is not None else past_key_values  # transformers' name for it from 5.24 on
    if self.q_proj is None:  # a query LoRA (not what kvconvert writes): the stock module
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    heads, nope, rope, rank = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    q_pass, q_rot = self.q_proj(hidden_states).view(batch, q_len, heads, -1).transpose(1, 2).split([nope, rope], -1)
    latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([rank, rope], dim=-1)
    latent = self.kv_a_layernorm(latent).view(batch, 1, q_len, rank)
    k_rot = k_rot.view(batch, 1, q_len, rope)
    cos, sin = position_embeddings
    rotate = stock.apply_rotary_pos_emb_interleave if self.config.rope_interleave else stock.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    if past_key_values is not None:
        latent, k_rot = past_key_values.update(latent, k_rot, self.layer_idx)
    if q_len > ABSORB_MAX_QUERY:
        keys, values = self.expand_kv(latent, k_rot)
        width = nope + rope
        padded = nn.functional.pad(values, (0, width - self.v_head_dim)) if width > self.v_head_dim else values
        implementation = self.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, stock.eager_attention_forward)
        out, weights = attention(self, torch.cat((q_pass, q_rot), dim=-1), keys, padded, attention_mask, dropout=0.0,
                                 scaling=self.scaling, **kwargs)  # fmt: skip
        return self.o_proj(out[..., : self.v_head_dim].reshape(batch, q_len, -1)), weights
    w_uk, w_uv = _absorbed_weights(self)
    # per head [b·q, nope] @ [nope, r], the heads as the batch; the outputs as W_UV @ (Σ p·c)ᵀ, whose operands are
    # the weight's rows as they lie: a product against W_UVᵀ had torch copy the transposed weight first (1.2 ms
    # against 0.5 for 32 heads × 128 × 960 in bfloat16, 2 Intel Xeon cores)
    query = widened_bmm(q_pass.transpose(0, 1).reshape(heads, batch * q_len, nope), w_uk)
    query = query.view(heads, batch, q_len, rank).transpose(0, 1)
    out = latent_attention(query, q_rot, latent, k_rot, attention_mask, self.scaling)  # [b, q, H, r]
    out = widened_bmm(w_uv, out.permute(2, 3, 0, 1).reshape(heads, rank, batch * q_len))  # [H, v, b·q]
    # contiguous: the permuted heads merge into a view of the transposed [H·v, b·q], which the o_proj product takes
    # through a slower path (bfloat16 [8, 4096] @ [4096, 4096]: 1.21 against 1.05 ms; with oneDNN capped at AVX2
    # 63 against 6.1 ms; AMD EPYC)
    out = out.view(heads, -1, batch, q_len).permute(2, 3, 0, 1).contiguous().view(batch, q_len, -1)
    return self.o_proj(out), None


def configure(model: Any) -> None:
    """A DeepSeek-V3 export (``lorc_mla``): every attention module decodes in the latent space."""
    spec = model.config.kvconvert
    if "lorc_mla" in spec:
        for path in spec["attention_modules"]:
            module = model.get_submodule(path)
            module.forward = types.MethodType(absorbed_mla_forward, module)


def make_cache(spec: dict[str, Any], max_cache_len: int | None = None) -> CompressedCache:
    """Latents for the factored layers, stock layers for the rest; static when ``max_cache_len`` is given."""
    layers = latent_layers(spec, [layer is not None for layer in spec["lorc_layers"]], max_cache_len)
    return CompressedCache(layers, track_positions=spec.get("rotary_module") is not None)
