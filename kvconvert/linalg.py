"""Pure float64 linear algebra used by the methods. No module state, no I/O.

Weights follow torch's ``nn.Linear`` convention, ``y = x @ W.T + b`` with ``W: [out, in]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

F64 = torch.float64


def condition_number(weight: torch.Tensor) -> float:
    """κ(W) = σ_max / σ_min of a 2-D weight, computed in float64 (inf when rank-deficient)."""
    singular_values = torch.linalg.svdvals(weight.to(F64))
    smallest = float(singular_values[-1])
    return float("inf") if smallest == 0.0 else float(singular_values[0]) / smallest


def kappa(weight: torch.Tensor) -> float:
    """κ(W) like ``condition_number``, by the cheapest exact-enough route (a method's plan reads it for
    every layer and side: on 2 cores the SVD of a 1024 × 4096 weight takes 1.4 s). Square: Lanczos through
    the LU factor (``condition_number_from_lu``, 1e-9). Otherwise the eigenvalues of the Gram of the
    shorter side, κ² = λ_max/λ_min, while λ_min > 1e-8·λ_max (κ ≤ 1e4; their rounding, ~√n·1e-16·λ_max,
    then moves κ by ≤ 1e-6 relative), else the SVD."""
    w = weight.to(F64)
    if w.shape[0] == w.shape[1]:
        try:
            return condition_number_from_lu(w, lu_factor(w))
        except RuntimeError:  # an exactly zero pivot
            return float("inf")
    eigenvalues = torch.linalg.eigvalsh(w @ w.T if w.shape[0] < w.shape[1] else w.T @ w)
    smallest, largest = float(eigenvalues[0]), float(eigenvalues[-1])
    if smallest > 1e-8 * largest:
        return math.sqrt(largest / smallest)
    return condition_number(w)


def largest_eigenvalue(
    apply: Callable[[torch.Tensor], torch.Tensor], n: int, seed: int = 0, rtol: float = 1e-10, max_steps: int = 200
) -> float:
    """Largest eigenvalue of a symmetric positive semi-definite operator ``v ↦ apply(v)`` on ``R^n``.

    Lanczos with full reorthogonalisation (twice, so the basis stays orthogonal in float64), stopped
    when the largest Ritz value moves by less than ``rtol``; Ritz values approach the extreme eigenvalues
    from inside, so the estimate is a lower bound that converges quickly (k matrix-vector products
    instead of an O(n³) decomposition; 45–70 for 1024–4096-wide random weights, 1e-11 relative).
    """
    basis = torch.empty(min(max_steps, n), n, dtype=F64)
    q = torch.randn(n, dtype=F64, generator=torch.Generator().manual_seed(seed))
    q /= q.norm()
    alpha: list[float] = []
    beta: list[float] = []
    estimate = 0.0
    for step in range(basis.shape[0]):
        basis[step] = q
        w = apply(q)
        alpha.append(float(w @ q))
        kept = basis[: step + 1]
        w -= kept.T @ (kept @ w)
        w -= kept.T @ (kept @ w)
        tridiagonal = torch.diag(torch.tensor(alpha, dtype=F64))
        if beta:
            off = torch.tensor(beta, dtype=F64)
            tridiagonal += torch.diag(off, 1) + torch.diag(off, -1)
        previous, estimate = estimate, float(torch.linalg.eigvalsh(tridiagonal)[-1])
        norm = float(w.norm())
        if abs(estimate - previous) <= rtol * estimate or norm <= 1e-12 * estimate:
            break  # converged, or the Krylov space is invariant (its Ritz values are exact)
        beta.append(norm)
        q = w / norm
    return estimate


def lu_factor(square: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LU factorisation (with pivots) of a square matrix in float64, for ``key_to_value_map`` and
    ``condition_number_from_lu`` to share."""
    return torch.linalg.lu_factor(square.to(F64))


def condition_number_from_lu(square: torch.Tensor, factor: tuple[torch.Tensor, torch.Tensor]) -> float:
    """κ(A) = σ_max / σ_min of a square ``A`` from its LU factor (``lu_factor(A)``), in float64.

    σ_max² and 1/σ_min² are the largest eigenvalues of AᵀA and (AᵀA)⁻¹, found by Lanczos
    (``largest_eigenvalue``): the LU factor the solve needs anyway turns each step into two triangular
    solves, so this costs O(k·n²) where ``condition_number``'s SVD costs O(n³) (7× less at n = 4096).
    Agrees with the SVD to about 1e-10 relative (tested).
    """
    a = square.to(F64)
    lu, pivots = factor

    def inverse_gram(v: torch.Tensor) -> torch.Tensor:  # (AᵀA)⁻¹ v = A⁻¹ A⁻ᵀ v
        w = torch.linalg.lu_solve(lu, pivots, v[:, None], adjoint=True)
        return torch.linalg.lu_solve(lu, pivots, w)[:, 0]

    u_diagonal = lu.diagonal()  # U's diagonal: a zero or non-finite entry means A is singular (or not finite)
    if not bool(torch.isfinite(u_diagonal).all()) or bool((u_diagonal == 0).any()):
        return float("inf")
    largest = largest_eigenvalue(lambda v: a.T @ (a @ v), a.shape[1])
    inverse_smallest = largest_eigenvalue(inverse_gram, a.shape[1], seed=1)
    return math.sqrt(largest * inverse_smallest)


def key_to_value_map(
    k_weight: torch.Tensor, v_weight: torch.Tensor, factor: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Slim attention's W_KV (paper eq. 4) in Linear convention.

    Args:
        k_weight: W_K as Linear weight, ``[e, d]`` with ``e >= d`` (square for standard MHA).
        v_weight: W_V as Linear weight, ``[e_v, d]``.
        factor: for square W_K, ``lu_factor(k_weight.T)`` if the caller has it (same result, bit for bit).

    Returns:
        ``[e_v, e]`` float64 weight ``M`` such that ``v = k @ M.T`` for every ``k = x @ W_K.T``.
        In the paper's row-vector notation ``M.T = W_K⁻¹·W_V`` with ``W_K = k_weight.T``; for
        ``e > d`` the right inverse ``W_K⁻¹ = W_Kᵀ(W_K W_Kᵀ)⁻¹`` of paper §5 option 1 is used.
    """
    a_k = k_weight.to(F64).T  # [d, e], row-vector convention: k = x @ a_k
    a_v = v_weight.to(F64).T  # [d, e_v]
    d, e = a_k.shape
    if e < d:
        raise ValueError(f"W_K maps {d} inputs to only {e} outputs; it has no right inverse")
    if e == d:
        lu, pivots = factor if factor is not None else lu_factor(a_k)
        w_kv = torch.linalg.lu_solve(lu, pivots, a_v)  # [e, e_v] = a_k⁻¹ a_v (torch's solve, split in two)
    else:
        w_kv = a_k.T @ torch.linalg.solve(a_k @ a_k.T, a_v)  # right inverse, paper §5
    return w_kv.T.contiguous()


def fold_value_bias(
    v_bias: torch.Tensor | None,
    k_bias: torch.Tensor | None,
    kv_weight: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """Output bias that absorbs the constant part of V = K·W_KV (paper §4), exactly.

    With biases, ``v = (k - b_k) @ M.T + b_v = k @ M.T + c`` where ``c = b_v - b_k @ M.T``.
    Attention weights sum to one, so ``c`` passes through attention unchanged and then
    through the output projection: ``b_o' = b_o + W_O @ c``.

    Shapes: v_bias ``[e_v]``, k_bias ``[e]``, kv_weight ``[e_v, e]``, o_weight ``[d, e_v]``,
    o_bias ``[d]``. Returns ``[d]`` float64, or None when there is nothing to fold.
    """
    if v_bias is None and k_bias is None:
        return None if o_bias is None else o_bias.to(F64)
    c = torch.zeros(kv_weight.shape[0], dtype=F64)
    if v_bias is not None:
        c = c + v_bias.to(F64)
    if k_bias is not None:
        c = c - kv_weight.to(F64) @ k_bias.to(F64)
    folded = o_weight.to(F64) @ c
    return folded if o_bias is None else folded + o_bias.to(F64)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖_F / ‖exact‖_F in float64."""
    exact64 = exact.to(F64)
    denom = float(torch.linalg.norm(exact64))
    return float(torch.linalg.norm(approx.to(F64) - exact64)) / max(denom, 1e-300)


def gram_factor(gram: torch.Tensor) -> torch.Tensor:
    """A square root ``S`` of a Gram matrix, ``S Sᵀ = gram``, float64 (eigen-decomposition, not Cholesky:
    a rank-deficient Gram, e.g. a hidden state with a dead channel, needs no damping because ``S`` is
    never inverted)."""
    gram = gram.to(F64)
    eigenvalues, vectors = torch.linalg.eigh((gram + gram.T) / 2)
    return vectors * eigenvalues.clamp(min=0).sqrt()


def left_singular(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U [m, k], σ [k])`` of ``matrix [m, n]``, float64, σ descending, ``k = min(m, n)``: all a
    truncation needs. A wide or square matrix (every K/V weight: outputs ≤ hidden size) takes the
    eigen-decomposition of its Gram ``M Mᵀ [m, m]`` — 2× faster than the SVD at 1024 × 1024 and 6× at
    1024 × 4096 on 2 cores; in float64 the kept directions move by ~1e-16·σ₁²/(σ_r² − σ_{r+1}²) and σ is
    exact to ~1e-8·σ₁ (tested against the SVD). A tall one (a stacked K+V latent wider than the hidden
    size) is decomposed directly: U from its Gram's other side would need 1/σ."""
    if matrix.shape[0] > matrix.shape[1]:
        u, s, _ = torch.linalg.svd(matrix, full_matrices=False)
        return u, s
    eigenvalues, vectors = torch.linalg.eigh(matrix @ matrix.T)  # ascending; reads the lower triangle
    return vectors.flip(-1), eigenvalues.flip(-1).clamp(min=0).sqrt()


def weighted_singular_values(
    weight: torch.Tensor, right: torch.Tensor | None = None, left: torch.Tensor | None = None
) -> torch.Tensor:
    """σ of ``Lᵀ W R`` (``weighted_truncation``'s spectrum, without its vectors), descending, float64."""
    m = _weighted(weight.to(F64), right, left)
    if m.shape[0] > m.shape[1]:
        return torch.linalg.svdvals(m)
    return torch.linalg.eigvalsh(m @ m.T).flip(-1).clamp(min=0).sqrt()


def _weighted(w: torch.Tensor, right: torch.Tensor | None, left: torch.Tensor | None) -> torch.Tensor:
    """``Lᵀ W R`` (a missing factor: the identity)."""
    m = w if left is None else left.to(F64).T @ w
    return m if right is None else m @ right.to(F64)


def weighted_truncation(
    weight: torch.Tensor, rank: int, right: torch.Tensor | None = None, left: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-``rank`` ``W [m, n] ≈ up @ down`` minimising ``‖Lᵀ(W − up·down)R‖_F``, float64.

    ``right R [n, n]`` with ``R Rᵀ = XᵀX`` (``gram_factor`` of the inputs' Gram) makes the objective the
    error of the outputs ``‖(W − Ŵ)xᵢ‖`` summed over the calibration inputs (SVD-LLM's truncation-aware
    whitening); ``left L [m, m]`` with ``L Lᵀ = G`` weights the outputs by what reads them (G = W_Oᵀ W_O
    for values). By Eckart–Young the optimum is the truncated SVD ``M_r`` of ``M = Lᵀ W R = UΣVᵀ``:
    ``up = L⁻ᵀ U_r`` and ``down = U_rᵀ Lᵀ W`` (so ``Lᵀ·up·down·R = U_r U_rᵀ M = M_r``, and R is never
    inverted). ``left`` must be invertible. Returns ``(up [m, r], down [r, n], σ(M) [min(m, n)])``;
    without weights ``up = U_r`` (orthonormal) and ``down = Σ_r V_rᵀ``: LoRC's factors, for which
    ``‖W x − up down x‖ ≤ σ_{r+1}‖x‖`` (LoRC thm. 1).
    """
    w = weight.to(F64)
    u, s = left_singular(_weighted(w, right, left))
    if not 1 <= rank <= s.numel():
        raise ValueError(f"rank {rank} outside [1, {s.numel()}]")
    u_r = u[:, :rank]
    if left is None:
        return u_r.contiguous(), (u_r.T @ w).contiguous(), s
    up = torch.linalg.solve(left.to(F64).T, u_r)  # L⁻ᵀ U_r
    return up.contiguous(), (u_r.T @ (left.to(F64).T @ w)).contiguous(), s


def joint_truncation(
    weights: list[torch.Tensor], scales: list[float], rank: int, right: torch.Tensor | None = None,
    lefts: list[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:  # fmt: skip
    """One rank-``rank`` latent for several outputs of the same input (keys and values, MLA-style):
    ``W_i [m_i, n] ≈ up_i @ down`` with a single ``down [r, n]``, minimising
    ``Σ_i scales_i·‖L_iᵀ(W_i − up_i·down)R‖²_F`` — ``weighted_truncation`` of the stacked
    ``[W_1; W_2; …]`` with the block-diagonal left factor ``blockdiag(√scales_i·L_i)`` (``None``: identity).
    Where the outputs read the same directions of the input, one latent serves them all: the optimum is
    never worse than separate latents whose ranks sum to ``rank`` (those are one feasible stacked
    factorisation). Returns ``([up_i [m_i, r]], down [r, n], σ of the stacked weighted matrix)``."""
    stacked, left = stacked_weights(weights, scales, lefts)
    up, down, singular_values = weighted_truncation(stacked, rank, right, left)
    return list(up.split([w.shape[0] for w in weights])), down, singular_values


def stacked_weights(
    weights: list[torch.Tensor], scales: list[float], lefts: list[torch.Tensor | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([W_1; W_2; …], blockdiag(√scales_i·L_i))`` float64: the matrix and left factor whose
    ``weighted_truncation`` is ``joint_truncation`` (``truncation_factors`` of them: its ``Π`` on the
    stacked outputs)."""
    lefts = lefts or [None] * len(weights)
    blocks = [(torch.eye(w.shape[0], dtype=F64) if left is None else left.to(F64)) * math.sqrt(scale)
              for w, left, scale in zip(weights, lefts, scales, strict=True)]  # fmt: skip
    return torch.cat([w.to(F64) for w in weights]), torch.block_diag(*blocks)


def loss_per_energy(singular_values: torch.Tensor, probes: list[tuple[int, float]]) -> float | None:
    """A side's measured loss per unit of the weighted energy its truncation leaves out, ``loss/Σ_{i≥r}σᵢ²``
    at its first probe ``(r, loss)`` (``loss_curve``'s first-order scale, in absolute energy): the weight
    that puts several sides' truncation errors into one loss (``joint_truncation``'s ``scales``). None
    when the probe left nothing out or measured no loss."""
    rank, loss = probes[0]
    left_out = float((singular_values.to(F64)[rank:] ** 2).sum())
    return loss / left_out if left_out > 0 and loss > 0 else None


def truncation_factors(
    weight: torch.Tensor, rank: int, right: torch.Tensor | None = None, left: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [m, r], B [r, m])`` with ``up = A`` and ``down = B·W`` for ``weighted_truncation(weight, rank,
    right, left)``: ``A = L⁻ᵀ U_r``, ``B = U_rᵀ Lᵀ`` (``U_r`` and ``U_rᵀ`` without ``left``). The truncation
    acts on the outputs ``Wx`` as ``Π = A·B``, so a search can simulate it inside the source and a
    refinement can adjust it there (``methods.lorc.refine``)."""
    u_r = left_singular(_weighted(weight.to(F64), right, left))[0][:, :rank]
    if left is None:
        return u_r.contiguous(), u_r.T.contiguous()
    return torch.linalg.solve(left.to(F64).T, u_r), (u_r.T @ left.to(F64).T).contiguous()


def truncation_projector(
    weight: torch.Tensor, rank: int, right: torch.Tensor | None = None, left: torch.Tensor | None = None
) -> torch.Tensor:
    """``Π [m, m]`` with ``up·down = Π·W`` for ``weighted_truncation(weight, rank, right, left)``:
    ``Π = L⁻ᵀ U_r U_rᵀ Lᵀ`` (``U_r U_rᵀ`` without ``left``). Applied to the outputs ``Wx`` it gives
    what the truncated weight would, so a search can simulate the truncation inside the source."""
    a, b = truncation_factors(weight, rank, right, left)
    return a @ b


def output_gram(o_weight: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Σ over each KV group's query heads of W_Oʰᵀ W_Oʰ: ``[Hkv, dk, dk]`` float64 — what the output
    projection makes of an error in that group's values (``o_weight [D, H·dk]``, Linear; query head h
    reads columns ``h·dk:(h+1)·dk``, heads of a group adjacent)."""
    # one contraction over D and the group together, not head_output_grams summed per group: the float64 sums of
    # the outputs written before head_output_grams existed stay bit for bit (tests/test_recipe_outputs.py)
    blocks = o_weight.to(F64).view(-1, kv_heads, heads // kv_heads, head_dim)  # [D, Hkv, G, dk]
    return torch.einsum("xgjd,xgje->gde", blocks, blocks)


def head_output_grams(o_weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """W_Oʰᵀ W_Oʰ per query head: ``[H, dk, dk]`` float64, so ``eᵀ G_h e = ‖W_Oʰ e‖²`` is what the output
    projection makes of an error ``e`` in head h's attention output (``o_weight [D, H·dk]``, Linear)."""
    blocks = o_weight.to(F64).view(-1, heads, head_dim)  # [D, H, dk]
    return torch.einsum("xhd,xhe->hde", blocks, blocks)


def block_cholesky(grams: torch.Tensor, ridge: float = 1e-9) -> torch.Tensor:
    """Block-diagonal lower factor ``L [g·d, g·d]`` with ``L Lᵀ = blockdiag(grams [g, d, d])``, float64.
    A ridge of ``ridge``·(mean diagonal) keeps a singular block invertible (``weighted_truncation``
    inverts its ``left`` factor)."""
    grams = grams.to(F64)
    scale = float(grams.diagonal(dim1=-2, dim2=-1).mean()) or 1.0
    eye = torch.eye(grams.shape[-1], dtype=F64)
    return torch.block_diag(*torch.linalg.cholesky(grams + ridge * scale * eye))


def tail_energy(singular_values: torch.Tensor) -> torch.Tensor:
    """``E[r] = Σ_{i ≥ r} σᵢ² / Σ σᵢ²`` for r = 0..len (E[0] = 1, E[len] = 0): the share of a weighted
    matrix's energy a rank-r truncation loses, non-increasing and convex in r."""
    energy = singular_values.to(F64) ** 2
    tail = torch.cat([energy.flip(0).cumsum(0).flip(0), energy.new_zeros(1)])
    return tail / tail[0].clamp(min=1e-300)


def loss_curve(energy: torch.Tensor, probes: list[tuple[int, float]]) -> torch.Tensor:
    """Predicted loss at every rank r = 0..len−1 of a side whose truncation leaves ``energy[r]`` out
    (``tail_energy``), from losses measured at one or two ranks ``probes = [(r, loss), …]``.

    One probe: ``loss/E(r0) · E`` (first order: a KL is quadratic in a small perturbation, like E).
    Two: ``a·E^p`` through both, p from their ratio and kept in [1/4, 4] against noise, so an allocation
    that moved far from the first probe is scored through a point measured where it went. Probes whose
    rank leaves nothing out (E = 0) or whose loss vanished carry no scale and are skipped."""
    points = [(float(energy[r]), loss) for r, loss in probes if float(energy[r]) > 0 and loss > 0]
    if not points:
        return 1e-9 * energy  # nothing measurable: rank by energy alone, at a tiny weight
    (e0, l0), (e1, l1) = points[0], points[-1]
    if len(points) == 1 or abs(math.log(e1 / e0)) < 1e-6:
        return l0 / e0 * energy
    power = min(max(math.log(l1 / l0) / math.log(e1 / e0), 0.25), 4.0)
    return l1 * (energy.clamp(min=0) / e1) ** power


def allocate_ranks(losses: list[torch.Tensor], total: int, low: int = 1) -> list[int]:
    """Ranks ``r_i`` (``low <= r_i <= len(losses[i]) − 1``) summing to ``total`` that minimise
    ``Σ losses[i][r_i]``, each ``losses[i]`` non-increasing and convex in r (e.g. ``c·tail_energy``).

    Greedy removal by the smallest marginal loss, from full rank down: optimal for separable convex
    costs with one unit of cache per rank. Raises ``ValueError`` when ``total`` is out of reach.
    """
    import heapq

    ranks = [len(curve) - 1 for curve in losses]
    if not low * len(ranks) <= total <= sum(ranks):
        raise ValueError(f"total {total} outside [{low * len(ranks)}, {sum(ranks)}]")
    heap = [(float(c[r - 1] - c[r]), i) for i, (c, r) in enumerate(zip(losses, ranks, strict=True)) if r > low]
    heapq.heapify(heap)
    for _ in range(sum(ranks) - total):
        _, i = heapq.heappop(heap)
        ranks[i] -= 1
        if ranks[i] > low:
            heapq.heappush(heap, (float(losses[i][ranks[i] - 1] - losses[i][ranks[i]]), i))
    return ranks


def relative_frobenius_error(singular_values: torch.Tensor, rank: int) -> float:
    """‖W − W_r‖_F / ‖W‖_F of the best rank-``rank`` approximation, from W's singular values."""
    energy = singular_values.to(F64) ** 2
    return float(energy[rank:].sum().sqrt() / energy.sum().sqrt())


def log_cumulative_condition(kappa_k: list[float], kappa_v: list[float]) -> list[float]:
    """ln κ̃_l = Σ_{j ≥ l} ln κ(W_K^j) + ln κ(W_V^j) (LoRC eq. 12 in log space: κ̃ itself overflows)."""
    logs = [math.log(k) + math.log(v) for k, v in zip(kappa_k, kappa_v, strict=True)]
    return [sum(logs[layer:]) for layer in range(len(logs))]


def principal_basis(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation and singular values of a stacked activation matrix from its Gram matrix.

    For ``A [n, d]`` with ``gram = AᵀA``, returns ``(R [d, d], s [d])`` with ``A = UΣRᵀ``: R's columns are
    orthonormal, ordered by descending singular value ``s = sqrt(eig(AᵀA))``. Signs are fixed so
    that each column's largest-magnitude entry is positive, which makes two fits comparable entry by
    entry (ZACK §4.3 compares rotations element-wise).
    """
    gram = gram.to(F64)
    gram = (gram + gram.T) / 2  # accumulated sums drift from exact symmetry
    eigenvalues, vectors = torch.linalg.eigh(gram)
    order = torch.argsort(eigenvalues, descending=True)
    eigenvalues, vectors = eigenvalues[order], vectors[:, order]
    pivot = vectors.abs().argmax(dim=0)
    signs = torch.sign(vectors[pivot, torch.arange(vectors.shape[1])])
    signs[signs == 0] = 1.0
    return (vectors * signs).contiguous(), eigenvalues.clamp(min=0).sqrt()


def rank_for_removal_rate(singular_values: torch.Tensor, removal_rate: float) -> int:
    """ZACK eq. 6: keep dims ``0..j`` where j satisfies ``Σ_{i>j} s_i ≤ r·Σ s_i < Σ_{i≥j} s_i``.

    ``singular_values`` sorted descending; returns the kept width ``j + 1`` (at least 1). ``r = 0``
    keeps every dimension with a non-zero singular value.
    """
    s = singular_values.to(F64)
    total = float(s.sum())
    if total == 0.0:
        return 1
    # tail[k] = Σ_{i ≥ k} s_i for k = 0..d (tail[d] = 0): the mass removed when keeping k dims
    tail = torch.cat([s.flip(0).cumsum(0).flip(0), s.new_zeros(1)])
    allowed = removal_rate * total
    keep = int(torch.nonzero(tail <= allowed)[0])  # tail is non-increasing: first k that fits
    return max(1, keep)


def rotation_difference(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """ZACK §4.3 / table 4: (ε, δ) = (mean |R̄|, mean |R̄ − R|) over all entries, float64.

    Columns are sign-aligned first (an eigenvector is only defined up to sign)."""
    reference, other = reference.to(F64), other.to(F64)
    signs = torch.sign((reference * other).sum(dim=-2, keepdim=True))
    signs[signs == 0] = 1.0
    return float(reference.abs().mean()), float((reference - other * signs).abs().mean())


def captured_energy(basis: torch.Tensor, rank: int, other_basis: torch.Tensor, other_spectrum: torch.Tensor) -> float:
    """How well ``basis[:, :rank]`` (fitted on text A) keeps the activations of text B, relative to B's
    own best rank-``rank`` basis: ``‖Σ_B R_Bᵀ A_k‖²_F / Σ_{i<k} s_B,i²`` in (0, 1], float64.

    Unlike the element-wise δ, this does not depend on how a fit orders or rotates directions of
    (nearly) equal singular value, e.g. the pairs of dims RoPE turns together."""
    weighted = other_spectrum.to(F64)[:, None] * (other_basis.to(F64).T @ basis.to(F64)[:, :rank])
    best = float((other_spectrum.to(F64)[:rank] ** 2).sum())
    return 1.0 if best == 0 else float((weighted**2).sum()) / best


def shared_subspace(covariance: torch.Tensor, metrics: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted principal subspace of stacked states ``x = [x_1 … x_m]`` (xKV's cross-layer SVD, fitted
    offline on calibration data), float64.

    ``covariance [n, n]``: ``E[(x − μ)(x − μ)ᵀ]`` of the stacked states; ``metrics [g, d, d]`` (g·d = n):
    what an error in each block of d coordinates costs (``E[qqᵀ]`` of the queries that read a key head,
    ``W_Oʰᵀ W_Oʰ`` for a value head), so that the objective is ``E[(x − x̂)ᵀ M (x − x̂)]`` with
    ``M = blockdiag(metrics)``. With ``L Lᵀ = M`` (``block_cholesky``) and ``Lᵀ C L = U Λ Uᵀ``, the rank-r
    optimum is ``x̂ − μ = (x − μ)·L U_r·U_rᵀ L⁻¹`` and its loss is ``Σ_{i ≥ r} λ_i``. Returns
    ``(L [n, n], U [n, n], λ [n])``, λ descending.
    """
    lower = block_cholesky(metrics)
    gram = lower.T @ covariance.to(F64) @ lower
    eigenvalues, vectors = torch.linalg.eigh((gram + gram.T) / 2)
    order = torch.argsort(eigenvalues, descending=True)
    return lower, vectors[:, order].contiguous(), eigenvalues[order].clamp(min=0)


def subspace_factors(lower: torch.Tensor, vectors: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(encoder [n, r], decoder [r, n])`` of ``shared_subspace``'s rank-``rank`` optimum: the latent
    ``z = (x − μ)·encoder``, the states ``x̂ = μ + z·decoder`` (``encoder = L U_r``, ``decoder = U_rᵀ L⁻¹``;
    at full rank ``encoder·decoder = I``)."""
    u_r = vectors[:, :rank].to(F64)
    return (lower.to(F64) @ u_r).contiguous(), torch.linalg.solve_triangular(
        lower.to(F64).T, u_r, upper=True
    ).T.contiguous()
