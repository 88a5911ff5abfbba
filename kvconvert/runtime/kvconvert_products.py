"""Products of a decode step's query rows with a cache (scores ``q·Kᵀ``, outputs ``p·V``) shaped for the CPU library
torch hands them to: oneDNN for half precision, MKL for float32.

Copied verbatim into every kvconvert output directory; imports only torch.
"""

from __future__ import annotations

import functools

import torch

# torch takes a CPU's bfloat16 / float16 products to oneDNN, which builds a kernel for every new shape: 0.5–0.7 ms a
# product (AMD EPYC, measured), where the product itself takes 20–60 µs. A decode step's products with a cache one
# token longer than the last step's would build one every step, two a layer. So the cache's length is split: whole
# blocks of LENGTH_BLOCK tokens in the cache's dtype (a new shape every LENGTH_BLOCK steps), the rest in float32,
# which torch takes to MKL (no per-shape build) and which those few tokens cost little to widen. Not every shape pays
# the build: measured in one process on SmolLM2 in bfloat16 at 1 × 1K, ZACK's packed products 52 → 31 ms a step and
# razor's whole heads 36 → 33 ms with the split (MiniCache's 16-bit subspace latents gain too), LoRC's latent and
# slim's key rows no change, so they keep theirs.
LENGTH_BLOCK = 64


def _half_on_cpu(cache: torch.Tensor) -> bool:
    """Products with ``cache`` go to oneDNN (half precision on a CPU, eagerly: compiled steps are Inductor's)."""
    half = cache.dtype in (torch.bfloat16, torch.float16)
    return cache.device.type == "cpu" and half and not torch.compiler.is_compiling()


@functools.cache
def onednn_half(dtype: torch.dtype) -> bool:
    """oneDNN has products in ``dtype`` (bfloat16 / float16) on this CPU: its own check of the instructions they need
    (AVX-512 BF16 or AMX; AVX-512 FP16), which ``ONEDNN_MAX_CPU_ISA`` also caps. Without them torch still takes half
    products to oneDNN, which then converts every operand element by element (an AMD EPYC with AVX-512 but not its FP16:
    a float16 batched product [1, 32, 1024] @ [1, 1024, 512] 17.1 ms, the same in float32 0.29 ms)."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    probe = getattr(torch.ops.mkldnn, check, None) if check else None
    return bool(probe is not None and probe())


def widened(cache: torch.Tensor) -> bool:
    """A half-precision cache on a CPU whose oneDNN has no products in its dtype (``onednn_half``): its products are
    taken in float32 (MKL) whole, the widening a few µs against the per-element conversions it saves."""
    return _half_on_cpu(cache) and not onednn_half(cache.dtype)


def keys_first(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``query [..., m, d] @ keys [..., n, d]ᵀ``; in oneDNN as ``keys @ queryᵀ``, transposed back (a view): oneDNN
    copies a batch of matrices that are views into a store's buffer with room to grow, and copies one handed to it
    transposed far more slowly (bfloat16, 3 query rows against 8 × 3 heads × 513 tokens of 64 channels: 249 against
    67 µs; 288 against 74 µs at 9 rows × 107 channels; a contiguous cache 40 against 47 µs), and a product's result
    costs nothing to transpose."""
    if widened(keys):
        return (query.float() @ keys.float().transpose(-1, -2)).to(query.dtype)
    if not _half_on_cpu(keys):
        return query @ keys.transpose(-1, -2)
    return (keys @ query.transpose(-1, -2)).transpose(-1, -2)


def cache_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``query [..., m, d] @ keys [..., n, d]ᵀ`` over a cache's ``n`` tokens, in the query's dtype, split as above
    (the whole blocks ``keys_first``)."""
    n = keys.shape[-2]
    whole = n - n % LENGTH_BLOCK
    if not _half_on_cpu(keys) or widened(keys) or whole == n:  # keys_first widens
        return keys_first(query, keys)
    rest = (query.float() @ keys[..., whole:, :].float().transpose(-1, -2)).to(query.dtype)
    return torch.cat([keys_first(query, keys[..., :whole, :]), rest], dim=-1) if whole else rest


def cache_mix(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``weights [..., m, n] @ values [..., n, d]`` over a cache's ``n`` tokens, in the weights' dtype, split as
    above (the two partial sums added in float32)."""
    if widened(values):
        return (weights.float() @ values.float()).to(weights.dtype)
    n = values.shape[-2]
    whole = n - n % LENGTH_BLOCK
    if not _half_on_cpu(values) or whole == n:
        return weights @ values
    rest = weights[..., whole:].float() @ values[..., whole:, :].float()
    if whole:
        rest = rest + (weights[..., :whole] @ values[..., :whole, :]).float()
    return rest.to(weights.dtype)
