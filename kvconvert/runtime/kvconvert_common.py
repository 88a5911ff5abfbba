"""Shared runtime pieces: the compressed cache, RoPE application, attention masks.

Copied verbatim into every kvconvert output directory; imports only torch and transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from .kvconvert_codec import QuantSpec, eager_on_cpu
from .kvconvert_kernels import HeadColumns, packed_decode_triton
from .kvconvert_products import cache_scores
from .kvconvert_rope import rotary_pairs
from .kvconvert_storage import (
    KVLayer,
    StaticStoreLayer,
    sliding_layer,
    static_sliding_layer,
    static_stock_layer,
    stock_layer,
)
from .kvconvert_tokenstore import TokenStore


class LatentLayer(KVLayer):
    """One layer's compressed state: keys ``[b, n, wk]`` and optional values ``[b, n, wv]``, each in a
    ``TokenStore`` (quantized when the checkpoint asks for it: keys per channel, values per token) as one KV head,
    ``[b, 1, n, w]``: what KIVI's codes reader takes (``kivi_decode``, ZACK's decode steps), views of it given out.

    What the widths hold is the method's business (slim: pre-RoPE K and no V; lorc: rank-d_c
    latents; zack: packed per-head columns). The keys also give the sequence length masks are built from.
    """

    def __init__(self, quant: QuantSpec | None = None, layer: int = 0):
        super().__init__()
        self.quant, self.layer = quant or QuantSpec(), layer
        self.key_store = TokenStore(self.quant.side(layer, keys=True), per_channel=True)  # scores: per channel
        self.value_store: TokenStore | None = None

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``[b, q, w]`` states; return every token's (this step's exact)."""
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        keys = self.key_store.extend(key_states[:, None])[:, 0]
        if value_states is None:
            return keys, None
        return keys, self._values().extend(value_states[:, None])[:, 0]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """``update`` for a step that read the stores itself (from their codes): nothing is read back."""
        self.key_store.append(key_states[:, None])
        self._values().append(value_states[:, None])

    def _values(self) -> TokenStore:
        if self.value_store is None:
            self.value_store = TokenStore(self.quant.side(self.layer, keys=False), per_channel=False)
        return self.value_store

    def _stores(self) -> list[TokenStore]:
        return [self.key_store] + ([] if self.value_store is None else [self.value_store])

    def get_seq_length(self) -> int:
        return len(self.key_store)

    def rows(self) -> int:
        return 0 if self.key_store.tail is None else self.key_store.tail.shape[0]

    def crop_to(self, length: int) -> None:
        for store in self._stores():
            store.crop(length)

    def apply(self, fn: Any) -> None:
        for store in self._stores():
            store.apply(fn)

    def reset(self) -> None:
        self.key_store = TokenStore(self.quant.side(self.layer, keys=True), per_channel=True)
        self.value_store = None
        self.keys = self.values = None
        self.is_initialized = False


class StaticLatentLayer(StaticStoreLayer):
    """``LatentLayer`` preallocated for ``max_cache_len`` tokens (``StaticStoreLayer``): keys ``[b, max_cache_len,
    wk]`` and optional values, quantized as ``LatentLayer``'s are where the checkpoint asks for it. Like
    ``LatentLayer``'s, the stores hold them as one KV head, ``[b, 1, ·, w]``, what KIVI's codes reader takes
    (``static_kivi_decode``: ZACK's decode steps)."""

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys, values = super().update(key_states[:, None], None if value_states is None else value_states[:, None])
        return keys[:, 0], None if values is None else values[:, 0]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """``update`` of one decode step that read the stores itself (from their codes): nothing is read back."""
        assert self.value_store is not None
        self._check_room(1)
        self.key_store.extend_only(key_states[:, None], self.filled)
        self.value_store.extend_only(value_states[:, None], self.filled)
        self._advance(1)


class CompressedCache(Cache):
    """Per layer a ``LatentLayer`` (compressed layers) or a stock ``DynamicLayer`` (layers a method
    leaves untouched), plus one ``[b, n]`` int32 position table shared by all layers when RoPE has
    to be applied at read time (left padding makes positions differ per row).
    """

    is_kvconvert_cache = True

    def __init__(self, layers: Sequence[Any], track_positions: bool):
        super().__init__(layers=list(layers))
        self.track_positions = track_positions
        self.static = any(isinstance(layer, StaticLatentLayer) for layer in layers)
        self.positions: torch.Tensor | None = None
        # cos/sin of all cached positions, computed by the first layer of a forward pass and
        # reused by the others; released when the forward pass ends (never kept between steps).
        self._rope_step: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pairs_step: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (the cos it is of, pairs)

    def update_latent(
        self,
        layer_idx: int,
        new_keys: torch.Tensor,
        new_values: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Append ``[b, q, w]`` states; return all keys, values and positions ``[b, n]``."""
        layer = self.layers[layer_idx]
        if isinstance(layer, StaticLatentLayer):
            return self._update_static(layer, new_keys, new_values, position_ids)
        assert isinstance(layer, LatentLayer)
        keys, values = layer.update(new_keys, new_values)
        if not self.track_positions:
            return keys, values, None
        if self.positions is None or self.positions.shape[1] < keys.shape[1]:
            # The first latent layer of a forward pass appends; later layers read the same table.
            assert position_ids is not None
            new_positions = position_ids.to(torch.int32).expand(new_keys.shape[0], new_keys.shape[1])
            self.positions = (
                new_positions if self.positions is None else torch.cat([self.positions, new_positions], dim=1)
            )
        return keys, values, self.positions[:, : keys.shape[1]]

    def _update_static(
        self, layer: StaticLatentLayer, new_keys: torch.Tensor, new_values: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """``update_latent`` on a static layer: every layer writes this step's positions into the one
        ``[b, max_cache_len]`` table at the same slots (the same values: cheaper than knowing which layer is first
        inside a compiled graph)."""
        slots = layer.slots(new_keys.shape[1]).to(new_keys.device)  # its counter moves there at its first update
        keys, values = layer.update(new_keys, new_values)
        # eagerly on a CPU attention takes the slots written so far, not the whole buffer (masks are cut to the keys'
        # length); compiled and GPU steps keep every slot (fixed shapes)
        held = int(layer.filled) if eager_on_cpu(keys.device) else None
        if held is not None:
            keys, values = keys[:, :held], None if values is None else values[:, :held]
        if not self.track_positions:
            return keys, values, None
        assert position_ids is not None
        if self.positions is None:
            self.positions = torch.zeros(keys.shape[0], layer.max_cache_len, dtype=torch.int32, device=keys.device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.positions)
        new_positions = position_ids.to(torch.int32).expand(new_keys.shape[0], new_keys.shape[1])
        self.positions.index_copy_(1, slots, new_positions)
        return keys, values, self.positions if held is None else self.positions[:, :held]

    def rope_for_keys(
        self, rotary: nn.Module, like: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[b, n, r]`` for the cached positions, shared by all layers of one step."""
        if self._rope_step is None or self._rope_step[0].shape[1] != positions.shape[1]:
            self._rope_step = rotary(like, positions.long())
        return self._rope_step

    def pairs_for_keys(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """``rotary_pairs`` of this step's ``rope_for_keys``, computed once for all layers."""
        if self._pairs_step is None or self._pairs_step[0] is not cos:
            self._pairs_step = (cos, rotary_pairs(cos, sin))
        return self._pairs_step[1]

    def end_step(self) -> None:
        self._rope_step = None
        self._pairs_step = None

    def reset(self) -> None:
        super().reset()
        if self.static and self.positions is not None:
            self.positions.zero_()  # in place: a compiled graph holds its address
        else:
            self.positions = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.positions is not None and tokens_to_remove and not self.static:
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


def latent_layers(spec: dict[str, Any], compressed: Sequence[bool], max_cache_len: int | None) -> list[Any]:
    """The cache layers of a latent-cache method (lorc, zack, slim): ``LatentLayer`` where ``compressed``, the
    stock layer elsewhere (a sliding-window layer's: transformers' windowed one, ``sliding_layer``); with
    ``max_cache_len`` (a static cache was asked for) ``StaticLatentLayer`` and the stock layers' static forms
    instead, unless ``static_refusal`` has a reason not to."""
    quant = QuantSpec.from_spec(spec)
    if max_cache_len is not None and static_refusal(spec, static_windows=True) is None:
        length = max_cache_len
        return [static_sliding_layer(spec, i, length)
                or (StaticLatentLayer(length, quant, i) if c else static_stock_layer(quant, i, length))
                for i, c in enumerate(compressed)]  # fmt: skip
    return [sliding_layer(spec, i) or (LatentLayer(quant, i) if c else stock_layer(quant, i))
            for i, c in enumerate(compressed)]  # fmt: skip


def static_refusal(spec: dict[str, Any], static_windows: bool = False) -> str | None:
    """Why a checkpoint has no static cache, or None (``static_windows``: the caller keeps sliding windows stock)."""
    quant = QuantSpec.from_spec(spec)
    if spec.get("method") == "razor" and quant.quantized:
        from .kvconvert_razor_kivi import window_static_refusal  # razor's runtime builds on this module

        why = window_static_refusal(quant, len(spec["razor"]["retrieval_kv_heads"]), int(spec["razor"]["window"]))
        if why:
            return f"razor's windows: {why}"
    if spec.get("minicache", {}).get("merge", "subspace") != "subspace":  # --merge subspace has one
        return "MiniCache's SLERP and average merges keep as many tokens exact as the data asks for"
    stock_windows = static_windows and not (quant.include_local and quant.quantized)
    if spec.get("local_layers") and not stock_windows:
        return "its sliding-window layers have no static layer here yet"
    return None


class LayerStateCache(Cache):
    """A cache whose method-specific layers hold the state and do the attention (razor, minicache)."""

    is_kvconvert_cache = True

    def __init__(self, layers: Sequence[CacheLayerMixin]):
        super().__init__(layers=list(layers))


def cache_layer_of(module: nn.Module) -> Any:
    """The kvconvert cache layer of ``module`` in the running forward call (None without a cache).

    Registered attention functions find it by duck typing, not isinstance: every checkpoint directory
    loaded with remote code brings its own copy of the runtime, and the last one imported owns the
    registered name, so the work must be done by the layer's own copy of the code."""
    cache = module.__dict__.get("_kvconvert_cache")
    if not getattr(cache, "is_kvconvert_cache", False):
        return None
    return cache.layers[getattr(module, "layer_idx")]  # type: ignore[union-attr]  # noqa: B009


class LatentAttention(nn.Module):
    """Base of kvconvert's attention modules: the model's rotary module by reference (it is owned,
    and moved between devices, by the model), and appending one step's compressed state to the cache."""

    scaling: float

    def __init__(self, layer_idx: int, rotary: nn.Module | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.__dict__["_rotary"] = rotary  # a plain reference, not a submodule

    @property
    def rotary(self) -> nn.Module | None:
        return self.__dict__["_rotary"]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        position_ids: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        layer_past: Cache | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The call every supported decoder layer makes: the cache named ``past_key_values`` up to transformers 5.23,
        ``cache`` from 5.24 on, ``layer_past`` by GPT-NeoX's layers in both."""
        cache = next((c for c in (cache, past_key_values, layer_past) if c is not None), None)
        return self.attend(hidden_states, cache, attention_mask, position_ids, position_embeddings), None

    def attend(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """``hidden_states [b, q, d]`` -> attention output ``[b, q, d]`` (after the output projection)."""
        raise NotImplementedError

    def head_columns(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(key offset, key width, value offset, value width) per query head, for ``decode_with_kernel``."""
        raise NotImplementedError

    def decode_with_kernel(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step in one ``packed_decode_triton`` launch: ``query [b, Σ_h wk_h]`` packed head after
        head, ``keys [b, n, ·]``, ``values [b, n, ·]``, ``bias [b|1, 1, 1, n]`` or None -> ``[b, Σ_h wv_h]``
        float32. The column table is built once per device."""
        columns = self.__dict__.get("_head_columns")
        if columns is None or columns.wk.device != keys.device:
            columns = HeadColumns.build(*self.head_columns(), device=keys.device)
            self.__dict__["_head_columns"] = columns
        batch, n = keys.shape[0], keys.shape[1]
        row_bias = None if bias is None else bias[:, 0, -1, :].expand(batch, n)
        return packed_decode_triton(query, keys, values, row_bias, columns, self.scaling)

    def append_step(
        self,
        cache: Cache | None,
        new_keys: torch.Tensor,
        new_values: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Store this step's ``[b, q, w]`` states; return (all keys, all values, this step's position ids,
        positions of all keys). Without a cache (``use_cache=False``) only this step's states exist."""
        batch, q_len = new_keys.shape[0], new_keys.shape[1]
        if position_ids is None:
            position_ids = default_position_ids(cache, self.layer_idx, q_len, new_keys.device)
        if isinstance(cache, CompressedCache):
            keys, values, key_positions = cache.update_latent(self.layer_idx, new_keys, new_values, position_ids)
            return keys, values, position_ids, key_positions
        return new_keys, new_values, position_ids, position_ids.expand(batch, q_len)


def rotary_for_keys(
    cache: Cache | None, rotary: nn.Module, like: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for cached keys: shared through the cache when there is one."""
    if isinstance(cache, CompressedCache):
        return cache.rope_for_keys(rotary, like, positions)
    return rotary(like, positions.long())


def pairs_for_keys(cache: Cache | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``rotary_pairs`` for cached keys: shared through the cache when there is one."""
    if isinstance(cache, CompressedCache):
        return cache.pairs_for_keys(cos, sin)
    return rotary_pairs(cos, sin)


def family_rotary(spec: dict[str, Any]) -> Any:
    """The source family's own ``apply_rotary_pos_emb(q, k, cos, sin)`` from transformers' modeling module of
    ``spec["base_model_type"]``, for a runtime whose attention applies RoPE itself to a model whose RoPE is not
    rotate-half (``spec["interleaved_rope"]``: GLM, Cohere, Helium, ERNIE 4.5 turn interleaved channel pairs, each
    with its own layout of cos/sin): the family's arithmetic exactly, where kvconvert's ``apply_rotary`` assumes
    rotate-half."""
    import importlib

    model_type = str(spec["base_model_type"])
    if not model_type.isidentifier():  # a module name, never a path: nothing but transformers' own code is imported
        raise ValueError(f"base_model_type {model_type!r} is not a transformers model type")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return module.apply_rotary_pos_emb


def default_position_ids(cache: Cache | None, layer_idx: int, q_len: int, device: torch.device) -> torch.Tensor:
    past = cache.get_seq_length(layer_idx) if cache is not None else 0  # a 0-d tensor for a static cache
    return (torch.arange(q_len, device=device) + past)[None]


def query_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``query [..., m, d] @ keys [..., n, d]ᵀ``. Compiled for a CPU, inductor lowers a batched product with one row
    (m = 1: a decode step of an MHA head) to multiply-and-sum, which fused with the keys' RoPE runs as a slow scalar
    loop; a zero second row keeps it a matrix product (whose extra row costs one more dot per key)."""
    if query.shape[-2] == 1 and query.device.type == "cpu" and torch.compiler.is_compiling():
        padded = torch.cat([query, torch.zeros_like(query)], dim=-2)
        return (padded @ keys.transpose(-1, -2))[..., :1, :]
    return cache_scores(query, keys, blocks=False)  # eagerly: widened where oneDNN has no half products


class HeadNorm(nn.Module):
    """The source's QK-norm, an RMSNorm before RoPE: over each head's ``head_dim`` channels of ``[..., heads·dk]``
    (Qwen3) or, with ``head_dim`` None, over all of them at once (OLMo 2); scaled by ``weight + offset`` (Gemma 3
    stores its weight less 1)."""

    def __init__(self, width: int, eps: float, head_dim: int | None, offset: float = 0.0):
        super().__init__()
        self.weight, self.eps, self.head_dim = nn.Parameter(torch.ones(width)), eps, head_dim
        self.offset = offset

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., heads·dk]`` normalised; ``weight`` in place of the module's own (the same norm over channels
        taken in another order)."""
        weight = self.weight if weight is None else weight
        if self.head_dim is None:
            return rms_norm(x, weight, self.eps, self.offset)
        return rms_norm(x.unflatten(-1, (-1, self.head_dim)), weight, self.eps, self.offset).flatten(-2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``HeadNorm``'s arithmetic over the last axis, as transformers' Qwen3RMSNorm computes it (with ``offset``:
    as Gemma3RMSNorm does, ``1 + weight`` in float32 before the cast)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (weight.float() + offset)).to(x.dtype)
    return weight * normed.to(x.dtype)


def qk_norms(spec: dict[str, Any], heads: int, kv_heads: int, head_dim: int) -> tuple[HeadNorm, HeadNorm] | None:
    """The query and key norms a layer applies before RoPE (``spec["qk_norm"]``: eps, per head or over all heads),
    their weights loaded with the checkpoint as ``q_norm`` / ``k_norm``; None for a model without them."""
    norm = spec.get("qk_norm")
    if norm is None:
        return None
    over = head_dim if norm["per_head"] else None  # the channels one norm spans: a head's, or all heads'
    offset = float(norm.get("offset", 0.0))
    return (HeadNorm(over or heads * head_dim, norm["eps"], over, offset),
            HeadNorm(over or kv_heads * head_dim, norm["eps"], over, offset))  # fmt: skip


def softmax_rows(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim in float32 (half-precision softmax loses mass), cast back."""
    return torch.softmax(scores.float(), dim=-1).to(dtype)
