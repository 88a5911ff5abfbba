"""ZACK (Zhang & Shen 2024): calibrated per-head rotations, adaptive ranks, attention in the compressed space.

Per layer and KV head, two orthogonal rotations are fitted offline on calibration text (§4.3,
fig. 9): R_QK from Q‖K stacked along the sequence (for GQA all query heads of the group with
their shared K) and R_VW from V‖W_Oʰᵀ. Scores are invariant to a rotation shared by q and k, and a
rotation of V is undone inside W_O, so truncating the rotated coordinates compresses the cache
without ever decompressing it (lemmas 1–2). One singular-value removal rate r shared by all heads
sets each head's width (eq. 6); ``kv_budget`` finds the r that meets a cache budget (the paper's f).
``schedule="auto"`` (kvconvert's extension) instead sets every head's width per side by measured
loss: one KL probe per layer and side scales its heads' spectra into loss curves, and one greedy
pass over all of them meets the budget (``plan_by_loss``), as ``lorc --schedule auto`` does for ranks.

V/O: R_VW is folded into W_V and W_O. Q/K: without RoPE R_QK is folded into W_Q and W_K; with
RoPE q and k are rotated after RoPE at run time (§5.1 "Rotary embedding") and the cache holds the
rotated, truncated keys. Per-head widths differ; the cache packs them without padding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvconvert import linalg
from kvconvert.arch import AttentionLayout, AttentionWeights, adapter_for
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import (
    LayerOutput,
    Method,
    PlanContext,
    budget_words,
    qk_norm_spec,
    qk_norm_tensors,
    rope_spec,
)
from kvconvert.methods.zack.config import ZackConfig


@dataclass
class HeadBases:
    """Per layer and KV head: bases ``[dk, dk]`` (columns by descending singular value) and spectra.

    The cache holds ``vw[:, :r]ᵀ v`` and W_O reads it through ``vw_out[:, :r]``: the same orthogonal
    rotation in the paper; with ``value_basis="output"`` an oblique pair (``vw_out·vwᵀ = I`` at full width)."""

    qk: list[list[torch.Tensor]]
    qk_spectrum: list[list[torch.Tensor]]
    vw: list[list[torch.Tensor]]
    vw_spectrum: list[list[torch.Tensor]]
    vw_out: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.vw_out:
            self.vw_out = self.vw


@dataclass(frozen=True)
class ZackWidths:
    """Every KV head's cached widths, and how they were chosen."""

    removal_rate: float | None  # None: widths by measured loss (schedule "auto")
    rank_k: list[list[int]]  # [layer][kv head]
    rank_v: list[list[int]]
    budget: float = field(default=0.0)
    # schedule "auto": per layer, KL to the source with only that side truncated at the probe widths
    probe_kl: dict[str, list[float]] = field(default_factory=dict)


def output_gram(o_weight: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """``linalg.output_gram`` for this layout: ``[Hkv, dk, dk]`` float64."""
    return linalg.output_gram(o_weight, layout.num_heads, layout.num_kv_heads, layout.head_dim)


def fit_bases(grams: Any, o_grams: list[torch.Tensor], value_basis: str = "paper") -> HeadBases:
    """R_QK and the V bases of every head from calibration Grams (``HeadGrams``) and ``output_gram``s.

    ``value_basis="output"``: per KV head g, ``linalg.weighted_truncation`` of the identity map v ↦ v
    with inputs weighted by V's Gram and outputs by ``O_g = Σ_h W_Oʰᵀ W_Oʰ``, so truncating to r dims
    minimises ``Σ_h ‖W_Oʰ (v − v̂)‖²`` over the calibration values: the attention output's error (before
    the softmax mixes tokens), which the paper's stacked V‖W_Oᵀ basis only approximates."""
    qk: list[list[torch.Tensor]] = []
    qk_s: list[list[torch.Tensor]] = []
    vw: list[list[torch.Tensor]] = []
    vw_s: list[list[torch.Tensor]] = []
    vw_out: list[list[torch.Tensor]] = []
    for layer, o_gram in enumerate(o_grams):
        pairs_qk = [linalg.principal_basis(grams.query[layer, g] + grams.key[layer, g]) for g in range(len(o_gram))]
        qk.append([r for r, _ in pairs_qk])
        qk_s.append([s for _, s in pairs_qk])
        if value_basis == "paper":
            pairs_vw = [linalg.principal_basis(grams.value[layer, g] + o_gram[g]) for g in range(len(o_gram))]
            vw.append([r for r, _ in pairs_vw])
            vw_s.append([s for _, s in pairs_vw])
            vw_out.append(vw[-1])
            continue
        fits = []
        for g in range(len(o_gram)):
            identity = torch.eye(o_gram.shape[-1], dtype=linalg.F64)
            right, left = linalg.gram_factor(grams.value[layer, g]), linalg.block_cholesky(o_gram[g][None])
            fits.append(linalg.weighted_truncation(identity, identity.shape[0], right, left))
        vw.append([down.T.contiguous() for _, down, _ in fits])  # cached: v ↦ down_r·v = vw[:, :r]ᵀ v
        vw_out.append([up for up, _, _ in fits])  # read back by W_O through up_r
        vw_s.append([s for _, _, s in fits])
    return HeadBases(qk, qk_s, vw, vw_s, vw_out)


def plan_for_rate(bases: HeadBases, removal_rate: float, head_dim: int, compress: str = "kv",
                  whole: frozenset[int] = frozenset()) -> ZackWidths:  # fmt: skip
    """Eq. 6 per head for one shared r; ``budget`` = Σ kept widths / (2·L·Hkv·dk) over the layers not in ``whole``
    (sliding-window layers, kept stock at every width: the budget is the global layers', as everywhere).

    ``compress`` names the truncated sides; the others keep all ``head_dim`` dims."""

    def widths(spectra: list[list[torch.Tensor]], truncated: bool) -> list[list[int]]:
        rate = removal_rate if truncated else 0.0
        return [[head_dim if i in whole or not truncated else linalg.rank_for_removal_rate(s, rate) for s in layer]
                for i, layer in enumerate(spectra)]  # fmt: skip

    rank_k = widths(bases.qk_spectrum, "k" in compress)
    rank_v = widths(bases.vw_spectrum, "v" in compress)
    cut = [i for i in range(len(rank_k)) if i not in whole]
    kept = sum(sum(rank_k[i]) + sum(rank_v[i]) for i in cut)
    full = 2 * head_dim * sum(len(rank_k[i]) for i in cut)
    return ZackWidths(removal_rate, rank_k, rank_v, budget=kept / full)


def plan_for_budget(bases: HeadBases, kv_budget: float, head_dim: int, compress: str = "kv",
                    steps: int = 60, whole: frozenset[int] = frozenset()) -> ZackWidths:  # fmt: skip
    """The paper's f: the smallest r whose cache fits ``kv_budget`` (budget falls as r grows); ``whole``: as
    ``plan_for_rate``'s."""
    if plan_for_rate(bases, 0.0, head_dim, compress, whole).budget <= kv_budget:
        return plan_for_rate(bases, 0.0, head_dim, compress, whole)
    floor = plan_for_rate(bases, 1.0, head_dim, compress, whole)
    if floor.budget > kv_budget:
        raise KVConvertError(
            f"kv_budget {kv_budget} is below what zack can reach with compress={compress} ({floor.budget:.4f}: "
            "one dim per truncated head)"
        )
    low, high = 0.0, 1.0  # budget(low) > kv_budget >= budget(high)
    for _ in range(steps):
        middle = (low + high) / 2
        if plan_for_rate(bases, middle, head_dim, compress, whole).budget <= kv_budget:
            high = middle
        else:
            low = middle
    return plan_for_rate(bases, high, head_dim, compress, whole)


def plan_by_loss(
    bases: HeadBases, kv_budget: float, head_dim: int, compress: str, probe: ZackWidths,
    probe_kl: dict[str, list[float]], whole: frozenset[int] = frozenset(),
) -> ZackWidths:  # fmt: skip
    """Widths per KV head and side that meet ``kv_budget`` at the least predicted loss (extension).

    Head g of layer l, side s, at width r is predicted to cost ``c_ls · T_lsg(r)``: T the energy its
    basis leaves out (``Σ_{i≥r} s_i²``, not normalised per head, so the heads of a layer compare) and
    ``c_ls = KL_ls / Σ_g T_lsg(probe width)`` from one probe, the source run with only that layer's
    side truncated at ``probe``'s widths (the paper's plan at this budget). KL is quadratic in a small
    perturbation, like T, so the model is first-order right and exact at the probe. One greedy pass
    over every curve (``linalg.allocate_ranks``) then meets the budget; an untruncated side keeps d, and so do the
    layers in ``whole`` (sliding-window layers, outside the budget)."""
    kv_heads = len(bases.qk[0])
    cut = [i for i in range(len(bases.qk)) if i not in whole]  # the layers whose widths are chosen
    layers = len(cut)
    sides = [side for side in "kv" if side in compress]
    spectra = {"k": bases.qk_spectrum, "v": bases.vw_spectrum}
    widths_at_probe = {"k": probe.rank_k, "v": probe.rank_v}
    curves: list[torch.Tensor] = []
    for side in sides:
        tails = [[linalg.tail_energy(s) * float(s.to(linalg.F64).pow(2).sum()) for s in spectra[side][i]]
                 for i in cut]  # fmt: skip
        at_probe = [sum(float(t[r]) for t, r in zip(layer, widths_at_probe[side][i], strict=True))
                    for layer, i in zip(tails, cut, strict=True)]  # fmt: skip
        # a probe that truncated nothing measures nothing: such a layer gets its side's largest scale
        scales = [max(probe_kl[side][i], 1e-9) / e if e > 0 else None for i, e in zip(cut, at_probe, strict=True)]
        fallback = max((c for c in scales if c is not None), default=1.0)
        for layer, scale in zip(tails, scales, strict=True):
            curves.extend((fallback if scale is None else scale) * t for t in layer)
    full = 2 * layers * kv_heads * head_dim
    free = round(kv_budget * full) - (2 - len(sides)) * layers * kv_heads * head_dim
    if free < len(curves):
        floor = ((2 - len(sides)) * layers * kv_heads * head_dim + len(curves)) / full
        raise KVConvertError(f"kv_budget {kv_budget} is below what zack can reach with compress={compress} "
                             f"({floor:.4f}: one dim per truncated head)")  # fmt: skip
    flat = linalg.allocate_ranks(curves, min(free, len(curves) * head_dim))
    widths = {side: [[head_dim] * kv_heads for _ in bases.qk] for side in "kv"}
    for j, side in enumerate(sides):
        for at, i in enumerate(cut):
            widths[side][i] = flat[(j * layers + at) * kv_heads : (j * layers + at + 1) * kv_heads]
    kept = sum(sum(widths["k"][i]) + sum(widths["v"][i]) for i in cut)
    return ZackWidths(None, widths["k"], widths["v"], budget=kept / full, probe_kl=probe_kl)


def calibrate_bases(
    source: Any,
    layout: AttentionLayout,
    layers: Iterable[AttentionWeights],
    calib: str | None,
    tokens: int,
    chunk_len: int,
    seed: int,
    progress: bool = True,
    value_basis: str = "paper",
) -> tuple[HeadBases, Any]:
    """Run ``source`` over calibration text layer by layer and fit every head's R_QK and R_VW.

    Returns the bases and the ``CalibrationSet`` used (its held-out chunks serve searches)."""
    from kvconvert.calib.stats import collect_head_grams
    from kvconvert.calib.text import calibration_set

    calib_set = calibration_set(source.path, calib, tokens, min(chunk_len, layout.context), seed)
    grams = collect_head_grams(source, adapter_for(source.config), calib_set.chunks, progress=progress)
    o_grams = [output_gram(w.o_weight, layout) for w in layers]
    return fit_bases(grams, o_grams, value_basis), calib_set


@dataclass(frozen=True)
class ZackPlan:
    """What zack decided for a model: every head's rotations, the widths they are cut to, and the
    calibration they came from (kvconvert.json's ``plan.calibration``)."""

    layout: AttentionLayout
    bases: HeadBases
    widths: ZackWidths
    calibration: dict[str, Any]


class ZackMethod(Method[ZackPlan]):
    name = "zack"
    unsupported: ClassVar[dict[str, str]] = {
        "softcap": "zack's attention does not apply attention-logit soft-capping; use quant",
    }  # fmt: skip

    def check(self, layout: AttentionLayout) -> None:
        if layout.qk_norm and (not layout.rotary or layout.nope_layers):
            # without RoPE the bases fold into q_proj/k_proj, ahead of where the norm acts
            raise KVConvertError("zack supports QK-norm only with RoPE in every layer (its bases act after the norm "
                                 "and RoPE)")  # fmt: skip

    @classmethod
    def headline(cls, report: dict[str, Any]) -> str:
        rate = report["plan"]["removal_rate"]
        how = "widths by measured loss" if rate is None else f"r={rate:.4f}"
        return f"zack {how}, {budget_words(report)}"

    def __init__(self, config: ZackConfig):
        self.config = config

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        widths = [sum(r["rank_k"]) + sum(r["rank_v"]) for r in report["layers"]]
        return (
            "ZACK caches K and V in calibrated per-head rotated bases, truncated to adaptive widths; attention "
            f"runs in the compressed space. Cached K+V width per layer: {widths}."
        )

    @classmethod
    def report_table(cls, report: dict[str, Any]) -> str:
        probed = [side for side in "kv" if any(f"{side}_probe_kl" in row for row in report["layers"])]
        lines = [
            f"{'layer':>5}  {'K widths':<24}  {'V widths':<24}" + "".join(f"  {s.upper()} probe KL" for s in probed)
        ]
        for row in report["layers"]:
            if row.get("stock"):  # a sliding-window layer: its stock attention and window
                lines.append(f"{row['layer']:>5}  {'stock (sliding window)':<24}  {'stock':<24}")
                continue
            widths = f"{','.join(map(str, row['rank_k'])):<24}  {','.join(map(str, row['rank_v'])):<24}"
            lines.append(f"{row['layer']:>5}  {widths}" + "".join(f"  {row[f'{s}_probe_kl']:>10.4f}" for s in probed))
        return "\n".join(lines)

    def expected_kv_budget(self, plan: ZackPlan, layout: AttentionLayout) -> float:
        return plan.widths.budget

    def plan(self, ctx: PlanContext) -> ZackPlan:
        """Calibrate (layer by layer), fit every head's rotations, then choose r and the ranks."""
        layout, layers, source = ctx.layout, ctx.layers, ctx.source
        config = self.config
        bases, calib = calibrate_bases(source, layout, layers, config.calib, config.calib_tokens, config.chunk_len,
                                       config.seed, ctx.progress, config.value_basis)  # fmt: skip
        calibration = {"source": calib.source, "tokens": calib.tokens, "chunk_len": calib.chunks.shape[1]}
        # sliding-window layers keep their stock attention and windowed cache: whole, outside the budget
        whole = frozenset(layout.local_layers)
        dk, compress = layout.head_dim, config.compress
        if config.removal_rate is not None:
            widths = plan_for_rate(bases, config.removal_rate, dk, compress, whole)
        elif config.kv_budget is not None:
            widths = plan_for_budget(bases, config.kv_budget, dk, compress, whole=whole)
            if config.schedule == "auto":
                probe_kl, calibration["probe"] = self._probe(source, layout, bases, calib, widths, ctx.progress)
                widths = plan_by_loss(bases, config.kv_budget, dk, compress, widths, probe_kl, whole)
        else:
            from kvconvert.methods.zack.search import search_removal_rate

            assert config.target_agreement is not None
            widths, calibration["search"] = search_removal_rate(
                source, layout, bases, calib.held_out, config.target_agreement, compress, ctx.progress, whole=whole
            )
        return ZackPlan(layout, bases, widths, calibration)

    def _probe(
        self, source: Any, layout: AttentionLayout, bases: HeadBases, calib: Any, probe: ZackWidths, progress: bool
    ) -> tuple[dict[str, list[float]], dict[str, Any]]:
        """Per truncated side and layer: KL to the source on held-out calibration chunks with only that
        layer's side truncated at ``probe``'s widths (simulated exactly, ``zack.search.truncated_attention``;
        one branching pass, ``calib.probes.branch_kls``), and what the probes ran on."""
        from kvconvert.calib.probes import active_job, branch_kls
        from kvconvert.methods.zack.search import projectors_for, truncated_attention

        chunks = (calib.held_out if calib.held_out.shape[0] else calib.chunks)[: self.config.probe_chunks]
        projectors = projectors_for(bases, probe)
        probed = [layer for layer in range(layout.num_layers) if layer not in layout.local_layers]  # stock: not cut
        jobs = [(layer, side) for side in "kv" if side in self.config.compress for layer in probed]

        def select(layer: int) -> Any:  # the running probe's side at its layer, nothing elsewhere
            job = active_job(jobs)
            if job is None or job[0] != layer:
                return None
            p_k, p_v = projectors[layer]
            return (p_k, None) if job[1] == "k" else (None, p_v)

        kls = branch_kls(source, chunks, [layer for layer, _ in jobs],
                         lambda model: truncated_attention(model, select), progress)  # fmt: skip
        ran = {"removal_rate": probe.removal_rate, "budget": probe.budget, "chunks": int(chunks.shape[0]),
               "chunk_len": int(chunks.shape[1])}  # fmt: skip
        measured = dict(zip(jobs, kls, strict=True))  # a layer not probed (kept whole) reads 0
        return {side: [measured.get((layer, side), 0.0) for layer in range(layout.num_layers)] for side in "kv"
                if side in self.config.compress}, ran  # fmt: skip

    def convert_layer(self, plan: ZackPlan, layer: int, weights: AttentionWeights, dtype: torch.dtype) -> LayerOutput:
        layout, bases, widths = plan.layout, plan.bases, plan.widths
        rank_k, rank_v = widths.rank_k[layer], widths.rank_v[layer]
        if layer in layout.local_layers:  # its window stays stock: attention, weights and cache as the source's
            return LayerOutput(tensors={}, report={"layer": layer, "rank_k": rank_k, "rank_v": rank_v, "stock": True},
                               passthrough=True)  # fmt: skip
        # a layer without RoPE (SmolLM3's every fourth) takes its bases folded into q_proj/k_proj, as in a model
        # without RoPE
        rotary = layout.rotary and layer not in layout.nope_layers
        tensors = rotate_attention(weights, layout, bases.qk[layer], rank_k, bases.vw[layer], rank_v,
                                   bases.vw_out[layer], rotary)  # fmt: skip
        report: dict[str, Any] = {
            "layer": layer,
            "rank_k": rank_k,
            "rank_v": rank_v,
            "removed_k": [_removed(s, r) for s, r in zip(bases.qk_spectrum[layer], rank_k, strict=True)],
            "removed_v": [_removed(s, r) for s, r in zip(bases.vw_spectrum[layer], rank_v, strict=True)],
        }
        for side, kls in widths.probe_kl.items():
            report[f"{side}_probe_kl"] = kls[layer]
        # a QK-norm stays where the source has it, before RoPE; the bases act after RoPE on the normed heads
        tensors.update(qk_norm_tensors(weights))
        return LayerOutput(tensors={k: v.to(dtype) for k, v in tensors.items()}, report=report)

    def summary(self, plan: ZackPlan) -> dict[str, Any]:
        """The whole-model decisions (``kvconvert.json`` → ``plan``), not any one layer's."""
        return {"removal_rate": plan.widths.removal_rate, "calibration": plan.calibration}

    def runtime_spec(self, plan: ZackPlan, layout: AttentionLayout, tensor_names: list[list[str]]) -> dict[str, Any]:
        layers = []
        for rank_k, rank_v, names in zip(plan.widths.rank_k, plan.widths.rank_v, tensor_names, strict=True):
            biases = sorted(n.removesuffix(".bias") for n in names if n.endswith(".bias"))
            layers.append({"rank_k": rank_k, "rank_v": rank_v, "biases": biases})
        return {"zack_layers": layers, **qk_norm_spec(layout), **rope_spec(layout)}


def _removed(spectrum: torch.Tensor, rank: int) -> float:
    """Share of the singular-value mass a head drops (eq. 6's left-hand side)."""
    total = float(spectrum.sum())
    return 0.0 if total == 0 else float(spectrum[rank:].sum()) / total


def _heads(weight: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """Rows of ``[heads·dk, …]`` as ``heads`` blocks ``[dk, …]``, float64."""
    return list(weight.to(linalg.F64).view(heads, -1, *weight.shape[1:]).unbind(0))


def rotate_attention(
    w: AttentionWeights,
    layout: AttentionLayout,
    qk_bases: list[torch.Tensor],
    rank_k: list[int],
    vw_bases: list[torch.Tensor],
    rank_v: list[int],
    vw_out: list[torch.Tensor] | None = None,
    rotary: bool | None = None,
) -> dict[str, torch.Tensor]:
    """ZACK's projections for one layer, float64, names local to the attention module.

    ``B_g = R_g[:, :r_g]`` per KV head g (query head h belongs to g = h // G). Widths are packed
    head after head: Σ_g r_k,g for keys, Σ_h r_k,g(h) for queries (and the same with r_v).
    With RoPE: ``q_proj``/``k_proj`` unchanged, ``qk_basis [dk, Σ_g r_k,g]`` applied after RoPE.
    Without: ``q_proj [Σ_h r_k, d]``, ``k_proj [Σ_g r_k, d]`` with the bases folded in (biases too).
    Always: ``v_proj [Σ_g r_v, d]`` = B_gᵀ W_V^g, ``o_proj [d, Σ_h r_v]`` = W_O^h C_g(h), with
    ``C = vw_out[:, :r]`` (default: C = B, the paper's orthogonal rotation). ``rotary``: whether this layer applies
    RoPE (default: ``layout.rotary``; False for a model's layers without it).
    """
    heads, kv_heads = layout.num_heads, layout.num_kv_heads
    group = heads // kv_heads
    k_basis = [qk_bases[g][:, : rank_k[g]] for g in range(kv_heads)]
    v_basis = [vw_bases[g][:, : rank_v[g]] for g in range(kv_heads)]
    o_basis = [(vw_bases if vw_out is None else vw_out)[g][:, : rank_v[g]] for g in range(kv_heads)]
    out: dict[str, torch.Tensor] = {}

    def put(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out[f"{name}.weight"] = weight.contiguous()
        if bias is not None:
            out[f"{name}.bias"] = bias.contiguous()

    def fold(weight: torch.Tensor, bias: torch.Tensor | None, count: int, basis_of: Any) -> tuple[Any, Any]:
        """Rows of each head h replaced by ``B(h)ᵀ W^h`` (and ``B(h)ᵀ b^h``)."""
        new_w = torch.cat([basis_of(h).T @ block for h, block in enumerate(_heads(weight, count))])
        new_b = None if bias is None else torch.cat([basis_of(h).T @ b for h, b in enumerate(_heads(bias, count))])
        return new_w, new_b

    if layout.rotary if rotary is None else rotary:
        put("q_proj", w.q_weight.to(linalg.F64), None if w.q_bias is None else w.q_bias.to(linalg.F64))
        put("k_proj", w.k_weight.to(linalg.F64), None if w.k_bias is None else w.k_bias.to(linalg.F64))
        out["qk_basis"] = torch.cat(k_basis, dim=1)
    else:
        put("q_proj", *fold(w.q_weight, w.q_bias, heads, lambda h: k_basis[h // group]))
        put("k_proj", *fold(w.k_weight, w.k_bias, kv_heads, lambda g: k_basis[g]))
    put("v_proj", *fold(w.v_weight, w.v_bias, kv_heads, lambda g: v_basis[g]))
    o_columns = _heads(w.o_weight.T.contiguous(), heads)  # H × [dk, d] = W_Oʰᵀ
    o_weight = torch.cat([o_basis[h // group].T @ o_columns[h] for h in range(heads)]).T
    put("o_proj", o_weight, None if w.o_bias is None else w.o_bias.to(linalg.F64))
    return out
