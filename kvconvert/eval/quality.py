"""Perplexity, KL(reference ‖ model) and top-1 agreement over non-overlapping windows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm


@dataclass
class QualityResult:
    tokens: int  # predicted tokens (each window's first token is context only)
    ppl: float
    reference_ppl: float | None = None
    kl_mean: float | None = None  # mean over predicted tokens of KL(p_reference ‖ p_model), nats
    top1_agreement: float | None = None  # fraction of tokens whose argmax agrees


def windows(token_ids: torch.Tensor, ctx: int) -> list[torch.Tensor]:
    """Non-overlapping ``[1, <=ctx]`` windows; a trailing window shorter than 2 tokens is dropped."""
    return [
        token_ids[i : i + ctx][None] for i in range(0, token_ids.numel(), ctx) if token_ids[i : i + ctx].numel() > 1
    ]


@torch.no_grad()
def evaluate_quality(
    model: Any, token_ids: torch.Tensor, ctx: int, reference: Any | None = None, progress: bool = False
) -> QualityResult:
    """Score ``token_ids [n]`` window by window (only one window's logits are ever held).

    For every window ``w``: log-probs of ``w[1:]`` given ``w[:-1]`` from the model (and the
    reference); NLL, KL and argmax agreement are summed in float64.
    """
    nll = ref_nll = kl = 0.0
    agree = count = 0
    for window in tqdm(windows(token_ids, ctx), desc="eval", unit="window", disable=not progress):
        targets = window[:, 1:]
        logp = torch.log_softmax(model(window, use_cache=False).logits[:, :-1].double(), dim=-1)
        nll -= logp.gather(-1, targets[..., None]).sum().item()
        count += targets.numel()
        if reference is not None:
            ref_logp = torch.log_softmax(reference(window, use_cache=False).logits[:, :-1].double(), dim=-1)
            ref_nll -= ref_logp.gather(-1, targets[..., None]).sum().item()
            kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
            agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    if count == 0:
        raise ValueError("need at least 2 tokens to evaluate")
    result = QualityResult(tokens=count, ppl=math.exp(nll / count))
    if reference is not None:
        result.reference_ppl = math.exp(ref_nll / count)
        result.kl_mean = kl / count
        result.top1_agreement = agree / count
    return result
