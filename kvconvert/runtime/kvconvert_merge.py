"""MiniCache's merge of two layers' states, token by token (Liu et al. 2024, §4): SLERP of the unit
directions (eq. 3), retention of the tokens too far apart to share one (eq. 4), and ``MergedStream``,
one side of one layer pair as the cache holds it. The attention and cache layers that use it are in
``kvconvert_minicache``. Copied verbatim into every minicache output directory."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .kvconvert_codec import QuantSpec
from .kvconvert_folded import kivi_decode_folded, value_rotation
from .kvconvert_quant import int4_value_sum, int4_values_or, kivi_kernel_reads
from .kvconvert_storage import select_rows_fn
from .kvconvert_tokenstore import TokenStore

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
    # both weights at once, [..., 2] (a decode step merges one token per pair and side: few ops, not few flops)
    limits = torch.tensor([1 - t, t], dtype=omega.dtype, device=omega.device)
    weights = torch.sin(omega[..., None] * limits) / sin.clamp(min=_PARALLEL)[..., None]
    weights = torch.where((sin < _PARALLEL)[..., None], limits, weights)
    return weights[..., :1] * e_first + weights[..., 1:] * e_second, omega


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
    # the padding's distances out of the range: +inf for its minimum, -inf for its maximum
    low = torch.minimum(distance_range[:, 0], distance.masked_fill(~valid, math.inf).amin(dim=1))
    high = torch.maximum(distance_range[:, 1], distance.masked_fill(~valid, -math.inf).amax(dim=1))
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

    _keep_in_fp32 = ("norms", "distance_range")  # float32 in any model dtype (the paper's restore needs the norms)

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
        if self.direction.tail is None:  # the first tokens: values in the int4 kernel's rows where it reads them
            self.direction = int4_values_or(self.direction, merged.direction)
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


def merged_reads_codes(keys: MergedStream, values: MergedStream, dim: int) -> bool:
    """``merged_decode`` can read both sides' directions from their codes (``kivi_kernel_reads``'s torch reader)."""
    return keys.distance_range is not None and kivi_kernel_reads(keys.direction, values.direction, dim, kernel=False)


def merged_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None, keys: MergedStream,
    values: MergedStream, member: int, scaling: float, retained: dict[Any, Any],
) -> torch.Tensor:  # fmt: skip
    """One decode step of layer ``member`` (0: l-1, 1: l) of a pair over its merged past, from the directions' codes.

    Layer ``member``'s past state is ``direction · norm`` per token, so its score is ``norm · (q·direction)`` and its
    weight in the values' sum ``p · norm``: ``kivi_decode_folded`` reads the directions' codes with the norms as
    per-token factors, never restoring the past (``MergedStream.restore`` dequantizes it all each step). The exact
    part is attended in the same softmax: the sink's and the float tail's directions times the norms, this step's
    ``key/value [b, Hkv, 1, d]``, and the retained tokens — those either side kept exact (their merged stand-ins
    masked out of the codes' read), with the other side's state where it merged them.
    ``bias [b|1, 1, 1, n + 1]`` additive or None; ``retained``: the caller's memo of the retained tokens' states
    (``_retained_states``). Returns ``[b, H, 1, d]`` float32."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    kd, vd = keys.direction, values.direction
    kb, vb = kd.blocks, vd.blocks
    assert kb is not None and vb is not None and kd.tail is not None and vd.tail is not None
    n_q, seen, sink = kd.quantized_tokens, len(kd), (0 if kd.head is None else kd.head.shape[-2])
    minimum = torch.finfo(torch.float32).min
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    k_union, v_union, rows, positions, at, valid = _retained_states(keys, values, member, retained)
    full = torch.zeros(batch, seen + 1, device=query.device) if bias is None else (
        bias[:, 0, 0].float().expand(batch, seen + 1))  # fmt: skip
    union_bias = torch.where(valid, full.gather(1, at), minimum)  # the retained tokens' own, before they are masked
    masked = full.clone() if bias is not None else full  # fresh zeros: masked in place
    masked[rows, positions] = minimum  # retained: read exactly below
    bias_q = masked[:, :n_q].clone()
    bias_q[:, :sink] = minimum  # the sink's stand-ins: its exact copies are attended below
    k_norms = None if keys.norms is None else keys.norms[:, member]  # [b, n] float32
    v_norms = None if values.norms is None else values.norms[:, member]
    exact_k, exact_v, exact_bias = [], [], []
    for store_k, store_v, span in ((kd.head, vd.head, slice(0, sink)), (kd.tail, vd.tail, slice(n_q, seen))):
        if store_k is not None and store_v is not None:
            exact_k.append(_times(store_k, k_norms, span))
            exact_v.append(_times(store_v, v_norms, span))
            exact_bias.append(masked[:, span])
    exact_k += [k_union, key.float()]
    exact_v += [v_union, value.float()]
    exact_bias += [union_bias, full[:, seen:]]
    exact = (torch.cat(exact_k, dim=-2), torch.cat(exact_v, dim=-2), torch.cat(exact_bias, dim=-1)[:, None, None])
    acc, ml = kivi_decode_folded(q, kb.codes, kb.scale, kb.zero, vb.codes, vb.scale, vb.zero, bias_q, scaling,
                                 kd.quant.bits, vd.quant.bits, None if k_norms is None else k_norms[:, :n_q],
                                 None if v_norms is None else v_norms[:, :n_q], exact=exact,
                                 value_rotation=value_rotation(vd, dim, query.device),
                                 value_sum=int4_value_sum(vd))  # fmt: skip
    return (acc / ml[..., 1:]).view(batch, heads, 1, dim)


def _times(directions: torch.Tensor, norms: torch.Tensor | None, span: slice) -> torch.Tensor:
    """Stored ``directions [b, H, t, d]`` as a layer's states (times its ``norms [b, n]`` at ``span``), float32."""
    return directions.float() if norms is None else directions.float() * norms[:, None, span, None]


def _retained_states(
    keys: MergedStream, values: MergedStream, member: int, memo: dict[Any, Any]
) -> tuple[torch.Tensor, ...]:
    """The tokens either side retained: layer ``member``'s keys and values ``[b, Hkv, R, d]`` float32 per batch row,
    padded to the longest row (exact where that side retained the token, its merged state where it did not), the
    tokens' rows and positions ``[U]``, their positions ``[b, R]`` and which slots hold one ``[b, R]``. They change
    only when a token is retained or a block quantized, not every step: ``memo`` (the pair's, emptied when rows are
    selected, cropped or moved) keeps them per member until then."""
    kd, vd = keys.direction, values.direction
    stamp = (keys.retained.shape[0], values.retained.shape[0], kd.quantized_tokens, vd.quantized_tokens)
    if memo.get("stamp") != stamp:
        memo.clear()
        memo["stamp"] = stamp
    if member in memo:
        return memo[member]
    batch, device = keys.distance_range.shape[0], keys.distance_range.device
    span = 1 << 32  # (row, position) as one int64 code
    codes = [(s.retained_at[:, 0].long() << 32) + s.retained_at[:, 1].long() for s in (keys, values)]
    union = torch.unique(torch.cat(codes))  # sorted: by row, then position
    rows, positions = union // span, union % span
    states = []
    for stream, code, norms in ((keys, codes[0], keys.norms), (values, codes[1], values.norms)):
        merged = stream.direction.states_at(rows, positions).float()  # [U, H, d]
        if norms is not None:
            merged = merged * norms[rows, member, positions][:, None, None]
        merged[torch.searchsorted(union, code)] = stream.retained[:, member].float()
        states.append(merged)
    count = torch.bincount(rows, minlength=batch)
    slot = torch.arange(union.shape[0], device=device) - (torch.cumsum(count, 0) - count)[rows]
    width = int(count.max()) if union.numel() else 0
    at = torch.zeros(batch, width, dtype=torch.long, device=device)
    at[rows, slot] = positions
    valid = torch.arange(width, device=device)[None, :] < count[:, None]
    padded = []
    for merged in states:  # [U, H, d] -> [b, H, R, d]
        out = merged.new_zeros(batch, width, *merged.shape[1:])
        out[rows, slot] = merged
        padded.append(out.transpose(1, 2))
    memo[member] = (padded[0], padded[1], rows, positions, at, valid)
    return memo[member]
