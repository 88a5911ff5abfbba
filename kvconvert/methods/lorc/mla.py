"""``lorc --latent mla``: one layer's attention rewritten as DeepSeek-V3's multi-head latent attention, float64.

MLA caches per token and layer one latent ``c`` (``kv_lora_rank`` values, normalised by ``kv_a_layernorm``) that
every head's keys-without-RoPE and values are rebuilt from (``kv_b_proj``), plus one rotary key part shared by
all heads (``qk_rope_head_dim``). A GQA layer has a rotary key per KV head; RoPE turns a pair ``f`` of every
head by the same angle, so any complex mixing *across* KV heads commutes with it (TransMLA's RoRoPE). Per
frequency the keys of the ``Hkv`` heads form a complex vector ``z_f = k_f + i·k_{f+d/2}``; the shared key keeps
its principal direction (``z_f ≈ a_f·(b_fᴴ z_f)``, weighted by how strongly each group's queries read that
frequency), which loses nothing for MQA. What the shared key misses (the other ``Hkv − 1`` directions) cannot
keep its rotation in this layout: it joins the values in the latent, and the queries that read it are turned
by the mean rotation ``c_f = E[e^{iΔθ_f}]`` over the relative distances ``Δ`` the model attends across — the
linear map closest to the true, distance-dependent one (≈ 1 for slow frequencies, ≈ 0 for fast ones, where
the un-rotated part would only add noise; TransMLA keeps it at 1).

The latent is the stacked [residual keys; values] factored like LoRC's joint latent (whitened by the inputs'
Gram, keys weighted by the queries that read them, values by W_O). ``kv_a_layernorm`` is an RMSNorm that a
converted model has no counterpart for: the latent's projection is scaled down until its mean square is
``LATENT_MEAN_SQUARE`` of the norm's epsilon on calibration text, where the norm is linear (it multiplies by
``1/√(ms + eps) ≈ 1/√eps``, off by ``ms/(2·eps)`` ≈ 5e-6 relative), and the norm's weight undoes the scale.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from kvconvert import linalg
from kvconvert.arch import AttentionLayout, AttentionWeights

F64 = linalg.F64
LATENT_MEAN_SQUARE = 1e-5  # the latent's calibrated mean square, in units of the norm's epsilon


def complex_pairs(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a rotate-half projection ``[heads·d, D]`` as complex RoPE pairs ``[heads, d/2, D]``:
    ``row f + i·row (f + d/2)``, which RoPE multiplies by ``e^{i·pos·θ_f}``."""
    w = weight.to(F64).reshape(heads, head_dim, -1)
    half = head_dim // 2
    return torch.complex(w[:, :half], w[:, half:])


def half_rows(pairs: torch.Tensor) -> torch.Tensor:
    """Complex pairs ``[…, d/2, D]`` back to rotate-half rows ``[…, d, D]`` (real parts, then imaginary)."""
    return torch.cat([pairs.real, pairs.imag], dim=-2)


def interleaved_rows(pairs: torch.Tensor) -> torch.Tensor:
    """Complex pairs ``[…, d/2, D]`` as DeepSeek's interleaved rows ``[…, d, D]``: pair f at rows 2f, 2f+1."""
    return torch.stack([pairs.real, pairs.imag], dim=-2).flatten(-3, -2)


def mean_rotation(frequencies: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``c_f = E[e^{iΔθ_f}]`` with ``Δ`` distributed as ``weights [..., T]`` over ``0 … T − 1`` tokens (attention
    probabilities summed by distance, or ones): complex ``[..., pairs]``. It minimises ``E|e^{iΔθ} − c|²``, the
    error of a logit term whose rotation is replaced by one fixed factor, weighted as attention weights it."""
    delta = torch.arange(weights.shape[-1], dtype=F64)
    turns = torch.exp(1j * delta[:, None] * frequencies.to(F64)[None, :])  # [T, pairs]
    weights = weights.to(F64)
    return (weights.to(turns.dtype) @ turns) / weights.sum(-1, keepdim=True).clamp(min=1e-300)


def shared_rotary_key(
    keys: torch.Tensor, gram: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per frequency, the rank-1 ``z_f ≈ a_f (b_fᴴ z_f)`` of the KV heads' complex keys ``keys [Hkv, d/2, D]``
    on inputs with Gram ``gram [D, D]`` minimising ``E Σ_g w_gf |z_gf − a_gf b_fᴴ z_f|²`` (``weights [Hkv, d/2]``
    > 0): the top eigenvector ``ã`` of ``W^½ C_f W^½``, ``a = W^-½ ã``, ``b = W^½ ã``. Returns ``a, b [d/2, Hkv]``
    and the weighted share of each frequency's key energy the shared key keeps ``[d/2]``."""
    cov = torch.einsum("hfx,xy,gfy->fhg", keys, gram.to(keys.dtype), keys.conj())  # E[z zᴴ] per frequency
    root = weights.T.clamp(min=1e-300).sqrt().to(keys.dtype)  # [d/2, Hkv]
    eigenvalues, vectors = torch.linalg.eigh(root[:, :, None] * cov * root[:, None, :])
    top = vectors[..., -1]
    kept = eigenvalues[..., -1] / eigenvalues.sum(-1).clamp(min=1e-300)
    return top / root, top * root, kept


def mla_attention(
    w: AttentionWeights, layout: AttentionLayout, gram: torch.Tensor, kv_lora_rank: int, rope_dim: int,
    rotation: torch.Tensor, query_scale: float, norm_eps: float,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:  # fmt: skip
    """DeepSeek-V3 attention tensors (names local to the block) for one source layer, and its report.

    ``gram [D, D]``: the mean ``x xᵀ`` of the attention inputs on calibration text; ``rope_dim`` (even, ≤ d):
    the shared RoPE key's width, which keeps the ``rope_dim/2`` fastest frequencies (the slower ones join the
    latent whole, turned by their mean rotation, ≈ 1 where they are slowest); ``rotation [H, d/2]``:
    each query head's ``mean_rotation`` of the source's frequencies; ``query_scale``: source softmax scale ÷
    DeepSeek's (folded into the queries); ``norm_eps``: ``kv_a_layernorm``'s epsilon. Shapes (H query heads,
    Hkv KV heads, d head width, ρ = ``rope_dim``, r = ``kv_lora_rank``): ``q_proj [H·(d + ρ), D]`` (per head
    d nope rows, then ρ interleaved rope rows), ``kv_a_proj_with_mqa [r + ρ, D]``, ``kv_a_layernorm [r]``,
    ``kv_b_proj [H·2d, r]`` (per head d key rows, d value rows), ``o_proj`` unchanged.
    """
    heads, kv_heads, d = layout.num_heads, layout.num_kv_heads, layout.head_dim
    group = heads // kv_heads
    gram = gram.to(F64)
    keys = complex_pairs(w.k_weight, kv_heads, d)  # [Hkv, d/2, D]
    queries = complex_pairs(w.q_weight, heads, d)  # [H, d/2, D]
    of_group = torch.arange(heads) // group
    query_energy = torch.einsum("hfx,xy,hfy->hf", queries, gram.to(queries.dtype), queries.conj()).real
    band = rope_dim // 2  # the fastest frequencies: pairs 0 … band − 1
    a, b, kept = shared_rotary_key(keys[:, :band], gram, query_energy[:, :band].reshape(kv_heads, group, -1).sum(1))
    rope_key = torch.einsum("fh,hfx->fx", b.conj(), keys[:, :band])  # [band, D]
    # what the shared key misses: the rest of its band, and the slower frequencies whole. [Hkv, d/2, D]
    residual = torch.cat([keys[:, :band] - torch.einsum("fh,fx->hfx", a, rope_key), keys[:, band:]], dim=1)
    rope_query = queries[:, :band] * a.T.conj()[of_group][:, :, None]
    nope_query = queries * rotation.to(queries.dtype)[:, :, None]

    def group_grams(rows: torch.Tensor, sum_heads: int) -> torch.Tensor:  # [n·sum_heads, d, D] -> [n, d, d]
        grams = torch.einsum("hdx,xy,hey->hde", rows, gram, rows)
        return grams.view(-1, sum_heads, d, d).sum(1)

    values = w.v_weight.to(F64)
    o_gram = linalg.output_gram(w.o_weight, heads, kv_heads, d)
    # both errors in one unit, the attention output's error through W_O, to first order: a value error reaches it
    # directly; a key error δk moves head j's logit by δs = scale·q_jᵀδk, and the output by δs times the values
    # W_O makes (E‖W_O,j v‖² ≈ their mean energy per head). So key errors, weighted by the queries that read
    # them (turned and un-rotated: their whole Gram), count scale²·E‖W_O v‖²/H times.
    value_energy = float((o_gram * group_grams(values.view(kv_heads, d, -1), 1)).sum())
    key_weight = layout.scaling[0] ** 2 * value_energy / heads
    nope_gram = group_grams(half_rows(nope_query), group)
    stacked, left = linalg.stacked_weights(
        [half_rows(residual).reshape(kv_heads * d, -1), values],
        [key_weight, 1.0],
        [linalg.block_cholesky(nope_gram, ridge=1e-6), linalg.block_cholesky(o_gram)],
    )
    rank = min(kv_lora_rank, *stacked.shape)
    up, down, sigma = linalg.weighted_truncation(stacked, rank, linalg.gram_factor(gram), left)
    if rank < kv_lora_rank:  # the inputs have fewer dimensions than the latent: the rest stays zero
        up = torch.cat([up, up.new_zeros(up.shape[0], kv_lora_rank - rank)], dim=1)
        down = torch.cat([down, down.new_zeros(kv_lora_rank - rank, down.shape[1])])
    mean_square = float(torch.einsum("rx,xy,ry->", down, gram, down)) / kv_lora_rank
    shrink = math.sqrt(LATENT_MEAN_SQUARE * norm_eps / mean_square) if mean_square > 0 else 1.0

    up_key, up_value = (part.reshape(kv_heads, d, -1)[of_group] for part in up.split(kv_heads * d))
    per_head_query = torch.cat([half_rows(nope_query), interleaved_rows(rope_query)], dim=1)  # [H, d + ρ, D]
    tensors = {
        "q_proj.weight": per_head_query.reshape(heads * (d + rope_dim), -1) * query_scale,
        "kv_a_proj_with_mqa.weight": torch.cat([down * shrink, interleaved_rows(rope_key)]),
        "kv_a_layernorm.weight": torch.full((kv_lora_rank,), math.sqrt(norm_eps) / shrink, dtype=F64),
        "kv_b_proj.weight": torch.cat([up_key, up_value], dim=1).reshape(heads * 2 * d, -1),
        "o_proj.weight": w.o_weight.to(F64),
    }
    report = {
        # the share of the query-weighted key energy that keeps its exact rotation
        "rope_kept": float((kept * query_energy[:, :band].sum(0)).sum() / query_energy.sum().clamp(min=1e-300)),
        "latent_rel_output_error": linalg.relative_frobenius_error(sigma, rank),
    }  # fmt: skip
    return tensors, report


# The names ``mla_forward`` takes: the export's tensors split where their rows differ in kind (and in scale: the
# latent's rows are shrunk into the norm's linear range), each a separate tensor for ``refine.fit_by_adam``.
MLA_PARTS = ("q_nope", "q_rope", "latent_down", "rope_key", "kv_up")


def mla_parts(
    tensors: dict[str, torch.Tensor], heads: int, head_dim: int, kv_lora_rank: int
) -> dict[str, torch.Tensor]:
    """``mla_attention``'s ``q_proj``, ``kv_a_proj_with_mqa`` and ``kv_b_proj`` as ``MLA_PARTS``: ``q_nope [H, d, D]``,
    ``q_rope [H, ρ, D]`` (interleaved rows), ``latent_down [r, D]``, ``rope_key [ρ, D]``, ``kv_up [H, 2d, r]``."""
    query = tensors["q_proj.weight"].view(heads, -1, tensors["q_proj.weight"].shape[-1])
    kv_a = tensors["kv_a_proj_with_mqa.weight"]
    return {
        "q_nope": query[:, :head_dim], "q_rope": query[:, head_dim:], "latent_down": kv_a[:kv_lora_rank],
        "rope_key": kv_a[kv_lora_rank:], "kv_up": tensors["kv_b_proj.weight"].view(heads, 2 * head_dim, -1),
    }  # fmt: skip


def mla_tensors(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mla_parts``' inverse: the parts back as the checkpoint's ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``."""
    return {
        "q_proj.weight": torch.cat([parts["q_nope"], parts["q_rope"]], dim=1).flatten(0, 1),
        "kv_a_proj_with_mqa.weight": torch.cat([parts["latent_down"], parts["rope_key"]]),
        "kv_b_proj.weight": parts["kv_up"].flatten(0, 1),
    }


def padded_mla(
    tensors: dict[str, torch.Tensor], heads: int, head_dim: int, kv_lora_rank: int, rank: int, rope_dim: int
) -> dict[str, torch.Tensor]:  # fmt: skip
    """One layer's export tensors with the latent zero-padded to ``rank`` coordinates and the RoPE key to
    ``rope_dim`` dims (the sizes an engine's kernels take: ``arch.mla.ENGINE_SIZES``). Zero rows of
    ``kv_a_proj_with_mqa`` make the padded coordinates zero, and zero columns of ``kv_b_proj`` leave them unread; the
    key's and the queries' padded RoPE rows are zero, so those slower pairs add nothing to any score. The latent's
    RMSNorm then averages over ``rank`` coordinates, but in its linear range (``LATENT_MEAN_SQUARE``) its output
    moves by ~5e-6 relative (a tiny model's logits by 1.2e-5 of the largest, measured): the same attention. The
    queries need no new scale: ``query_scale`` is computed for the written sizes from the start."""
    parts = mla_parts(tensors, heads, head_dim, kv_lora_rank)

    def grown(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
        missing = size - tensor.shape[dim]
        assert missing >= 0, "padding never shrinks the export"
        return torch.cat([tensor, tensor.new_zeros(*tensor.shape[:dim], missing, *tensor.shape[dim + 1 :])], dim=dim)

    parts = {
        "q_nope": parts["q_nope"], "q_rope": grown(parts["q_rope"], rope_dim, 1),
        "latent_down": grown(parts["latent_down"], rank, 0), "rope_key": grown(parts["rope_key"], rope_dim, 0),
        "kv_up": grown(parts["kv_up"], rank, 2),
    }  # fmt: skip
    norm = tensors["kv_a_layernorm.weight"]  # its padded entries scale zeros: any value, the first's
    padded_norm = torch.cat([norm, norm[:1].expand(rank - len(norm))])
    return {**tensors, **mla_tensors(parts), "kv_a_layernorm.weight": padded_norm}


def interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on DeepSeek's interleaved rows (pair f at dims 2f, 2f+1, turned as ``(x_2f + i·x_2f+1)·e^{iφ_f}``);
    ``cos``/``sin [T, ρ/2]``, ``x [..., T, ρ]``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def mla_forward(
    parts: dict[str, torch.Tensor], norm_weight: torch.Tensor, o_weight: torch.Tensor, x: torch.Tensor,
    frequencies: torch.Tensor, scaling: float, norm_eps: float,
) -> torch.Tensor:  # fmt: skip
    """DeepSeek-V3's attention (no query LoRA, causal, positions 0 … T − 1) of ``x [n, T, D]`` with the
    ``mla_parts`` ``parts``, ``kv_a_layernorm``'s weight and epsilon, W_O, the shared key's angular
    ``frequencies [ρ/2]`` and the softmax ``scaling``: the output after W_O ``[n, T, D]``, in ``x``'s dtype.
    Plain torch, differentiable: what stock transformers' ``DeepseekV3Attention`` computes (tested)."""
    heads, d = parts["q_nope"].shape[0], parts["q_nope"].shape[1]
    angles = torch.arange(x.shape[1], device=x.device, dtype=torch.float64)[:, None] * frequencies.to(x.device)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    q_nope = torch.einsum("ntx,hdx->nhtd", x, parts["q_nope"])
    q_rope = interleaved_rotary(torch.einsum("ntx,hdx->nhtd", x, parts["q_rope"]), cos, sin)
    latent = x @ parts["latent_down"].T  # [n, T, r]; kv_a_layernorm, an RMSNorm computed in float32 as stock
    latent = (latent.float() * torch.rsqrt(latent.float().pow(2).mean(-1, keepdim=True) + norm_eps)).to(x.dtype)
    latent = latent * norm_weight
    rope_key = interleaved_rotary(x @ parts["rope_key"].T, cos, sin)[:, None]  # [n, 1, T, ρ]
    rebuilt = torch.einsum("ntr,hdr->nhtd", latent, parts["kv_up"])  # [n, H, T, 2d]
    query = torch.cat([q_nope, q_rope], dim=-1)
    key = torch.cat([rebuilt[..., :d], rope_key.expand(-1, heads, -1, -1)], dim=-1)
    out = F.scaled_dot_product_attention(query, key, rebuilt[..., d:], is_causal=True, scale=scaling)
    return out.transpose(1, 2).flatten(2) @ o_weight.T
