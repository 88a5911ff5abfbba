"""MiniCache runtime (Liu et al., "MiniCache: KV cache compression in depth dimension for LLMs").

From the start layer S on, layers are paired (S, S+1), (S+2, S+3), … and each pair stores ONE
direction tensor for its keys (and one for its values) instead of two full tensors (§4):

- merge (eq. 3): per token, the two layers' states x^{l-1}, x^l (all KV heads of the layer as one
  vector, the paper's "vectorized cache state of a single token") are split into norm and unit
  direction; the directions are interpolated by SLERP with parameter t (t → 1 leans to layer l);
- retention (eq. 4): tokens whose pair is too far apart to share a direction keep both layers'
  exact states, by index; the rest are merged;
- restore (fig. 3b): direction × each layer's own norm, then the retained tokens put back.

Stored per pair and per token: one direction vector, two float32 norms, and for retained tokens
both exact vectors plus (row, position) as int32, for K and V separately. Prefill merges whole
sequences; in decode the new token of the first layer waits until the second layer has computed
its own, then the pair is merged (appendix D, algorithm 1). Within one forward call every layer
attends to its own exact new states; only the past is merged.

Weights and attention modules stay stock: a registered attention function reads the cache.
Copied verbatim into every minicache output directory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kvconvert_common import LayerStateCache, additive_mask, cache_layer_of
from .kvconvert_storage import KVLayer, QuantSpec, TokenStore, select_rows_fn, stock_layer

IMPLEMENTATION = "kvconvert_minicache"
# Below this sin Ω, SLERP's weights sin((1-t)Ω)/sin Ω and sin(tΩ)/sin Ω are replaced by their
# limits 1-t and t (float32 arccos of a cosine within 1e-7 of 1 is already noise).
_PARALLEL = 1e-6


def slerp(e_first: torch.Tensor, e_second: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3 on unit vectors ``[..., D]``: (interpolated direction ``[..., D]``, angle Ω ``[...]``).

    t = 0 gives ``e_first`` (layer l-1), t = 1 gives ``e_second`` (layer l). The result is a unit
    vector whenever the inputs are (SLERP moves along the great circle).
    """
    cos = (e_first * e_second).sum(-1).clamp(-1.0, 1.0)
    omega = torch.arccos(cos)
    sin = torch.sin(omega)
    near = sin < _PARALLEL
    safe = torch.where(near, torch.ones_like(sin), sin)
    w_first = torch.where(near, torch.full_like(sin, 1 - t), torch.sin((1 - t) * omega) / safe)
    w_second = torch.where(near, torch.full_like(sin, t), torch.sin(t * omega) / safe)
    return w_first[..., None] * e_first + w_second[..., None] * e_second, omega


@dataclass
class MergedTokens:
    """One pair's new tokens after merging: ``direction [b, H, q, d]`` (cache dtype; for
    ``average``: the mean states themselves), ``norms [b, 2, q]`` float32 (None for ``average``),
    ``distance [b, q]`` float32 angular distance d = Ω/π ∈ [0, 1]."""

    direction: torch.Tensor
    norms: torch.Tensor | None
    distance: torch.Tensor


def merge_tokens(first: torch.Tensor, second: torch.Tensor, t: float, merge: str = "slerp") -> MergedTokens:
    """Merge two layers' states ``[b, H, q, d]`` token by token (``slerp``: eq. 2–3; ``average``:
    the paper's mean baseline, (x^{l-1} + x^l) / 2 shared by both layers, no norms)."""
    b, heads, q, d = first.shape
    a = first.float().transpose(1, 2).reshape(b, q, heads * d)
    c = second.float().transpose(1, 2).reshape(b, q, heads * d)
    norm_a, norm_c = a.norm(dim=-1), c.norm(dim=-1)
    tiny = torch.finfo(torch.float32).tiny
    e_a, e_c = a / norm_a.clamp(min=tiny)[..., None], c / norm_c.clamp(min=tiny)[..., None]
    direction, omega = slerp(e_a, e_c, t)
    distance = omega / math.pi
    if merge == "average":
        mean = (first.float() + second.float()) / 2
        return MergedTokens(mean.to(first.dtype), None, distance)
    direction = direction.view(b, q, heads, d).transpose(1, 2).to(first.dtype)
    return MergedTokens(direction, torch.stack([norm_a, norm_c], dim=1), distance)


def retained_tokens(
    distance: torch.Tensor, valid: torch.Tensor, distance_range: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4 with the unmergeable side at the top of the distance range.

    ``distance [b, q]``, ``valid [b, q]`` (False: padding, never retained nor counted),
    ``distance_range [b, 2]`` running (d_min, d_max) of the tokens seen before (+inf, -inf at
    first). Returns (retain ``[b, q]``, updated range). A token is kept unmerged when
    d_i ≥ d_max − (d_max − d_min)·γ: γ = 0 keeps none, γ = 1 keeps all. The range includes the
    past, so a decode step is judged against the prompt's distances, not against itself alone.
    """
    masked = distance.masked_fill(~valid, math.inf)
    low = torch.minimum(distance_range[:, 0], masked.min(dim=1).values)
    high = torch.maximum(distance_range[:, 1], distance.masked_fill(~valid, -math.inf).max(dim=1).values)
    updated = torch.stack([low, high], dim=1)
    if gamma <= 0:
        return torch.zeros_like(valid), updated
    threshold = low + (high - low) * (1 - gamma)  # = d_max − (d_max − d_min)·γ, exactly d_min at γ = 1
    return valid & (distance >= threshold[:, None]), updated


class MergedStream:
    """The merged state of one side (keys or values) of one layer pair.

    ``direction``: a store of ``[b, H, n, d]`` (quantized when the checkpoint asks for it: per channel
    for keys, per token for values); ``norms [b, 2, n]`` float32 (per token, layer l-1 then l; None
    for ``average``); ``retained [N, 2, H, d]`` exact states of the N retained tokens in both
    layers; ``retained_at [N, 2]`` int32 (batch row, position); ``distance_range [b, 2]``.
    """

    def __init__(self, quant: QuantSpec, per_channel: bool) -> None:
        self.direction = TokenStore(quant, per_channel)
        self.norms: Any = None
        self.retained: Any = None
        self.retained_at: Any = None
        self.distance_range: Any = None

    def append(self, first: torch.Tensor, second: torch.Tensor, valid: torch.Tensor, seen: int, t: float,
               gamma: float, merge: str) -> None:  # fmt: skip
        """Merge this step's ``[b, H, q, d]`` states of both layers; ``valid [b, q]``."""
        merged = merge_tokens(first, second, t, merge)
        if self.distance_range is None:
            b = first.shape[0]
            self.distance_range = torch.tensor([math.inf, -math.inf], device=first.device).repeat(b, 1)
            self.retained = first.new_empty((0, 2, first.shape[1], first.shape[3]))
            self.retained_at = torch.empty((0, 2), dtype=torch.int32, device=first.device)
        keep, self.distance_range = retained_tokens(merged.distance, valid, self.distance_range, gamma)
        rows, cols = keep.nonzero(as_tuple=True)
        if rows.numel():
            exact = torch.stack([first[rows, :, cols], second[rows, :, cols]], dim=1)  # [N, 2, H, d]
            where = torch.stack([rows, cols + seen], dim=1).to(torch.int32)
            self.retained = torch.cat([self.retained, exact])
            self.retained_at = torch.cat([self.retained_at, where])
        self.direction.append(merged.direction)
        self.norms = None if merged.norms is None else _cat(self.norms, merged.norms, dim=2)

    def restore(self, member: int) -> torch.Tensor:
        """Layer ``member``'s (0: l-1, 1: l) approximate states ``[b, H, n, d]``."""
        direction = states = self.direction.read()
        if self.norms is not None:
            states = (direction * self.norms[:, member, None, :, None]).to(direction.dtype)
        if self.retained.shape[0]:
            states = states.clone() if states is direction else states
            rows, positions = self.retained_at[:, 0].long(), self.retained_at[:, 1].long()
            states[rows, :, positions] = self.retained[:, member]
        return states

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / repeat / reorder batch rows: new row i is old row ``index[i]``."""
        if self.distance_range is None:
            return
        index = index.to(self.distance_range.device)
        self.direction.apply(select_rows_fn(index))
        self.distance_range = self.distance_range[index]
        self.norms = None if self.norms is None else self.norms[index]
        entry, new_row = (self.retained_at[:, 0, None].long() == index[None, :]).nonzero(as_tuple=True)
        self.retained = self.retained[entry]
        self.retained_at = torch.stack([new_row.to(torch.int32), self.retained_at[entry, 1]], dim=1)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (the distance range keeps what it has seen)."""
        if self.distance_range is None:
            return
        self.direction.crop(length)
        self.norms = None if self.norms is None else self.norms[:, :, :length].clone()
        kept = self.retained_at[:, 1] < length
        self.retained, self.retained_at = self.retained[kept], self.retained_at[kept]


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


class PairedLayer(KVLayer):
    """Base of both members of a pair. The stock attention module calls ``update`` (a no-op
    here); ``minicache_attention`` restores the past and commits the new states. The pair's state
    lives in its second layer, which alone answers the cache protocol (the first holds no rows)."""

    pair: PairState
    member: int  # 0: layer l-1, 1: layer l

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        return key_states, value_states

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        return _paired_attention(self, module, query, key, value, attention_mask, **kwargs)

    def get_seq_length(self) -> int:
        return self.pair.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.pair.seen + query_length, 0

    def reset(self) -> None:
        self.pair.reset()

    def rows(self) -> int:
        return 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop() takes a negative number of tokens to remove")

    def apply(self, fn: Any) -> None:
        """The first layer of a pair holds nothing."""


class PairState(PairedLayer):
    """Layer l (second of the pair): owns the pair's merged keys and values, ``seen`` tokens long,
    and, between the two layers of one forward call, layer l-1's new states (``pending``)."""

    def __init__(self, t: float, gamma: float, merge: str, quant: QuantSpec | None = None, layer: int = 0):
        super().__init__()
        self.t, self.gamma, self.merge = t, gamma, merge
        self.quant, self.layer = quant or QuantSpec(), layer  # the pair's second layer: its storage serves both
        self.pair, self.member = self, 1
        self.reset()

    def reset(self) -> None:
        self.seen = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # layer l-1's states, this call only
        self.keys_merged = MergedStream(self.quant.side(self.layer, keys=True), per_channel=True)
        self.values_merged = MergedStream(self.quant.side(self.layer, keys=False), per_channel=False)

    def rows(self) -> int:
        rows = self.keys_merged.distance_range
        return 0 if rows is None else rows.shape[0]

    def select_rows(self, index: torch.Tensor) -> None:
        self.keys_merged.select_rows(index)
        self.values_merged.select_rows(index)

    def crop(self, tokens_to_remove: int) -> None:
        KVLayer.crop(self, tokens_to_remove)

    def crop_to(self, length: int) -> None:
        self.seen = max(0, length)
        self.keys_merged.crop(self.seen)
        self.values_merged.crop(self.seen)

    def apply(self, fn: Any) -> None:
        for stream in (self.keys_merged, self.values_merged):
            stream.direction.apply(fn)
            for name in ("norms", "retained", "retained_at", "distance_range"):
                if getattr(stream, name) is not None:
                    setattr(stream, name, fn(getattr(stream, name)))

    def restore(self, member: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.seen == 0:
            return None
        return self.keys_merged.restore(member), self.values_merged.restore(member)

    def commit(self, member: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        if member == 0:
            self.pending = (keys, values)
            return
        assert self.pending is not None, "layer l of a merged pair ran before layer l-1"
        first_k, first_v = self.pending
        self.pending = None
        self.keys_merged.append(first_k, keys, valid, self.seen, self.t, self.gamma, self.merge)
        self.values_merged.append(first_v, values, valid, self.seen, self.t, self.gamma, self.merge)
        self.seen += keys.shape[2]


class PairFirst(PairedLayer):
    """Layer l-1 (first of the pair): holds no tensors; reads and writes through ``pair``."""

    def __init__(self, pair: PairState):
        super().__init__()
        self.pair, self.member = pair, 0


def minicache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function. Unpaired layers: stock SDPA over what their (stock) cache
    returned. Paired layers: ``key/value [b, Hkv, q, d]`` are this step's states only; the past is
    restored from the pair's merged state, and the new states are committed after attending. The
    layer's own copy of the code does the work (``PairedLayer.attend``, see ``cache_layer_of``)."""
    layer = cache_layer_of(module)
    if getattr(layer, "pair", None) is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return layer.attend(module, query, key, value, attention_mask, **kwargs)


def _paired_attention(
    layer: PairedLayer, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    pair, member = layer.pair, layer.member
    past = pair.restore(member)
    full_k = key if past is None else torch.cat([past[0], key], dim=2)
    full_v = value if past is None else torch.cat([past[1], value], dim=2)
    out = sdpa_attention_forward(module, query, full_k, full_v, attention_mask, **kwargs)
    batch, q_len = key.shape[0], key.shape[2]
    bias = additive_mask(attention_mask, q_len, full_k.shape[2], query.dtype, query.device)
    # the last query row sees every non-padding token: padding is neither retained nor ranged
    valid = (bias[:, 0, -1, -q_len:] == 0).expand(batch, q_len) if bias is not None else None
    if valid is None:
        valid = torch.ones(batch, q_len, dtype=torch.bool, device=key.device)
    pair.commit(member, key, value, valid)
    return out


AttentionInterface.register(IMPLEMENTATION, minicache_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: Any) -> None:
    """Attention modules stay stock; the work happens in ``minicache_attention``."""
    return None


def make_cache(spec: dict[str, Any]) -> LayerStateCache:
    plan = spec["minicache"]
    quant = QuantSpec.from_spec(spec)
    layers: list[DynamicLayer] = [stock_layer(quant, i) for i in range(len(spec["attention_modules"]))]
    for first, second in plan["pairs"]:
        state = PairState(float(plan["t"]), float(plan["gamma"]), plan["merge"], quant, second)
        layers[first], layers[second] = PairFirst(state), state
    return LayerStateCache(layers)


def configure(model: Any) -> None:
    """Route every attention module of ``model`` through ``minicache_attention``."""
    model.set_attn_implementation(IMPLEMENTATION)
