"""Loss probes shared by the methods that choose by measured loss: the source's own top-1 tokens on
calibration chunks, and the KL of many simulated variants (branches) of the source in one layer-by-layer
pass (``calib.sequential``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def top1(source: Any, chunks: torch.Tensor, observe: Any = contextlib.nullcontext) -> torch.Tensor:
    """Argmax token at every position of ``chunks [n, T]`` (``[n, T]``), the source run layer by
    layer with ``observe(model)`` active."""
    from kvconvert.arch import adapter_for
    from kvconvert.calib.sequential import run_layer_by_layer

    out = torch.empty_like(chunks)

    def keep(c: int, logits: torch.Tensor) -> None:
        out[c] = logits.argmax(-1)

    run_layer_by_layer(source, adapter_for(source.config), chunks, observe, progress=False, logits=keep)
    return out


def branch_kls(
    source: Any,
    chunks: torch.Tensor,
    starts: list[int],
    observe: Any,
    progress: bool = True,
    tail: int = 0,
    scored: list[list[int]] | None = None,
) -> list[float]:
    """Mean KL(source ‖ branch b) per token over ``chunks [n, T]`` for every branch of one
    ``run_layer_by_layer(branches=starts)`` pass; ``observe(model)`` changes what each branch computes
    (it reads ``calib.sequential.active_branch()``). The unmodified stream is the reference.
    ``tail``: the branches change only each chunk's last ``tail`` positions (``run_layer_by_layer``'s);
    ``scored[c]``: the positions (of the tail, when there is one) whose KL counts, else all of them."""
    from kvconvert.arch import adapter_for
    from kvconvert.calib.sequential import run_layer_by_layer

    reference: list[torch.Tensor] = []  # [positions, vocab] log-probabilities per chunk
    totals = [0.0] * len(starts)

    def kept(c: int, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax((logits if scored is None else logits[scored[c]]).float(), dim=-1)

    def keep(c: int, logits: torch.Tensor) -> None:
        reference.append(kept(c, logits))

    def add(branch: int, c: int, logits: torch.Tensor) -> None:
        ref = reference[c]
        totals[branch] += float((ref.exp() * (ref - kept(c, logits))).sum())

    run_layer_by_layer(source, adapter_for(source.config), chunks, observe, progress=progress, logits=keep,
                       branches=starts, branch_logits=add, tail=tail)  # fmt: skip
    count = sum(ref.shape[0] for ref in reference)  # every position scored, whichever were asked for
    return [total / count for total in totals]


def active_job(jobs: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The (layer, side) job the running ``branch_kls`` branch changes when branch b changes ``jobs[b]``
    alone (the loss probes of the ``--schedule auto`` allocations); None on the reference stream."""
    from kvconvert.calib.sequential import active_branch

    branch = active_branch()
    return None if branch is None else jobs[branch]
