"""Simulating a projected cache inside the source model: an affine map ``x ↦ Π·x + c`` applied to a layer's
keys or values where the model computes them (before RoPE, through a QK-norm where there is one), plus the
head-tensor helpers it needs. What the checkpoint of a projection method computes, without writing it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvconvert.calib.hooks import observed_attention

Affine = tuple[torch.Tensor, torch.Tensor]  # (Π, c): x ↦ Π·x + c


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
    from kvconvert.runtime.kvconvert_rope import apply_rotary

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
