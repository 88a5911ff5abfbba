"""Folding the values' rotation into W_V and W_O (``quant --kv-rotate``, QuaRot's offline form): pure float64
linear algebra on one layer's attention weights."""

from __future__ import annotations

import dataclasses

import torch

from kvconvert.arch import AttentionWeights

F64 = torch.float64


def fold_value_rotation(
    weights: AttentionWeights, num_heads: int, num_kv_heads: int, head_dim: int, rotation: torch.Tensor
) -> AttentionWeights:
    """``weights`` with each value channel group's orthogonal ``rotation R [s, s]`` folded in (float64).

    The value projection then gives ``v·R`` per group of ``s`` channels, what the cache stores would rotate values
    into before quantizing them (W_V and its bias: ``Rᵀ·W`` per group of rows), and the output projection takes
    each head's attention output rotated back (W_O: ``W·R`` per group of columns): ``(o·R)·(W_O,h·R)ᵀ = o·W_O,hᵀ``.
    So the model computes what the source computes, and a decode step reads the stored values as they are
    instead of rotating every cached value back."""
    size = rotation.shape[0]
    if head_dim % size:
        raise ValueError(f"a rotation of {size} channels does not tile a head of {head_dim}")
    r, groups = rotation.to(F64), head_dim // size
    v = weights.v_weight.to(F64).reshape(num_kv_heads, groups, size, -1)
    v_weight = torch.einsum("st,hgsd->hgtd", r, v).reshape(weights.v_weight.shape)
    v_bias = None
    if weights.v_bias is not None:
        b = weights.v_bias.to(F64).reshape(num_kv_heads, groups, size)
        v_bias = torch.einsum("st,hgs->hgt", r, b).reshape(weights.v_bias.shape)
    o = weights.o_weight.to(F64).reshape(weights.o_weight.shape[0], num_heads, groups, size)
    o_weight = (o @ r).reshape(weights.o_weight.shape)
    return dataclasses.replace(weights, v_weight=v_weight, v_bias=v_bias, o_weight=o_weight)
