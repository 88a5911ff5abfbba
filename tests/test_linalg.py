"""The float64 algebra of slim attention, against direct computation."""

from __future__ import annotations

import pytest
import torch

from kvconvert import linalg

F64 = torch.float64


def test_key_to_value_map_square():
    torch.manual_seed(0)
    wk, wv = torch.randn(32, 32, dtype=F64), torch.randn(32, 32, dtype=F64)
    x = torch.randn(100, 32, dtype=F64)
    m = linalg.key_to_value_map(wk, wv)
    torch.testing.assert_close((x @ wk.T) @ m.T, x @ wv.T, rtol=1e-9, atol=1e-9)


def test_key_to_value_map_right_inverse_for_wide_keys():
    """Paper §5 option 1: e > d uses W_K⁻¹ = W_Kᵀ(W_K W_Kᵀ)⁻¹; V is still exact."""
    torch.manual_seed(1)
    wk, wv = torch.randn(48, 32, dtype=F64), torch.randn(48, 32, dtype=F64)  # e = 48 > d = 32
    x = torch.randn(100, 32, dtype=F64)
    m = linalg.key_to_value_map(wk, wv)
    assert m.shape == (48, 48)
    torch.testing.assert_close((x @ wk.T) @ m.T, x @ wv.T, rtol=1e-9, atol=1e-9)


def test_narrow_keys_are_rejected():
    with pytest.raises(ValueError):
        linalg.key_to_value_map(torch.randn(16, 32), torch.randn(16, 32))


def test_bias_folding_reproduces_attention_output():
    """softmax-weighted V with biases, then W_O, equals slim's K·W_KV path with the folded bias."""
    torch.manual_seed(2)
    d, e, n = 16, 16, 9
    wk, wv, wo = (torch.randn(e, d, dtype=F64) for _ in range(3))
    bk, bv, bo = torch.randn(e, dtype=F64), torch.randn(e, dtype=F64), torch.randn(d, dtype=F64)
    x = torch.randn(n, d, dtype=F64)
    p = torch.softmax(torch.randn(n, dtype=F64), dim=0)  # any attention row sums to one
    reference = wo @ (p @ (x @ wv.T + bv)) + bo
    m = linalg.key_to_value_map(wk, wv)
    folded = linalg.fold_value_bias(bv, bk, m, wo, bo)
    k = x @ wk.T + bk  # the cache holds biased keys
    torch.testing.assert_close(wo @ ((p @ k) @ m.T) + folded, reference, rtol=1e-9, atol=1e-9)


def test_condition_number():
    assert linalg.condition_number(torch.diag(torch.tensor([4.0, 2.0, 0.5]))) == pytest.approx(8.0)
    assert linalg.condition_number(torch.zeros(2, 2)) == float("inf")


@pytest.mark.parametrize("decades", [0, 3, 6])
def test_condition_number_from_lu_matches_the_svd(decades):
    """Lanczos on AᵀA and (AᵀA)⁻¹ through the LU factor: the SVD's κ to 1e-9, from well- to badly-conditioned."""
    g = torch.Generator().manual_seed(decades)
    n = 96
    left, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    right, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    spectrum = torch.logspace(0, decades, n, dtype=F64) * (1 + torch.rand(n, generator=g, dtype=F64))
    a = left @ torch.diag(spectrum) @ right.T
    a = a + torch.randn(n, n, generator=g, dtype=F64) * (decades == 0)  # a plain random matrix too
    exact = linalg.condition_number(a)
    assert linalg.condition_number_from_lu(a, linalg.lu_factor(a)) == pytest.approx(exact, rel=1e-9)


def test_largest_eigenvalue_of_an_operator():
    spectrum = torch.linspace(0.1, 5.0, 300, dtype=F64)
    assert linalg.largest_eigenvalue(lambda v: spectrum * v, 300) == pytest.approx(5.0, rel=1e-10)


def test_key_to_value_map_with_a_shared_factor_is_the_same_bits():
    wk, wv = torch.randn(32, 32, dtype=F64), torch.randn(32, 32, dtype=F64)
    shared = linalg.key_to_value_map(wk, wv, linalg.lu_factor(wk.T))
    assert torch.equal(shared, linalg.key_to_value_map(wk, wv))
    assert torch.equal(shared, torch.linalg.solve(wk.T, wv.T).T)  # what slim wrote before the factor was shared


def _anisotropic_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """Inputs whose channels differ in scale by 10³, as hidden states do (a few outlier channels)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, 3, d, dtype=torch.float64)[torch.randperm(d, generator=g)]
    return torch.randn(n, d, generator=g, dtype=torch.float64) * scales


@pytest.mark.parametrize("shape", [(24, 32), (32, 32), (40, 16)])
def test_whitened_truncation_is_the_least_squares_optimum(shape):
    """Activation-aware truncation (LoRC --calib): the output error on the calibration inputs equals the
    Eckart–Young optimum of the outputs Y = XWᵀ, is ≤ plain weight truncation's, and the factors are the
    explicit least-squares solution of X·Ŵᵀ = Y_r."""
    m, d = shape
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(m, d, generator=g, dtype=torch.float64)
    x = _anisotropic_inputs(200, d, seed=2)
    right = linalg.gram_factor(x.T @ x)
    outputs = x @ weight.T
    u, s, vh = torch.linalg.svd(outputs, full_matrices=False)
    for rank in (1, min(m, d) // 2, min(m, d) - 1):
        up, down, _ = linalg.weighted_truncation(weight, rank, right)
        error = torch.linalg.norm(outputs - x @ (up @ down).T)
        optimum = s[rank:].pow(2).sum().sqrt()
        assert torch.isclose(error, optimum, rtol=1e-9), (rank, error, optimum)
        plain_up, plain_down, _ = linalg.weighted_truncation(weight, rank)
        assert error <= torch.linalg.norm(outputs - x @ (plain_up @ plain_down).T) * (1 + 1e-12)
        best = (u[:, :rank] * s[:rank]) @ vh[:rank]  # Y_r
        lstsq = torch.linalg.lstsq(x, best).solution.T  # Ŵ with X Ŵᵀ = Y_r
        assert torch.allclose(up @ down, lstsq, atol=1e-8 * float(weight.abs().max()))


def test_left_weighted_truncation_and_its_projector():
    """‖Lᵀ(W − Ŵ)R‖ reaches the tail of σ(LᵀWR); Π·W = Ŵ; a full-rank truncation is exact."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 24, generator=g, dtype=torch.float64)
    x = _anisotropic_inputs(100, 24, seed=4)
    right = linalg.gram_factor(x.T @ x)
    a = torch.randn(16, 16, generator=g, dtype=torch.float64)
    left = torch.linalg.cholesky(a @ a.T + torch.eye(16, dtype=torch.float64))
    for rank in (3, 9, 16):
        up, down, s = linalg.weighted_truncation(weight, rank, right, left)
        error = torch.linalg.norm(left.T @ (weight - up @ down) @ right)
        assert torch.isclose(error, s[rank:].pow(2).sum().sqrt(), rtol=1e-8, atol=1e-9 * float(s[0]))
        projector = linalg.truncation_projector(weight, rank, right, left)
        assert torch.allclose(projector @ weight, up @ down, atol=1e-9)
        a, b = linalg.truncation_factors(weight, rank, right, left)
        assert torch.allclose(a, up) and torch.allclose(b @ weight, down, atol=1e-9)
        energy = linalg.tail_energy(s)
        assert energy[0] == 1 and energy[-1] == 0 and (energy[:-1] >= energy[1:]).all()
    assert torch.allclose(up @ down, weight, atol=1e-9)  # rank 16 = full


def test_output_gram_matches_the_per_head_sum():
    """Σ over a group's query heads of W_Oʰᵀ W_Oʰ, checked head by head (GQA: 4 query heads, 2 groups)."""
    g = torch.Generator().manual_seed(5)
    o = torch.randn(12, 4 * 3, generator=g, dtype=torch.float64)  # D = 12, H = 4, dk = 3
    gram = linalg.output_gram(o, heads=4, kv_heads=2, head_dim=3)
    for group in range(2):
        expected = sum(o[:, h * 3 : (h + 1) * 3].T @ o[:, h * 3 : (h + 1) * 3] for h in (2 * group, 2 * group + 1))
        assert torch.allclose(gram[group], expected)
    factor = linalg.block_cholesky(gram)
    assert torch.allclose(factor @ factor.T, torch.block_diag(*gram), rtol=1e-6)


def test_greedy_allocation_is_optimal_on_convex_curves():
    """allocate_ranks against exhaustive search over every split of the total (convex tail curves)."""
    import itertools

    g = torch.Generator().manual_seed(6)
    curves = []
    for scale in (1.0, 5.0, 0.2):
        s = torch.sort(torch.rand(5, generator=g, dtype=torch.float64), descending=True).values
        curves.append(scale * linalg.tail_energy(s))
    for total in range(3, 16):
        ranks = linalg.allocate_ranks(curves, total)
        assert sum(ranks) == total and all(1 <= r <= 5 for r in ranks)
        cost = sum(float(c[r]) for c, r in zip(curves, ranks, strict=True))
        best = min(sum(float(c[r]) for c, r in zip(curves, combo, strict=True))
                   for combo in itertools.product(range(1, 6), repeat=3) if sum(combo) == total)  # fmt: skip
        assert cost <= best + 1e-12
    with pytest.raises(ValueError):
        linalg.allocate_ranks(curves, 2)


def test_loss_curve_is_exact_at_its_probes():
    """One probe scales the energy (first order); two fit a·E^p through both, so a loss that really
    follows a power of the energy is recovered at every rank; a probe that left nothing out is skipped."""
    energy = linalg.tail_energy(torch.linspace(3.0, 0.5, 12))
    true = 0.7 * energy**1.8
    one = linalg.loss_curve(energy, [(6, float(true[6]))])
    assert torch.allclose(one, float(true[6]) / float(energy[6]) * energy) and one[6] == pytest.approx(true[6])
    two = linalg.loss_curve(energy, [(6, float(true[6])), (2, float(true[2]))])
    assert torch.allclose(two, true, rtol=1e-9, atol=0)
    steep = linalg.loss_curve(energy, [(6, 1e-6), (2, 10.0)])  # p far above 4: kept at 4, exact at the last probe
    assert steep[2] == pytest.approx(10.0) and steep[6] > 1e-6
    assert torch.equal(linalg.loss_curve(energy, [(12, 0.3), (6, float(true[6]))]), one)
    assert bool((linalg.loss_curve(energy, [(6, 0.0)]) < 1e-8).all())


@pytest.mark.parametrize("shape", [(48, 160), (96, 96), (160, 48)])
def test_left_singular_matches_the_svd(shape):
    """Wide and square through the Gram's eigen-decomposition, tall by the SVD: the same σ and the
    same kept subspaces as torch's SVD, also for a matrix of lower rank (a dead input channel)."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(*shape, generator=gen, dtype=torch.float64) * torch.logspace(0, -5, shape[1], dtype=torch.float64)
    m[:, 3] = 0.0
    u, s = linalg.left_singular(m)
    u_ref, s_ref, _ = torch.linalg.svd(m, full_matrices=False)
    assert torch.allclose(s, s_ref, rtol=0, atol=1e-7 * float(s_ref[0]))
    assert torch.allclose(linalg.weighted_singular_values(m), s_ref, rtol=0, atol=1e-7 * float(s_ref[0]))
    assert torch.allclose(u.T @ u, torch.eye(u.shape[1], dtype=torch.float64), atol=1e-12)
    for rank in (1, min(shape) // 3, min(shape) - 2):
        projector = u[:, :rank] @ u[:, :rank].T
        # optimal: it leaves out exactly the tail energy (to float64 rounding of σ₁²), however close σ_r, σ_r+1
        left_out = float(((m - projector @ m) ** 2).sum())
        assert left_out == pytest.approx(float((s_ref[rank:] ** 2).sum()), rel=1e-6, abs=1e-13 * float(s_ref[0]) ** 2)
        if s_ref[rank - 1] > 1e-3 * s_ref[0]:  # well above rounding: the same directions as the SVD's
            assert torch.allclose(projector, u_ref[:, :rank] @ u_ref[:, :rank].T, atol=1e-9)


@pytest.mark.parametrize("shape", [(96, 96), (48, 160), (160, 48)])
@pytest.mark.parametrize("decades", [0, 3, 6])
def test_kappa_matches_the_svd(shape, decades):
    """``kappa``'s cheaper routes (LU + Lanczos when square, the Gram's eigenvalues up to κ = 1e4, else the
    SVD) give the SVD's κ, also past where the Gram would lose it, and inf for a singular weight."""
    g = torch.Generator().manual_seed(decades)
    m, n = shape
    left, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=g, dtype=F64))
    right, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=g, dtype=F64))
    spectrum = torch.logspace(0, -decades, min(m, n), dtype=F64) * (1 + torch.rand(min(m, n), generator=g, dtype=F64))
    a = left @ torch.diag(spectrum) @ right.T
    assert linalg.kappa(a) == pytest.approx(linalg.condition_number(a), rel=1e-6)
    a[:, :] = a[:1, :] if m <= n else a[:, :1]  # rank one
    assert linalg.kappa(a) > 1e12 or linalg.kappa(a) == float("inf")
