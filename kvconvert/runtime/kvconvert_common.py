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
from .kvconvert_storage import KVLayer, StaticStoreLayer, static_stock_layer, stock_layer
from .kvconvert_tokenstore import TokenStore


class LatentLayer(KVLayer):
    """One layer's compressed state: keys ``[b, n, wk]`` and optional values ``[b, n, wv]``, each in a
    ``TokenStore`` (quantized when the checkpoint asks for it: keys per channel, values per token).

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
        keys = self.key_store.extend(key_states)
        if value_states is None:
            return keys, None
        if self.value_store is None:
            self.value_store = TokenStore(self.quant.side(self.layer, keys=False), per_channel=False)
        return keys, self.value_store.extend(value_states)

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
    wk]`` and optional values, quantized as ``LatentLayer``'s are where the checkpoint asks for it."""


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
    stock layer elsewhere; with ``max_cache_len`` (a static cache was asked for) ``StaticLatentLayer`` and the
    stock layer's static form (``static_stock_layer``) instead, unless ``static_refusal`` has a reason not to."""
    quant = QuantSpec.from_spec(spec)
    if max_cache_len is not None and static_refusal(spec) is None:
        return [StaticLatentLayer(max_cache_len, quant, i) if c else static_stock_layer(quant, i, max_cache_len)
                for i, c in enumerate(compressed)]  # fmt: skip
    return [LatentLayer(quant, i) if c else stock_layer(quant, i) for i, c in enumerate(compressed)]


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
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """The call every supported decoder layer makes (GPT-NeoX names the cache ``layer_past``)."""
        cache = past_key_values if past_key_values is not None else layer_past
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


def default_position_ids(cache: Cache | None, layer_idx: int, q_len: int, device: torch.device) -> torch.Tensor:
    past = cache.get_seq_length(layer_idx) if cache is not None else 0  # a 0-d tensor for a static cache
    return (torch.arange(q_len, device=device) + past)[None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_major: bool = False) -> torch.Tensor:
    """Rotate the first ``r = cos.shape[-1]`` dims of every head (partial rotary leaves the rest).

    Shapes: x ``[b, h, n, dk]``, cos/sin ``[b|1, n, r]`` with ``r <= dk``. Same result as
    transformers' ``x·cos + rotate_half(x)·sin``, written as one product and two in-place half-width
    multiply-adds: ``rotate_half`` (a roll, i.e. a concatenation) would copy x once more and, on a
    CPU, cost 8× the arithmetic (measured on 16×4096×64). Slim and LoRC re-rotate every cached key
    at each step, so this is their decode's hot loop.

    ``x`` a token-major cache viewed per head (``[b, n, h, dk]`` transposed): by default rotated in its own
    layout and returned as the same kind of view (what a kernel reading token rows wants); ``head_major``
    writes a contiguous ``[b, h, n, dk]`` instead, which a score product ``q @ kᵀ`` reads as it is: rotating
    into it costs what rotating in place does, and the product no longer copies the keys per head first
    (a LoRC decode step at 8 rows × 1K tokens: 1.2 ms a layer instead of 2.2 on 2 cores).
    """
    if x.dim() == 4 and not x.is_contiguous() and _rows_token_major(x):
        writable = not (torch.compiler.is_compiling() or x.requires_grad or cos.requires_grad or sin.requires_grad)
        if head_major and cos.shape[-1] == x.shape[-1] and writable:  # out= takes neither dynamo nor autograd
            out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
            return _rotate(x, cos.unsqueeze(1), sin.unsqueeze(1), out=out)
        # rotated in its own layout ([b, n, h, dk]), where the elementwise passes run contiguously (3× faster
        # on a CPU than writing through the strided view)
        return _rotate(x.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)
    return _rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))


def rotary_pairs(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """cos/sin ``[b, n, r]`` as ``r/2`` complex numbers ``cos θ + i·sin θ``, one per channel pair ``(j, j + r/2)``, so
    that RoPE is one complex product over keys laid out in pairs (``pair_order``; ``rotate_pairs``); None where
    that does not express it: the halves' angles differ (a RoPE variant), the dtype has no complex form (half
    precision), or under ``torch.compile`` (inductor has no complex arithmetic)."""
    half = cos.shape[-1] // 2
    if torch.compiler.is_compiling() or cos.dtype not in (torch.float32, torch.float64) or cos.requires_grad:
        return None
    if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
        return None
    return torch.complex(cos[..., :half].contiguous(), sin[..., :half].contiguous())


def pair_order(head_dim: int, rotated: int) -> torch.Tensor:
    """The channel order of one head that puts RoPE's pairs ``(j, j + rotated/2)`` side by side (then the
    channels RoPE leaves alone): a head's channels read in this order make ``rotate_pairs``' layout."""
    half = rotated // 2
    pairs = torch.stack([torch.arange(half), torch.arange(half, rotated)], dim=1).reshape(-1)
    return torch.cat([pairs, torch.arange(rotated, head_dim)])


def rotate_pairs(tokens: torch.Tensor, pairs: torch.Tensor, heads: int) -> torch.Tensor:
    """RoPE on keys whose channels are in ``pair_order``: ``tokens [b, n, heads·dk]`` times ``pairs [b|1, n, r/2]``
    (``rotary_pairs``), written head-major ``[b, heads, n, dk]`` for a score product. One complex product reads each
    key once, where ``apply_rotary`` runs three passes over it (a LoRC decode step at 4K tokens on a CPU: 0.17 ms
    a layer instead of 0.47)."""
    b, n, width = tokens.shape
    dk, r = width // heads, 2 * pairs.shape[-1]
    x = tokens.view(b, n, heads, dk)
    pairs_in = torch.view_as_complex(x[..., :r].unflatten(-1, (r // 2, 2))).transpose(1, 2)  # [b, heads, n, r/2]
    if tokens.requires_grad or pairs.requires_grad:  # out= takes no autograd
        turned = torch.view_as_real(pairs_in * pairs[:, None]).flatten(-2)
        return turned if r == dk else torch.cat([turned, x[..., r:].transpose(1, 2)], dim=-1)
    out = torch.empty(b, heads, n, dk, dtype=tokens.dtype, device=tokens.device)
    torch.mul(pairs_in, pairs[:, None], out=torch.view_as_complex(out[..., :r].unflatten(-1, (r // 2, 2))))
    if r < dk:
        out[..., r:] = x[..., r:].transpose(1, 2)
    return out


def to_pairs(x: torch.Tensor, heads: int, rotated: int) -> torch.Tensor:
    """``x [..., heads·dk]`` in the model's channel order -> each head's channels in ``pair_order(dk, rotated)``
    (a copy); ``from_pairs`` undoes it."""
    return _transposed_rotary(x, heads, (2, rotated // 2))


def from_pairs(x: torch.Tensor, heads: int, rotated: int) -> torch.Tensor:
    """``x [..., heads·dk]`` with each head's channels in ``pair_order(dk, rotated)`` -> the model's order."""
    return _transposed_rotary(x, heads, (rotated // 2, 2))


def _transposed_rotary(x: torch.Tensor, heads: int, grid: tuple[int, int]) -> torch.Tensor:
    """Each head's first ``grid[0]·grid[1]`` channels read as a ``grid`` matrix and written transposed, the rest
    as they are: ``(2, r/2)`` interleaves RoPE's two halves into pairs, ``(r/2, 2)`` splits them again."""
    *lead, width = x.shape
    per_head, rotated = x.reshape(*lead, heads, width // heads), grid[0] * grid[1]
    turned = per_head[..., :rotated].unflatten(-1, grid).transpose(-1, -2).flatten(-2)
    if rotated < per_head.shape[-1]:
        turned = torch.cat([turned, per_head[..., rotated:]], dim=-1)
    return turned.reshape(*lead, width)


def rotate_in_pairs(
    tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, pairs: torch.Tensor | None = None
) -> torch.Tensor:
    """RoPE on ``tokens [b, n, heads·dk]`` whose channels are in ``pair_order`` (cos/sin ``[b|1, n, r]`` as the
    model's rotary gives them), written head-major ``[b, heads, n, dk]``: ``rotate_pairs`` where ``pairs``
    (``rotary_pairs``) expresses it, else the same rotate-half arithmetic on the interleaved channels (half
    precision, ``torch.compile``, a RoPE variant whose halves' angles differ)."""
    if pairs is not None:
        return rotate_pairs(tokens, pairs, heads)
    b, n, width = tokens.shape
    x = tokens.view(b, n, heads, width // heads).transpose(1, 2)
    r = cos.shape[-1]
    half = r // 2
    low, high = x[..., 0:r:2], x[..., 1:r:2]
    cos_low, cos_high, sin_low, sin_high = (t.unsqueeze(1) for t in (cos[..., :half], cos[..., half:],
                                                                       sin[..., :half], sin[..., half:]))  # fmt: skip
    turned = torch.stack([low * cos_low - high * sin_low, high * cos_high + low * sin_high], dim=-1).flatten(-2)
    return turned if r == x.shape[-1] else torch.cat([turned, x[..., r:]], dim=-1)


def _rows_token_major(x: torch.Tensor) -> bool:
    """``x [b, h, n, dk]`` is a ``[b, n, h·dk]`` tensor viewed per head, each row contiguous: the rows may lie apart
    (a latent store's rows are the fronts of one buffer with room to grow: ``TokenStore._grown``)."""
    _, h, n, dk = x.shape
    return x.stride(3) == 1 and x.stride(1) == dk and (x.stride(2) == h * dk or n == 1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``apply_rotary`` with cos/sin already broadcastable to ``x[..., :r]``; ``out`` (full rotary only): where the
    result is written."""
    r = cos.shape[-1]
    half = r // 2
    rotated = x if r == x.shape[-1] else x[..., :r]
    out = rotated * cos if out is None else torch.mul(rotated, cos, out=out)
    out[..., :half].addcmul_(rotated[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(rotated[..., :half], sin[..., half:])
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


def additive_mask(
    mask: torch.Tensor | None, q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Normalise whatever mask transformers built into a finite additive bias ``[b|1, 1, q, kv]``.

    transformers passes a boolean mask (True = attend), an additive float mask, or None when
    plain causal masking suffices. A finite minimum instead of -inf keeps rows that are fully
    masked (left-padding positions) NaN-free, so their garbage never poisons cached keys.
    """
    minimum = torch.finfo(dtype).min
    if mask is None:
        if q_len == 1:
            return None
        query_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        allowed = torch.arange(kv_len, device=device)[None, :] <= query_pos
        return torch.where(allowed, 0.0, minimum).to(dtype)[None, None]
    mask = mask[..., -q_len:, :kv_len]
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, minimum).to(dtype)
    return mask.to(dtype).clamp(min=minimum)


def query_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``query [..., m, d] @ keys [..., n, d]ᵀ``. Compiled for a CPU, inductor lowers a batched product with one row
    (m = 1: a decode step of an MHA head) to multiply-and-sum, which fused with the keys' RoPE runs as a slow scalar
    loop; a zero second row keeps it a matrix product (whose extra row costs one more dot per key)."""
    if query.shape[-2] == 1 and query.device.type == "cpu" and torch.compiler.is_compiling():
        padded = torch.cat([query, torch.zeros_like(query)], dim=-2)
        return (padded @ keys.transpose(-1, -2))[..., :1, :]
    return query @ keys.transpose(-1, -2)


def softmax_rows(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim in float32 (half-precision softmax loses mass), cast back."""
    return torch.softmax(scores.float(), dim=-1).to(dtype)
