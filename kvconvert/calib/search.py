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
from kvconvert.errors import KVConvertError

Affine = tuple[torch.Tensor, torch.Tensor]  # (Π, c): x ↦ Π·x + c


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
    """``truncated_attention``'s projectors for a ``ZackPlan`` over ``HeadBases``, float32."""
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
) -> tuple[Any, list[dict[str, float]]]:
    """Largest r (smallest cache) whose simulated top-1 agreement with the source stays >= ``target``.

    Bisection over r in [0, 1): agreement falls as r grows (more of every head is removed).
    Returns the plan and the log of every probe (r, kv budget, agreement).
    """
    from kvconvert.methods.zack import plan_for_rate

    if held_out.shape[0] == 0:
        raise KVConvertError("--target-agreement scores on held-out calibration text and none is left: "
                             "pass more text with --calib or lower --calib-tokens")  # fmt: skip
    chunks = held_out[:max_chunks]
    reference = top1(source, chunks)

    def probe(rate: float) -> tuple[Any, float]:
        plan = plan_for_rate(bases, rate, layout.head_dim, compress)
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


def branch_kls(
    source: Any, chunks: torch.Tensor, starts: list[int], observe: Any, progress: bool = True
) -> list[float]:
    """Mean KL(source ‖ branch b) per token over ``chunks [n, T]`` for every branch of one
    ``run_layer_by_layer(branches=starts)`` pass; ``observe(model)`` changes what each branch computes
    (it reads ``calib.sequential.active_branch()``). The unmodified stream is the reference."""
    from kvconvert.arch import adapter_for
    from kvconvert.calib.sequential import run_layer_by_layer

    reference: list[torch.Tensor] = []  # [T, vocab] log-probabilities per chunk
    totals = [0.0] * len(starts)

    def keep(c: int, logits: torch.Tensor) -> None:
        reference.append(torch.log_softmax(logits.float(), dim=-1))

    def add(branch: int, c: int, logits: torch.Tensor) -> None:
        ref = reference[c]
        totals[branch] += float((ref.exp() * (ref - torch.log_softmax(logits.float(), dim=-1))).sum())

    run_layer_by_layer(source, adapter_for(source.config), chunks, observe, progress=progress, logits=keep,
                       branches=starts, branch_logits=add)  # fmt: skip
    return [total / chunks.numel() for total in totals]


def active_job(jobs: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The (layer, side) job the running ``branch_kls`` branch changes when branch b changes ``jobs[b]``
    alone (the loss probes of the ``--schedule auto`` allocations); None on the reference stream."""
    from kvconvert.calib.sequential import active_branch

    branch = active_branch()
    return None if branch is None else jobs[branch]


def rotary_tables(
    model: Any, rotary_module: str | None, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:  # fmt: skip
    """The model's RoPE tables ``cos, sin [1, n, r]`` (float32, CPU) for positions 0..n-1 of ``x [b, h, n, dk]``
    (calibration runs one unpadded sequence per row); ``(None, None)`` without a rotary module."""
    if not rotary_module:
        return None, None
    rotary = model.get_submodule(rotary_module)
    device = next(iter(rotary.buffers()), x).device  # the layers may run on a GPU; observers on the CPU
    positions = torch.arange(x.shape[2], device=device)[None]
    cos, sin = rotary(x.to(device), positions)
    return cos.float().cpu(), sin.float().cpu()


def flat_heads(x: torch.Tensor) -> torch.Tensor:
    """``[b, H, n, dk]`` -> ``[b, n, H·dk]`` (heads concatenated, as a projection writes them)."""
    return x.transpose(1, 2).flatten(-2)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, n, H·dk]`` -> ``[b, H, n, dk]`` (``flat_heads`` undone)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def normalise_keys(keys: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A QK-norm applied to ``keys [..., n, Hkv·dk]`` (heads concatenated): ``weight · k / √(mean(k²) + eps)``
    over each head's channels (``weight [dk]``) or over all heads' (``[Hkv·dk]``)."""
    per = keys.unflatten(-1, (-1, weight.numel()))  # [..., n, Hkv, dk] per head, [..., n, 1, Hkv·dk] over all
    return (per * torch.rsqrt(per.pow(2).mean(-1, keepdim=True) + eps) * weight.to(keys.dtype)).flatten(-2)


def project_kv(
    model: Any, rotary_module: str | None, layer: int, key: torch.Tensor, value: torch.Tensor,
    projectors: dict[tuple[int, str], Affine], normed: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``key``/``value`` (``[b, Hkv, n, dk]``, keys after RoPE) of ``layer`` with ``projectors[layer, side]
    = (Π [Hkv·dk, Hkv·dk], c [Hkv·dk])`` applied as ``Π·x + c`` on the concatenated heads before RoPE
    (side "kv": ``Π [2·Hkv·dk, 2·Hkv·dk]`` on keys and values stacked, a latent shared by both):
    what a truncated projection ``Π·W`` with its bias b kept computes (``c = b − Π·b``;
    ``linalg.truncation_projector``). Keys are rotated back (positions 0..n-1: one unpadded sequence
    per row, as calibration runs), projected and rotated again. ``normed = (k [b, n, Hkv·dk], weight, eps)``
    for a QK-norm model (``ArchAdapter.key_norm``): the key projection's own output, which the truncation
    acts on before the norm — per head, the norm's scales could not be undone after Π mixes heads."""
    from kvconvert.runtime.kvconvert_common import apply_rotary

    def projected(x: torch.Tensor, affine: Affine) -> torch.Tensor:  # x [b, n, w] -> Π·x + c
        projector, offset = affine
        return x @ projector.to(x.dtype).T + offset.to(x.dtype)

    kv_heads = key.shape[1]
    if (layer, "v") in projectors:
        value = split_heads(projected(flat_heads(value), projectors[layer, "v"]), kv_heads)
    joint = (layer, "kv") in projectors
    if not joint and (layer, "k") not in projectors:
        return key, value
    cos, sin = rotary_tables(model, rotary_module, key)
    if normed is not None:  # the projection's output, before the norm and RoPE
        plain = normed[0].to(key.dtype)
    else:
        plain = flat_heads(key if cos is None or sin is None else apply_rotary(key, cos, -sin))
    if joint:  # one latent for both (``lorc --latent joint``): Π acts on [k; v]
        both = projected(torch.cat([plain, flat_heads(value)], dim=-1), projectors[layer, "kv"])
        plain, value = both[..., : plain.shape[-1]], split_heads(both[..., plain.shape[-1] :], kv_heads)
    else:
        plain = projected(plain, projectors[layer, "k"])
    if normed is not None:  # the model's norm, as the checkpoint applies it to its rebuilt keys
        plain = normalise_keys(plain, normed[1], normed[2])
    key = split_heads(plain, kv_heads)
    return (key if cos is None or sin is None else apply_rotary(key, cos, sin)), value


@contextlib.contextmanager
def key_projections(model: Any) -> Iterator[Callable[[Any], tuple[torch.Tensor, torch.Tensor, float] | None]]:
    """On a QK-norm model, each layer's key projection hooked for the block's duration; yields
    ``normed(attention module)``: ``(k [b, n, Hkv·dk], weight, eps)`` for the call being attended — the
    projection's output before the norm and RoPE, and the norm (``ArchAdapter.key_norm``) — or None for
    a model without QK-norm. A truncation acts on that output, before the norm (``project_kv``)."""
    from kvconvert.arch import adapter_for

    adapter = adapter_for(model.config)
    raw: dict[int, torch.Tensor] = {}  # layer -> this call's key projection output
    handles = []
    for layer, path in enumerate(adapter.attention_module_paths()):
        found = adapter.key_norm(model.get_submodule(path))  # (layer by layer, weights still on "meta" here)
        if found is not None:
            handles.append(found[0].register_forward_hook(
                lambda module, args, out, layer=layer: raw.__setitem__(layer, out.detach().cpu())))  # fmt: skip

    def normed(attention: Any) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        found = adapter.key_norm(attention)  # the norm's weight as loaded now
        return None if found is None else (raw[int(attention.layer_idx)], found[1].float().cpu(), found[2])

    try:
        yield normed
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def projected_kv(model: Any, select: Callable[[], dict[tuple[int, str], Affine]], rotary_module: str | None
                 ) -> Iterator[None]:  # fmt: skip
    """Inside the block, the keys (side "k") or values ("v") of each ``(layer, side)`` in ``select()``
    (asked at every layer: each branch of a probing pass has its own) are replaced as ``project_kv``
    does: what the truncated projection computes (on a QK-norm model, before the norm: ``key_projections``)."""
    with key_projections(model) as normed:

        def project(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> Any:
            layer, projectors = int(module.layer_idx), select()
            if not any((layer, side) in projectors for side in ("k", "v", "kv")):
                return None
            return query, *project_kv(model, rotary_module, layer, key, value, projectors, normed(module))

        with observed_attention(model, project):
            yield
