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
