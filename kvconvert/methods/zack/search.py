"""Searching ZACK's removal rate for a quality target, on held-out calibration text.

The converted model is simulated inside the source model: in every layer q and k (after RoPE)
are projected onto each head's kept rotated dims, B Bᵀ, and v onto its kept V dims. Scores
``(qB)(kB)ᵀ`` and outputs ``P·v·B_v·B_vᵀ·W_O`` are exactly what the converted checkpoint computes,
so the source serves every candidate r without writing a checkpoint. Each probe runs the source
layer by layer (``calib.sequential``): memory stays at about one layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tqdm import tqdm

from kvconvert.arch import AttentionLayout
from kvconvert.calib.hooks import observed_attention
from kvconvert.calib.probes import top1
from kvconvert.errors import KVConvertError


def _projector(basis: torch.Tensor, rank: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``B_r C_rᵀ`` (row vectors: ``v ↦ v·B_r·C_rᵀ``), C = B for an orthogonal basis."""
    kept = basis[:, :rank]
    return (kept @ (kept if out is None else out[:, :rank]).T).to(dtype)


HeadProjectors = tuple[torch.Tensor | None, torch.Tensor | None]  # (P_k, P_v) [Hkv, dk, dk]; None: side exact


@contextlib.contextmanager
def truncated_attention(model: Any, select: Callable[[int], HeadProjectors | None]) -> Iterator[None]:
    """Inside the block ``model`` computes what ZACK's checkpoint would: per layer
    ``select(layer) = (P_k, P_v)``, P = B Bᵀ of each head's kept dims (None, or a None side: exact).
    ``select`` is asked at every layer, so each branch of a probing pass can truncate its own."""

    def truncate(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> Any:
        chosen = select(int(module.layer_idx))
        if chosen is None:
            return None
        p_k, p_v = chosen
        if p_k is not None:
            b, heads, n, dk = query.shape
            kv_heads = key.shape[1]
            query = (query.reshape(b, kv_heads, heads // kv_heads, n, dk) @ p_k[None, :, None]).reshape(query.shape)
            key = key @ p_k[None]
        return query, key, value if p_v is None else value @ p_v[None]

    with observed_attention(model, truncate):
        yield


def projectors_for(bases: Any, plan: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``truncated_attention``'s projectors for a ``ZackWidths`` over ``HeadBases``, float32."""
    return [
        (
            torch.stack([_projector(b, r, torch.float32) for b, r in zip(bases.qk[i], plan.rank_k[i], strict=True)]),
            torch.stack(
                [
                    _projector(b, r, torch.float32, c)
                    for b, c, r in zip(bases.vw[i], bases.vw_out[i], plan.rank_v[i], strict=True)
                ]
            ),  # fmt: skip
        )
        for i in range(len(plan.rank_k))
    ]


def search_removal_rate(
    source: Any,
    layout: AttentionLayout,
    bases: Any,
    held_out: torch.Tensor,
    target: float,
    compress: str = "kv",
    progress: bool = True,
    max_chunks: int = 8,
    steps: int = 10,
    whole: frozenset[int] = frozenset(),
) -> tuple[Any, list[dict[str, float]]]:
    """Largest r (smallest cache) whose simulated top-1 agreement with the source stays >= ``target`` (``whole``: the
    layers kept whole, ``plan_for_rate``'s).

    Bisection over r in [0, 1): agreement falls as r grows (more of every head is removed).
    Returns the plan and the log of every probe (r, kv budget, agreement).
    """
    from kvconvert.methods.zack.method import plan_for_rate

    if held_out.shape[0] == 0:
        raise KVConvertError("--target-agreement scores on held-out calibration text and none is left: "
                             "pass more text with --calib or lower --calib-tokens")  # fmt: skip
    chunks = held_out[:max_chunks]
    reference = top1(source, chunks)

    def probe(rate: float) -> tuple[Any, float]:
        plan = plan_for_rate(bases, rate, layout.head_dim, compress, whole)
        projectors = projectors_for(bases, plan)
        predicted = top1(source, chunks, lambda model: truncated_attention(model, projectors.__getitem__))
        return plan, (predicted == reference).float().mean().item()

    log: list[dict[str, float]] = []
    best, _ = probe(0.0)
    low, high = 0.0, 1.0  # agreement(low) >= target (r = 0 is exact); high: untested upper end
    for _ in tqdm(range(steps), desc="searching r", disable=not progress):
        middle = (low + high) / 2
        plan, agreement = probe(middle)
        log.append({"removal_rate": middle, "kv_budget": plan.budget, "agreement": agreement})
        if agreement >= target:
            low, best = middle, plan
        else:
            high = middle
    return best, log
