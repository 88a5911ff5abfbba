"""Products of a decode step with a cache (scores ``q·Kᵀ``, outputs ``p·V``, keys rebuilt from a latent) shaped for
the CPU library torch hands them to: oneDNN for half precision, MKL for float32.

Copied verbatim into every kvconvert output directory; imports only torch and the runtime's own kvconvert_kernels.
"""

from __future__ import annotations

import functools

import torch

from .kvconvert_kernels import env_choice

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


def in_float32(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right`` with both operands widened to float32 (MKL's products), the result in ``left``'s dtype."""
    return (left.float() @ right.float()).to(left.dtype)


def keys_first(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``query [..., m, d] @ keys [..., n, d]ᵀ``; in oneDNN as ``keys @ queryᵀ``, transposed back (a view): oneDNN
    copies a batch of matrices that are views into a store's buffer with room to grow, and copies one handed to it
    transposed far more slowly (bfloat16, 3 query rows against 8 × 3 heads × 513 tokens of 64 channels: 249 against
    67 µs; 288 against 74 µs at 9 rows × 107 channels; a contiguous cache 40 against 47 µs), and a product's result
    costs nothing to transpose."""
    if widened(keys):
        return in_float32(query, keys.transpose(-1, -2))
    if not _half_on_cpu(keys):
        return query @ keys.transpose(-1, -2)
    return (keys @ query.transpose(-1, -2)).transpose(-1, -2)


def cache_scores(query: torch.Tensor, keys: torch.Tensor, blocks: bool = True) -> torch.Tensor:
    """``query [..., m, d] @ keys [..., n, d]ᵀ`` over a cache's ``n`` tokens, in the query's dtype, split as above
    (the whole blocks ``keys_first``). ``blocks`` False: one product as torch takes it, widened all the same (LoRC's
    latent, slim's key rows: split, they decode no faster, and slim in bfloat16 at 8 × 1K 1.58 → 1.23× the source,
    AMD EPYC with AVX-512 BF16)."""
    if widened(keys) or not _half_on_cpu(keys):  # float32 products: widened, or the cache's own
        return keys_first(query, keys)
    if not blocks:
        return query @ keys.transpose(-1, -2)
    n = keys.shape[-2]
    whole = n - n % LENGTH_BLOCK
    if whole == n:
        return keys_first(query, keys)
    rest = in_float32(query, keys[..., whole:, :].transpose(-1, -2))
    return torch.cat([keys_first(query, keys[..., :whole, :]), rest], dim=-1) if whole else rest


def cache_mix(weights: torch.Tensor, values: torch.Tensor, blocks: bool = True) -> torch.Tensor:
    """``weights [..., m, n] @ values [..., n, d]`` over a cache's ``n`` tokens, in the weights' dtype, split as
    above (the two partial sums added in float32); ``blocks`` False: one product, widened all the same
    (``cache_scores``)."""
    if widened(values):
        return in_float32(weights, values)
    n = values.shape[-2]
    whole = n - n % LENGTH_BLOCK
    if not blocks or not _half_on_cpu(values) or whole == n:
        return weights @ values
    rest = weights[..., whole:].float() @ values[..., whole:, :].float()
    if whole:
        rest = rest + (weights[..., :whole] @ values[..., :whole, :]).float()
    return rest.to(weights.dtype)


REBUILD_CHOICES = ("auto", "bf16", "exact")

# whether this CPU multiplies bfloat16 in hardware (AVX512-BF16, AMX tiles) and oneDNN takes it there: read once at
# import, so that a compiled step sees a constant (torch's private probes: a torch without them counts as a CPU
# without). oneDNN also runs bfloat16 on AVX-512 CPUs without those instructions, converting, no faster than float32
_CPU_BF16 = onednn_half(torch.bfloat16) and any(
    getattr(torch.cpu, probe, bool)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
)


def rebuild_requested() -> str:
    """``KVCONVERT_REBUILD``, checked (``rebuild_dtype``): a misspelt value raises a one-line ``ValueError``."""
    return env_choice("KVCONVERT_REBUILD", REBUILD_CHOICES)


def rebuild_dtype(latent: torch.Tensor) -> torch.dtype:
    """The dtype in which a step rebuilds keys from a cached latent (LoRC: ``[n, r] @ [r, Hkv·d]`` every step, its
    decode's one compute-bound product). ``KVCONVERT_REBUILD``: ``auto`` (unset) takes bfloat16 operands, float32
    accumulation, for a float32 latent on a CPU that multiplies them in hardware: 2.1× as fast there (1.87 → 0.89 ms,
    4096 tokens of rank 96 into 192 channels, AMD EPYC with AVX512-BF16; LoRC 0.5 on SmolLM2 0.65 → 0.68× the source
    at 4K, bench/results/ab-lorc-bf16-2026-11-27.md) for 0.3 % more error per key (KL 0.0790 → 0.0794 through the
    cache), and float32 for a half-precision latent where oneDNN has no products in its dtype (``widened``).
    ``exact``: the latent's dtype (the equivalence tests'); ``bf16``: bfloat16 wherever it is float32."""
    choice = rebuild_requested()
    if widened(latent):
        return torch.float32
    if latent.dtype != torch.float32 or choice == "exact":
        return latent.dtype
    if choice == "bf16" or (latent.device.type == "cpu" and _CPU_BF16):
        return torch.bfloat16
    return latent.dtype


def rebuild(latent: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(latent, weight, bias)`` in ``rebuild_dtype``, returned in the latent's dtype."""
    dtype = rebuild_dtype(latent)
    if dtype == latent.dtype:
        return torch.nn.functional.linear(latent, weight, bias)
    out = torch.nn.functional.linear(latent.to(dtype), weight.to(dtype)).to(latent.dtype)
    return out if bias is None else out + bias


def widened_bmm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(left, right)``, in float32 where oneDNN has no products in their half dtype (``widened``), the
    result in ``left``'s dtype. For a step's products with weights (the MLA export's per-head ``W_UK`` / ``W_UV``),
    which torch's batched half-precision loop then runs element by element: bfloat16 ``[32, 8, 128] @ [32, 128, 512]``
    12.5 ms against 0.87 ms widened, the weight's conversion included (oneDNN capped at AVX2, AMD EPYC)."""
    return in_float32(left, right) if widened(right) else torch.bmm(left, right)
