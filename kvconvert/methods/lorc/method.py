"""LoRC (Zhang et al. 2024): low-rank K/V weights with a progressive, condition-number-driven rank schedule.

Per layer, W_K ≈ U_K·(Σ_K V_Kᵀ) and W_V ≈ U_V·(Σ_V V_Vᵀ) by truncated SVD (paper eqs. 5–9). The cache
holds the rank-d_c latents ``x·(ΣVᵀ)ᵀ``; U_V is folded into W_O so values are never rebuilt; U_K is
folded into W_Q when there is no RoPE, and with RoPE keys are rebuilt per head from the latent and
rotated at attention time (appendix E; the latent cannot absorb a position-dependent rotation).
Ranks follow eq. 13 over the cumulative condition numbers of eq. 12; layers above ``threshold``
(log10 κ̃) are left uncompressed (appendix F.1).

Extensions (not in the paper): ``calibrate`` factors to minimise the error of what each projection
*produces* on calibration text rather than of its weights — keys whitened by the attention input's
Gram (SVD-LLM/Palu), values also weighted by what W_O makes of them — with the same checkpoint format;
``schedule="auto"`` allocates ranks per layer and side by measured loss: each (layer, side)'s KL to
the source when truncated alone at a probe rank, scaled by its whitened tail energy, then greedy;
``refine_steps`` then fits each layer's truncation by a few Adam steps on the error of its attention
output, softmax included (``methods.lorc.refine``), layer by layer; ``latent="joint"`` (with ``auto``) caches
one latent per layer that both K and V are rebuilt from, as MLA does (DeepSeek-V2; TransMLA and MHA2MLA
convert to it): the stacked ``[W_K; W_V]`` factored at once, each side's error weighted by the KL its
probe measured per unit of error (``linalg.joint_truncation``), so the directions of the input that both
read are cached once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvconvert import linalg
from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import (
    LayerOutput,
    Method,
    PlanContext,
    budget_words,
    layer_table,
    qk_norm_spec,
    qk_norm_tensors,
)
from kvconvert.methods.lorc.config import LorcConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvconvert.methods.lorc.refine import MlaJob

Affine = tuple[torch.Tensor, torch.Tensor]  # (Π, c): x ↦ Π·x + c, ``calib.projection.projected_kv``


def _largest_remainder(values: list[float], total: int, low: int, high: int) -> list[int]:
    """Integers within [low, high], each floor/ceil of ``values``, summing to ``total`` when possible."""
    clipped = [min(max(v, low), high) for v in values]
    ranks = [math.floor(v) for v in clipped]
    order = sorted(range(len(values)), key=lambda i: clipped[i] - ranks[i], reverse=True)
    for i in order:
        if sum(ranks) >= total:
            break
        if ranks[i] < high:
            ranks[i] += 1
    return ranks


def progressive_ranks(log_kappa: list[float], compressed: list[bool], d_max: int, total: int) -> list[int]:
    """Paper eq. 13 with d_min solved so the compressed layers' ranks sum to ``total``.

    ``d_l = d_max − (d_max − d_min)·f_l`` with ``f_l = (max ln κ̃ − ln κ̃_l)/(max ln κ̃ − min ln κ̃)`` over
    all layers (as in the paper), so the sum is linear in d_min and solved in closed form; ranks are
    rounded by largest remainder so the total is exact. Uncompressed layers get ``d_max``.
    """
    hi, lo = max(log_kappa), min(log_kappa)
    if hi == lo:
        return uniform_ranks(compressed, d_max, total)
    f = [(hi - v) / (hi - lo) for v in log_kappa]
    idx = [i for i, c in enumerate(compressed) if c]
    spread = sum(f[i] for i in idx)
    if spread == 0:  # only the most sensitive layer is compressible: the schedule cannot lower it
        return uniform_ranks(compressed, d_max, total)
    d_min = d_max - (len(idx) * d_max - total) / spread
    if d_min < 1:
        raise KVConvertError(
            f"the progressive schedule cannot reach this budget: it would need d_min = {d_min:.1f} < 1 "
            "(eq. 13 keeps d_max = full width in the most sensitive layer); use --schedule uniform or a larger budget"
        )
    continuous = [d_max - (d_max - d_min) * f[i] for i in idx]
    ranks = [d_max] * len(log_kappa)
    for i, r in zip(idx, _largest_remainder(continuous, total, 1, d_max), strict=True):
        ranks[i] = r
    return ranks


def uniform_ranks(compressed: list[bool], d_max: int, total: int) -> list[int]:
    """The paper's baseline: one rank ratio for all compressed layers (same skipped layers)."""
    idx = [i for i, c in enumerate(compressed) if c]
    ranks = [d_max] * len(compressed)
    for i, r in zip(idx, _largest_remainder([total / len(idx)] * len(idx), total, 1, d_max), strict=True):
        ranks[i] = r
    return ranks


@dataclass(frozen=True)
class LorcRanks:
    """Every layer's condition numbers and ranks, and (``auto``) the probes they were allocated from."""

    kappa_k: list[float]
    kappa_v: list[float]
    log10_kappa_cum: list[float]
    compressed: list[bool]  # False: left uncompressed (threshold)
    rank_k: list[int | None]  # None: K not factored in this layer
    rank_v: list[int | None]
    budget: float = field(default=0.0)
    # schedule="auto": per layer, KL to the source with only that side truncated at ``probe_rank``
    probe_kl_k: list[float | None] = field(default_factory=list)
    probe_kl_v: list[float | None] = field(default_factory=list)
    probe_rank: int | None = None
    # every probe per side and layer, (rank, KL), in the order measured (probe_rounds > 1: later rounds)
    probes: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # latent="joint": per layer, the weights of K's and V's errors in the shared latent (loss per unit of
    # weighted error energy); rank_k[i] == rank_v[i] is then the one latent's rank
    joint_scales: list[tuple[float, float]] | None = None


@dataclass(frozen=True)
class Weighting:
    """``calibrate``: what weights each side's factorization error (``LorcMethod._targets``): per layer the
    attention input's Gram ``[D, D]`` float64, and the query Grams per KV head (``calib.stats.HeadGrams``)."""

    input_grams: list[torch.Tensor]
    head_grams: Any


@dataclass(frozen=True)
class LorcPlan:
    """What lorc decided for a model: the ranks, the calibration weighting (None: plain SVD, the paper),
    the refined truncations (``refine_steps``: layer -> {side: (A, B)}, Π = A·B) and their losses, and the
    calibration they came from (kvconvert.json's ``plan.calibration``)."""

    layout: AttentionLayout
    ranks: LorcRanks
    weighting: Weighting | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    refined: dict[int, Any] = field(default_factory=dict)
    refine_log: dict[int, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class MlaPlan:
    """What ``latent="mla"`` decided: the one latent width, the calibration it fitted on (each layer's mean
    ``x xᵀ`` of the attention inputs), the mean rotation of the key parts the shared RoPE key cannot hold
    (``methods.lorc.mla``), the queries' scale and the DeepSeek-V3 config entries (``kvconvert.arch.mla``)."""

    layout: AttentionLayout
    kv_lora_rank: int
    rope_dim: int
    input_grams: list[torch.Tensor]
    rotations: torch.Tensor  # [L, H, d/2] complex
    query_scale: float
    engine: dict[str, Any]
    added: dict[str, str] = field(default_factory=dict)  # output head of a tied source (``arch.mla.untied_head``)
    calibration: dict[str, Any] = field(default_factory=dict)
    frequencies: torch.Tensor | None = None  # the source's RoPE angular frequencies [d/2]
    # ``refine_steps``: layer -> the refined ``mla.mla_parts`` (float32; layers whose loss fell) and every layer's
    # losses (``methods.lorc.refine.refine_mla_layers``)
    refined: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    refine_log: dict[int, dict[str, float]] = field(default_factory=dict)
    # ``mla_sizes``: the (kv_lora_rank, RoPE width) the checkpoint is written at, the latent and key zero-padded to
    # them (``arch.mla.ENGINE_SIZES``); None: ``kv_lora_rank`` and ``rope_dim`` themselves. Everything before
    # writing (the fit, the width search) runs at the plan's own sizes: the padded coordinates stay zero.
    written: tuple[int, int] | None = None

    @property
    def cached(self) -> tuple[int, int]:
        """The (kv_lora_rank, RoPE width) the checkpoint holds and its cache stores per token and layer."""
        return self.written or (self.kv_lora_rank, self.rope_dim)


def probe_rank(config: LorcConfig, layers: int, width: int) -> int:
    """The rank every factored side would get under one uniform ratio: where ``auto`` measures each
    (layer, side)'s sensitivity, so the loss model is calibrated near the operating point."""
    sides = len(config.compress)
    free = round(config.kv_budget * 2 * layers * width) - (2 - sides) * width * layers
    return min(max(round(free / (sides * layers)), 1), width)


def plan_ranks(
    config: LorcConfig, kappa_k: list[float], kappa_v: list[float], width: int,
    losses: dict[str, list[torch.Tensor]] | None = None,
) -> LorcRanks:  # fmt: skip
    """Decide per-layer ranks so that Σ cached widths / (2·L·e) equals ``config.kv_budget``.

    ``losses[side][layer][r]`` (schedule "auto"): predicted loss of that side at rank r, r = 0..width."""
    layers = len(kappa_k)
    ln_cum = linalg.log_cumulative_condition(kappa_k, kappa_v)
    log10_cum = [v / math.log(10) for v in ln_cum]
    threshold = config.threshold
    compressed = [threshold is None or v <= threshold for v in log10_cum]
    factored = {"kv": ("k", "v"), "k": ("k",), "v": ("v",)}[config.compress]
    # Budget in units of one width-1 column per layer per side: full model = 2·L·e.
    target = round(config.kv_budget * 2 * layers * width)
    fixed = sum(2 * width for c in compressed if not c) + (2 - len(factored)) * width * sum(compressed)
    free = target - fixed
    n_compressed = sum(compressed)
    if n_compressed == 0:
        raise KVConvertError(f"threshold {threshold} leaves no layer to compress (max log10 κ̃ {max(log10_cum):.1f})")
    if free < len(factored) * n_compressed:
        lowest = (fixed + len(factored) * n_compressed) / (2 * layers * width)
        raise KVConvertError(
            f"kv_budget {config.kv_budget} is below what this plan can reach ({lowest:.3f}: "
            f"{layers - n_compressed} uncompressed layers, compress={config.compress})"
        )
    per_side = free // len(factored)  # K and V get the same ranks when both are factored
    if config.schedule == "auto":
        assert losses is not None, "schedule auto needs measured losses"
        flat = linalg.allocate_ranks([losses[side][i] for side in factored for i in range(layers)], free)
        by_side = {side: flat[j * layers : (j + 1) * layers] for j, side in enumerate(factored)}
        rank_k = list(by_side.get("k", [None] * layers))
        rank_v = list(by_side.get("v", [None] * layers))
    else:
        if config.schedule == "progressive":
            ranks = progressive_ranks(ln_cum, compressed, width, per_side)
        else:
            ranks = uniform_ranks(compressed, width, per_side)
        rank_k = [r if c and "k" in factored else None for r, c in zip(ranks, compressed, strict=True)]
        rank_v = [r if c and "v" in factored else None for r, c in zip(ranks, compressed, strict=True)]
    cached = sum((rk or width) + (rv or width) for rk, rv in zip(rank_k, rank_v, strict=True))
    return LorcRanks(kappa_k, kappa_v, log10_cum, compressed, rank_k, rank_v, budget=cached / (2 * layers * width))


class LorcMethod(Method[LorcPlan | MlaPlan]):
    name = "lorc"
    # calibrated keys: weight their error by the queries (True) or by the inputs alone (the ablation)
    query_weighted_keys: ClassVar[bool] = True
    unsupported: ClassVar[dict[str, str]] = {
        "local_layers": "its sliding-window layers need a cache that forgets beyond the window (not implemented for "
                        "lorc); use quant or razor",
        "softcap": "lorc's attention does not apply attention-logit soft-capping; use quant",
        "layer_rope": "lorc re-rotates rebuilt keys with one RoPE table, and this model has one per layer type",
        "nope_layers": "lorc re-rotates rebuilt keys with RoPE in every layer, and this model has layers without it "
                       "(not implemented); use quant, razor or minicache",
        "interleaved_rope": "lorc re-rotates rebuilt keys the rotate-half way, and this model's RoPE rotates "
                            "interleaved channel pairs (not implemented); use quant, razor or minicache",
    }  # fmt: skip

    @classmethod
    def headline(cls, report: dict[str, Any]) -> str:
        params = report["params"]
        if params["latent"] == "mla":
            padded = report.get("plan", {}).get("mla", {}).get("written")
            sizes = f", padded to {padded['kv_lora_rank']} + {padded['rope_dim']}" if padded else ""
            return (f"lorc as DeepSeek-V3 MLA (kv_lora_rank {report['layers'][0]['rank']}{sizes}), "
                    f"{budget_words(report)}")  # fmt: skip
        kind = f"{params['schedule']}, joint latent" if params["latent"] == "joint" else params["schedule"]
        return f"lorc {kind}, {budget_words(report)}"

    def __init__(self, config: LorcConfig):
        self.config = config

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        params = report["params"]
        if params.get("latent") == "mla":
            steps = params.get("refine_steps")
            refined = f", then refined by {steps} steps per layer on the attention output" if steps else ""
            if distilled := report.get("refit", {}).get("distill"):
                refined += (f", then distilled through the whole model for {distilled['steps']} steps on the source's "
                            f"next-token distribution (KL {distilled['kl_before']:.4f} → {distilled['kl_after']:.4f} "
                            "nats per calibration token)" if distilled["kept"] else "")  # fmt: skip
            decided = report.get("plan", {})
            rope = f" of {decided['mla']['rope_dim']} values" if "mla" in decided else ""
            searched = ""
            if search := decided.get("calibration", {}).get("rope_search"):
                tried = ", ".join(f"{c['rope_dim']}: {c['kl']:.4f}" for c in search["candidates"])
                searched = (
                    f" Its RoPE key's width was measured (--mla-rope-dim auto): KL from the source per "
                    f"token on {search['chunks']} held-out calibration chunks, each width's export built "
                    f"as written, {tried}; the lowest kept."
                )
            if padded := decided.get("mla", {}).get("written"):
                searched += (
                    f" Written at the sizes {padded['for']}'s MLA kernels take (--mla-sizes {padded['for']}): "
                    f"kv_lora_rank {padded['kv_lora_rank']} and a {padded['rope_dim']}-wide RoPE key, the latent "
                    "and the key zero-padded to them (the same model; its cache holds "
                    f"{padded['kv_lora_rank'] + padded['rope_dim']} values per token and layer)."
                )
            return (
                f"LoRC written as a standard DeepSeek-V3 checkpoint (multi-head latent attention): per layer one "
                f"latent of {report['layers'][0]['rank']} values that keys and values are rebuilt from, plus one RoPE "
                f"key{rope} shared by all heads (each frequency's principal direction across the KV heads); fitted "
                f"on calibration activations{refined}.{searched} Stock transformers loads it without remote code "
                "(`AutoModelForCausalLM.from_pretrained(DIR)`: `DeepseekV3ForCausalLM`, whose cache holds the latent "
                "and the RoPE key), and so do serving engines with MLA kernels (`vllm serve DIR`)."
            )
        ranks = [r["rank_k"] for r in report["layers"]]
        how = "weighted by calibration activations" if params.get("calibrate") else "by SVD"
        if params.get("refine_steps"):
            how += f", refined by {params['refine_steps']} steps per layer on the attention output"
        if params.get("latent") == "joint":
            return (
                f"LoRC extended to one cached latent per layer that K and V are both rebuilt from (low-rank "
                f"[W_K; W_V] {how}, each side's error weighted by its measured loss; U_V folded into W_O). "
                f"Schedule {params['schedule']}; latent ranks per layer: {ranks}."
            )
        return (
            f"LoRC caches rank-d_c latents of K and V (low-rank W_K, W_V {how}; U_V folded into W_O). "
            f"Schedule {params['schedule']}, factored {params['compress']}; K ranks per layer: {ranks}."
        )

    @classmethod
    def report_table(cls, report: dict[str, Any]) -> str:
        params = report["params"]
        if params["latent"] == "mla":
            return layer_table(report, [
                ("latent", "rank", ""), ("RoPE key kept", "rope_kept", ".3f"),
                ("latent error", "latent_rel_output_error", ".3f"),
                *([("refine loss", "refine_loss_before", ".4f"),
                   ("→ refined", "refine_loss_after", ".4f")] if params["refine_steps"] else []),
            ])  # fmt: skip
        error = "rel_output_error" if params["calibrate"] else "rel_frobenius_error"
        return layer_table(report, [
            ("κ(W_K)", "kappa_k", ".3g"), ("κ(W_V)", "kappa_v", ".3g"), ("log10 κ̃", "log10_kappa_cum", ".1f"),
            ("rank K", "rank_k", ""), ("rank V", "rank_v", ""), ("K error", f"k_{error}", ".3f"),
            ("V error", f"v_{error}", ".3f"),
            *([("K+V error", "kv_rel_output_error", ".3f")] if params["latent"] == "joint" else []),
            *([("refine loss", "refine_loss_before", ".4f"),
               ("→ refined", "refine_loss_after", ".4f")] if params["refine_steps"] else []),
        ])  # fmt: skip

    def check(self, layout: AttentionLayout) -> None:
        if layout.qk_norm and not layout.rotary:  # keys scored on the latent: no full-width key to normalise
            raise KVConvertError("lorc supports QK-norm only with RoPE (its keys are rebuilt, then normalised)")

    def expected_kv_budget(self, plan: LorcPlan | MlaPlan, layout: AttentionLayout) -> float:
        if isinstance(plan, MlaPlan):  # per token and layer: the latent and the shared RoPE key, as written
            return sum(plan.cached) / (2 * layout.kv_width)
        return plan.ranks.budget

    def side_budgets(self, plan: LorcPlan | MlaPlan, layout: AttentionLayout) -> list[tuple[float, float]] | None:
        if isinstance(plan, MlaPlan):
            return None  # engines cache it in their own format: no storage to weigh
        width, joint = layout.kv_width, plan.ranks.joint_scales is not None
        shares = []
        for rank_k, rank_v in zip(plan.ranks.rank_k, plan.ranks.rank_v, strict=True):
            if joint and rank_k is not None:  # one latent, held in the keys' store (the runtime's LorcAttention)
                shares.append((rank_k / width, 0.0))
            else:
                shares.append((1.0 if rank_k is None else rank_k / width, 1.0 if rank_v is None else rank_v / width))
        return shares

    def params(self) -> dict[str, Any]:
        params = super().params()
        for key in ("mla_distance", "mla_rope_dim"):
            if params[key] is None:
                del params[key]  # the default: reports and recipes read as they did before the option
        if params["mla_sizes"] == "budget":
            del params["mla_sizes"]  # likewise
        if not params["distill_steps"]:
            for key in ("distill_steps", "distill_chunks", "distill_len"):
                del params[key]
        return params

    def engine_config(self, plan: LorcPlan | MlaPlan) -> dict[str, Any]:
        return plan.engine if isinstance(plan, MlaPlan) else {}

    def added_tensors(self, plan: LorcPlan | MlaPlan) -> dict[str, str]:
        return plan.added if isinstance(plan, MlaPlan) else {}

    def check_storage(self, layout: AttentionLayout) -> None:
        super().check_storage(layout)
        if self.config.latent == "mla" and self.storage != type(self.storage)():
            raise KVConvertError("--latent mla writes a DeepSeek-V3 checkpoint that engines cache in their own "
                                 "format: it takes no --kv-* storage options")  # fmt: skip

    def _targets(
        self, weighting: Weighting | None, layout: AttentionLayout, layer: int, w: AttentionWeights
    ) -> dict[str, tuple[torch.Tensor, Any, Any]]:
        """Per factored side: (weight, right factor, left factor) of ``linalg.weighted_truncation``.
        Uncalibrated: plain SVD of the weights (the paper). Calibrated: errors measured on the layer's
        inputs (R = √ of their Gram) and weighted by what reads them: a key error by the queries that
        score it (each group's query Gram; with RoPE only its diagonal, as the cross terms between
        rotary planes average out over relative positions), a value error by W_O (each group's W_Oᵀ W_O)."""
        if weighting is None:
            return {"k": (w.k_weight, None, None), "v": (w.v_weight, None, None)}
        right = linalg.gram_factor(weighting.input_grams[layer])
        o_gram = linalg.output_gram(w.o_weight, layout.num_heads, layout.num_kv_heads, layout.head_dim)
        left_k = None
        if self.query_weighted_keys:
            queries = weighting.head_grams.query[layer]  # [Hkv, dk, dk]
            left_k = linalg.block_cholesky(torch.diag_embed(queries.diagonal(dim1=-2, dim2=-1)) if layout.rotary
                                           else queries)  # fmt: skip
        return {"k": (w.k_weight, right, left_k), "v": (w.v_weight, right, linalg.block_cholesky(o_gram))}

    def plan(self, ctx: PlanContext) -> LorcPlan | MlaPlan:
        """κ(W_K), κ(W_V) of every layer (full D × n_kv·d matrices, appendix D), then the ranks.
        Calibrated: the attention inputs' Grams first; auto: every side's loss curve (``_losses``)."""
        if self.config.latent == "mla":
            return self._mla_plan(ctx)
        layout, layers, source = ctx.layout, ctx.layers, ctx.source
        config = self.config
        calib, weighting, calibration = None, None, {}
        if config.calibrate:
            from kvconvert.arch import adapter_for
            from kvconvert.calib.stats import collect_layer_grams
            from kvconvert.calib.text import calibration_set

            calib = calibration_set(source.path, config.calib, config.calib_tokens,
                                    min(config.chunk_len, layout.context), config.seed)  # fmt: skip
            weighting = Weighting(*collect_layer_grams(source, adapter_for(source.config), calib.chunks, ctx.progress))
            calibration = {"source": calib.source, "tokens": calib.tokens, "chunk_len": calib.chunks.shape[1]}
        factored = tuple(config.compress)
        r0 = probe_rank(config, layout.num_layers, layout.kv_width)
        kappa_k, kappa_v = [], []
        spectra: dict[str, list[torch.Tensor]] = {side: [] for side in factored}
        projectors: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {side: [] for side in factored}
        for i, w in enumerate(layers):
            kappa_k.append(linalg.kappa(w.k_weight))
            kappa_v.append(linalg.kappa(w.v_weight))
            if weighting is None:
                continue
            for side, (weight, right, left) in self._targets(weighting, layout, i, w).items():
                if side in factored:
                    spectra[side].append(linalg.weighted_singular_values(weight, right, left))
                    if config.schedule == "auto":
                        projectors[side].append(_affine(weight, r0, right, left, w.k_bias if side == "k" else w.v_bias))
        if config.schedule != "auto":
            ranks = plan_ranks(config, kappa_k, kappa_v, layout.kv_width)
        else:
            assert calib is not None and weighting is not None
            jobs = {(i, side): affine for side in factored for i, affine in enumerate(projectors[side])}
            first, calibration["probe"] = self._probe(ctx, calib, jobs)
            probes = {side: [[(r0, first[i, side])] for i in range(layout.num_layers)] for side in factored}
            allocated: LorcRanks | None = None
            if config.latent == "joint":
                allocated = self._joint_plan(source, layout, weighting, spectra, probes, kappa_k, kappa_v)
            else:
                for _ in range(config.probe_rounds):
                    if allocated is not None:
                        self._probe_again(ctx, weighting, calib, allocated, probes)
                    losses = {side: [linalg.loss_curve(linalg.tail_energy(spectra[side][i]), probes[side][i])
                                     for i in range(layout.num_layers)] for side in factored}  # fmt: skip
                    allocated = plan_ranks(config, kappa_k, kappa_v, layout.kv_width, losses)
            assert allocated is not None
            none: list[float | None] = [None] * layout.num_layers
            ranks = dataclasses.replace(
                allocated, probe_rank=r0, probes=probes,
                probe_kl_k=[p[0][1] for p in probes["k"]] if "k" in probes else none,
                probe_kl_v=[p[0][1] for p in probes["v"]] if "v" in probes else none,
            )  # fmt: skip
        if not config.refine_steps:
            return LorcPlan(layout, ranks, weighting, calibration)
        assert calib is not None
        refined, refine_log, calibration["refine"] = self._refine(ctx, weighting, ranks,
                                                                  calib.chunks[: config.refine_chunks])  # fmt: skip
        return LorcPlan(layout, ranks, weighting, calibration, refined, refine_log)

    def _mla_plan(self, ctx: PlanContext) -> MlaPlan:
        """``latent="mla"``: refuse what DeepSeek-V3's attention cannot express (one line, before any
        calibration), then, on calibration text, each layer's input Gram and how far each head attends."""
        from kvconvert.arch import adapter_for
        from kvconvert.arch.mla import (
            ENGINE_SIZES,
            LATENT_NORM_EPS,
            check_mla_source,
            deepseek_v3_config,
            deepseek_v3_scaling,
            untied_head,
        )
        from kvconvert.calib.text import calibration_set
        from kvconvert.methods.lorc.mla import mean_rotation
        from kvconvert.methods.lorc.mla_stats import collect_mla_statistics

        layout, source, config = ctx.layout, ctx.source, self.config
        adapter = adapter_for(source.config)
        frequencies = check_mla_source(adapter, layout)
        if config.distill_steps and any(path.suffix != ".safetensors" for path in source.weight_files):
            # the teacher is built by transformers, which would unpickle a .bin checkpoint: refused before calibrating
            raise KVConvertError("--distill-steps loads the source with transformers from safetensors only; this "
                                 "source's weights are pickled (convert them to safetensors first)")  # fmt: skip
        if ctx.dtype == torch.float16:
            # the latent runs at ~1e-5 (kv_a_layernorm's linear range): float16's subnormals there keep 3-4 bits
            raise KVConvertError("--latent mla needs a float32 or bfloat16 checkpoint (its latent is scaled into "
                                 "kv_a_layernorm's linear range, below float16's normal numbers): pass "
                                 "--dtype")  # fmt: skip
        if any(b is not None for w in ctx.layers for b in (w.q_bias, w.k_bias, w.v_bias, w.o_bias)):
            raise KVConvertError("--latent mla cannot express attention biases (DeepSeek-V3's query projection has "
                                 "none)")  # fmt: skip
        width = round(config.kv_budget * 2 * layout.kv_width)  # cached values per token and layer
        written = ENGINE_SIZES.get(config.mla_sizes)
        engines: dict[int, dict[str, Any]] = {}
        refusal: KVConvertError | None = None
        for rope in self._rope_dims(layout):
            try:
                engine = deepseek_v3_config(source.config, layout, width - rope, rope)  # refuses a width it cannot take
                if width - rope < 1:
                    raise KVConvertError(f"kv_budget {config.kv_budget} is below what MLA can hold: its shared RoPE "
                                         f"key alone is {rope / (2 * layout.kv_width):.3f} of this model's "
                                         "cache")  # fmt: skip
                if written and (width - rope > written[0] or rope > written[1]):
                    fits = sum(written) / (2 * layout.kv_width)
                    raise KVConvertError(
                        f"--mla-sizes {config.mla_sizes} writes kv_lora_rank {written[0]} + a {written[1]}-wide RoPE "
                        f"key; --kv-budget {config.kv_budget} leaves this model a latent of {width - rope} + a "
                        f"{rope}-wide key: use a budget of at most {fits:.4f}"
                    )
                if written:  # refuses a padding of the key it cannot express
                    engine = deepseek_v3_config(source.config, layout, *written, kept=rope)
                engines[rope] = engine
            except KVConvertError as exc:  # auto: the widths this model can take are still candidates
                refusal = refusal or exc  # the narrowest width's reason, the one closest to being taken
        if not engines:
            assert refusal is not None
            raise refusal
        calib = calibration_set(source.path, config.calib, config.calib_tokens,
                                min(config.chunk_len, layout.context), config.seed)  # fmt: skip
        grams, distances = collect_mla_statistics(source, adapter, calib.chunks, ctx.progress)
        if config.mla_distance is not None:  # the user's uniform spread instead of the measured one
            distances = torch.ones(*distances.shape[:2], config.mla_distance, dtype=distances.dtype)
        rotations = mean_rotation(frequencies, distances)
        best: tuple[float, MlaPlan] | None = None
        search: list[dict[str, Any]] = []
        held_out = (calib.held_out if calib.held_out.shape[0] else calib.chunks)[: config.probe_chunks]
        for rope, engine in engines.items():
            plan = MlaPlan(
                layout, width - rope, rope, grams,
                rotations=rotations,
                query_scale=layout.scaling[0] / deepseek_v3_scaling({**source.config.to_dict(), **engine}),
                engine=engine,
                added=untied_head(source.config, source.tensor_names()),
                calibration={"source": calib.source, "tokens": calib.tokens, "chunk_len": int(calib.chunks.shape[1]),
                             "latent_norm_eps": LATENT_NORM_EPS},
                frequencies=frequencies,
                written=written,
            )  # fmt: skip
            if config.refine_steps:
                plan = self._refine_mla(ctx, plan, calib.chunks[: config.refine_chunks])
            if len(engines) == 1:
                return plan
            kl = self._mla_kl(ctx, plan, held_out)
            search.append({"rope_dim": rope, "kv_lora_rank": width - rope, "kl": kl})
            if best is None or kl < best[0]:
                best = (kl, plan)  # only the best so far is kept: each plan holds every layer's fitted parts
        assert best is not None
        chosen = best[1]
        ran = {"candidates": search, "chunks": int(held_out.shape[0]), "chunk_len": int(held_out.shape[1])}
        return dataclasses.replace(chosen, calibration={**chosen.calibration, "rope_search": ran})

    def _rope_dims(self, layout: AttentionLayout) -> list[int]:
        """The shared RoPE key's widths to build: the one asked for, the head width (at most 64: engines' kernels
        take 64) by default, or for ``auto`` a quarter, half, three quarters and all of that width (even): a
        narrower key leaves more of a small budget to the latent but keeps fewer frequencies' rotation exact (on
        SmolLM2 the best width moved with the budget and with refinement, docs/lorc.md: measured, not ruled)."""
        widest = min(layout.head_dim, 64)
        if self.config.mla_rope_dim == "auto":
            return sorted({w for w in (widest * k // 4 // 2 * 2 for k in (1, 2, 3, 4)) if w >= 2})
        return [self.config.mla_rope_dim or widest]

    def _mla_kl(self, ctx: PlanContext, plan: MlaPlan, chunks: torch.Tensor) -> float:
        """Mean KL(source ‖ ``plan``'s export) per token on ``chunks``: the source run layer by layer with every
        attention replaced by DeepSeek-V3's (``mla.mla_forward``, as the checkpoint computes it) from the tensors
        the plan writes (``_mla_layer``: its fitted parts where it has them)."""
        from kvconvert.arch import adapter_for
        from kvconvert.calib.hooks import attention_io
        from kvconvert.calib.probes import branch_kls
        from kvconvert.calib.sequential import active_branch

        adapter = adapter_for(ctx.source.config)
        job_for = self._mla_jobs(ctx, plan)
        current: dict[str, Any] = {}  # the running layer's job: built once per layer, not per chunk

        def hook(layer: int, hidden: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
            if active_branch() is None:  # the reference stream: the source as it is
                return None
            if current.get("layer") != layer:
                job = job_for(layer)
                parts = {name: t.to(hidden.device, torch.float32) for name, t in job.parts.items()}
                current.update(layer=layer, job=job, parts=parts)
            return current["job"].forward(current["parts"], hidden.float())

        def observe(model: Any) -> Any:
            return attention_io(model, adapter.attention_module_paths(), hook)

        return branch_kls(ctx.source, chunks, [0], observe, progress=False)[0]

    def _mla_jobs(self, ctx: PlanContext, plan: MlaPlan) -> Callable[[int], MlaJob]:
        """``layer -> MlaJob``: each layer's tensors as ``plan`` writes them (the closed form, read from the
        checkpoint when asked, or its fitted parts where it has them) and what ``mla.mla_forward`` holds fixed."""
        from kvconvert.arch import adapter_for
        from kvconvert.arch.mla import LATENT_NORM_EPS
        from kvconvert.methods.lorc.mla import mla_parts
        from kvconvert.methods.lorc.refine import MlaJob

        source, layout, frequencies = ctx.source, plan.layout, plan.frequencies
        adapter = adapter_for(source.config)
        names = adapter.attention_names_by_layer(source.tensor_names())
        assert frequencies is not None

        def job_for(layer: int) -> MlaJob:
            w = adapter.read_attention({local: source.get(name) for local, name in names[layer].items()})
            tensors = _mla_layer(plan, layer, w, torch.float64, padded=False).tensors  # fitted at the plan's sizes
            return MlaJob(
                parts=mla_parts(tensors, layout.num_heads, layout.head_dim, plan.kv_lora_rank),
                norm_weight=tensors["kv_a_layernorm.weight"], o_weight=tensors["o_proj.weight"],
                frequencies=frequencies[: plan.rope_dim // 2], scaling=layout.scaling[0] / plan.query_scale,
                norm_eps=LATENT_NORM_EPS,
            )  # fmt: skip

        return job_for

    def _refine_mla(self, ctx: PlanContext, plan: MlaPlan, chunks: torch.Tensor) -> MlaPlan:
        """``methods.lorc.refine.refine_mla_layers`` from each layer's closed form: ``plan`` with the refined
        parts, the losses per layer, and what the refinement ran in its calibration entry."""
        import time

        from kvconvert.arch import adapter_for
        from kvconvert.methods.lorc.refine import refine_mla_layers

        source, steps = ctx.source, self.config.refine_steps
        started = time.perf_counter()
        refined, log = refine_mla_layers(source, adapter_for(source.config), chunks, self._mla_jobs(ctx, plan), steps,
                                         ctx.progress)  # fmt: skip
        ran = {"steps": steps, "chunks": int(chunks.shape[0]), "seconds": round(time.perf_counter() - started, 1)}
        return dataclasses.replace(plan, refined=refined, refine_log=log,
                                   calibration={**plan.calibration, "refine": ran})  # fmt: skip

    def _refine(
        self, ctx: PlanContext, weighting: Weighting | None, plan: LorcRanks, chunks: torch.Tensor
    ) -> tuple[dict[int, Any], dict[int, dict[str, float]], dict[str, Any]]:
        """``methods.lorc.refine``: each compressed layer's closed-form truncation, then Adam steps on its
        attention output's error, layer by layer on the stream of the refined layers before it. Returns
        the refined truncations, their losses per layer, and what the refinement ran."""
        import time

        from kvconvert.arch import adapter_for
        from kvconvert.methods.lorc.refine import Job, refine_layers

        source, layout = ctx.source, ctx.layout
        adapter = adapter_for(source.config)
        names = adapter.attention_names_by_layer(source.tensor_names())

        def job_for(layer: int) -> Job | None:
            if not plan.compressed[layer]:
                return None
            w = adapter.read_attention({local: source.get(name) for local, name in names[layer].items()})
            factors, offsets = {}, {}
            if plan.joint_scales is not None:  # one latent: Π on the stacked [k; v]
                rank = plan.rank_k[layer]
                assert rank is not None
                stacked, left, right = self._stacked(weighting, layout, layer, w, plan.joint_scales[layer])
                factors["kv"] = linalg.truncation_factors(stacked, rank, right, left)
                sides = ((w.k_weight, w.k_bias), (w.v_weight, w.v_bias))
                offsets["kv"] = torch.cat([torch.zeros(m.shape[0]) if b is None else b.float() for m, b in sides])
                return factors, offsets, w.o_weight
            for side, (weight, right, left) in self._targets(weighting, layout, layer, w).items():
                rank = plan.rank_k[layer] if side == "k" else plan.rank_v[layer]
                if rank is None:
                    continue
                factors[side] = linalg.truncation_factors(weight, rank, right, left)
                bias = w.k_bias if side == "k" else w.v_bias
                offsets[side] = torch.zeros(weight.shape[0]) if bias is None else bias.float()
            return factors, offsets, w.o_weight

        started = time.perf_counter()
        refined, log = refine_layers(source, adapter, chunks, job_for, layout.rotary_module, self.config.refine_steps,
                                     ctx.progress)  # fmt: skip
        ran = {"steps": self.config.refine_steps, "chunks": int(chunks.shape[0]),
               "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
        return refined, log, ran

    def _stacked(
        self, weighting: Weighting | None, layout: AttentionLayout, layer: int, w: AttentionWeights,
        scales: tuple[float, float],
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """``latent="joint"``: ``(stacked [W_K; W_V], its left factor, right factor)`` for
        ``linalg.weighted_truncation`` / ``truncation_factors``: each side's ``_targets`` weighting, scaled
        by ``scales`` (``linalg.stacked_weights``)."""
        targets = self._targets(weighting, layout, layer, w)
        stacked, left = linalg.stacked_weights([targets["k"][0], targets["v"][0]], list(scales),
                                               [targets["k"][2], targets["v"][2]])  # fmt: skip
        return stacked, left, targets["k"][1]

    def _joint_plan(
        self, source: Any, layout: AttentionLayout, weighting: Weighting, spectra: dict[str, list[torch.Tensor]],
        probes: dict[str, list[list[tuple[int, float]]]], kappa_k: list[float], kappa_v: list[float],
    ) -> LorcRanks:  # fmt: skip
        """``latent="joint"``: per layer, K's and V's weighted errors put into one loss by what their probes
        measured per unit of error (``linalg.loss_per_energy``), the stacked matrix's left-out energy as
        that layer's loss curve, then the ranks by greedy allocation (one latent column counts once: it
        replaces a column of K and one of V). The layers are read again, one at a time."""
        from kvconvert.arch import adapter_for

        adapter = adapter_for(source.config)
        names = adapter.attention_names_by_layer(source.tensor_names())
        scales: list[tuple[float, float]] = []
        curves: list[torch.Tensor] = []
        for layer in range(layout.num_layers):
            energy = [float((spectra[side][layer].to(linalg.F64) ** 2).sum()) for side in "kv"]
            measured = [linalg.loss_per_energy(spectra[side][layer], probes[side][layer]) for side in "kv"]
            # a side whose probe measured nothing: the other's loss per unit of *relative* energy (both
            # when neither measured anything: every side's relative error counts the same)
            per_share = [m * e for m, e in zip(measured, energy, strict=True) if m is not None] or [1.0]
            pair = tuple(m if m is not None else per_share[0] / max(e, 1e-300)
                         for m, e in zip(measured, energy, strict=True))  # fmt: skip
            scales.append((pair[0], pair[1]))
            w = adapter.read_attention({local: source.get(name) for local, name in names[layer].items()})
            stacked, left, right = self._stacked(weighting, layout, layer, w, scales[-1])
            sigma = linalg.weighted_singular_values(stacked, right, left)
            curves.append(linalg.tail_energy(sigma) * float((sigma**2).sum()))  # predicted KL at each rank
        layers, width = layout.num_layers, layout.kv_width
        total = min(round(self.config.kv_budget * 2 * layers * width), sum(len(c) - 1 for c in curves))
        if total < layers:
            raise KVConvertError(f"kv_budget {self.config.kv_budget} is below what a joint latent can reach "
                                 f"({1 / (2 * width):.4f}: rank 1 per layer)")  # fmt: skip
        ranks: list[int | None] = list(linalg.allocate_ranks(curves, total))
        log10_cum = [v / math.log(10) for v in linalg.log_cumulative_condition(kappa_k, kappa_v)]
        return LorcRanks(kappa_k, kappa_v, log10_cum, [True] * layers, ranks, list(ranks),
                        budget=total / (2 * layers * width), joint_scales=scales)  # fmt: skip

    def _probe(
        self, ctx: PlanContext, calib: Any, jobs: dict[tuple[int, str], Affine]
    ) -> tuple[dict[tuple[int, str], float], dict[str, Any]]:  # fmt: skip
        """KL to the source on held-out calibration chunks with only one (layer, side) truncated, for
        every job: the source run with that side's affine map (simulated exactly, ``calib.projection.projected_kv``),
        all jobs in one branching pass (``calib.probes.branch_kls``); and what the probes ran on."""
        from kvconvert.calib.probes import active_job, branch_kls
        from kvconvert.calib.projection import projected_kv

        layout = ctx.layout
        chunks = calib.held_out if calib.held_out.shape[0] else calib.chunks
        chunks = chunks[: self.config.probe_chunks]
        order = list(jobs)

        def select() -> dict[tuple[int, str], Affine]:  # the running probe's map alone
            job = active_job(order)
            return {} if job is None else {job: jobs[job]}

        kls = branch_kls(ctx.source, chunks, [layer for layer, _ in order],
                         lambda model: projected_kv(model, select, layout.rotary_module), ctx.progress)  # fmt: skip
        ran = {"rank": probe_rank(self.config, layout.num_layers, layout.kv_width), "rounds": self.config.probe_rounds,
               "chunks": int(chunks.shape[0]), "chunk_len": int(chunks.shape[1])}  # fmt: skip
        return dict(zip(order, kls, strict=True)), ran

    def _probe_again(
        self, ctx: PlanContext, weighting: Weighting, calib: Any, plan: LorcRanks,
        probes: dict[str, list[list[tuple[int, float]]]],
    ) -> None:  # fmt: skip
        """One more round: every factored side probed at the rank ``plan`` gives it (the layers
        read again from the checkpoint, one at a time), appended to ``probes``. A side already probed
        at that rank, or kept at full width, repeats its last measurement."""
        from kvconvert.arch import adapter_for

        source, layout = ctx.source, ctx.layout
        adapter = adapter_for(source.config)
        names = adapter.attention_names_by_layer(source.tensor_names())

        def rank_of(layer: int, side: str) -> int:
            rank = plan.rank_k[layer] if side == "k" else plan.rank_v[layer]
            assert rank is not None, "auto factors every layer of a probed side"
            return rank

        jobs: dict[tuple[int, str], Affine] = {}
        for layer in range(layout.num_layers):
            w = adapter.read_attention({local: source.get(name) for local, name in names[layer].items()})
            for side, (weight, right, left) in self._targets(weighting, layout, layer, w).items():
                rank = rank_of(layer, side) if side in probes else layout.kv_width
                if rank < layout.kv_width and rank != probes[side][layer][-1][0]:
                    jobs[layer, side] = _affine(weight, rank, right, left, w.k_bias if side == "k" else w.v_bias)
        measured = self._probe(ctx, calib, jobs)[0] if jobs else {}
        for side, layers in probes.items():
            for layer, points in enumerate(layers):
                job = (layer, side)
                points.append((rank_of(layer, side), measured[job]) if job in measured else points[-1])

    def convert_layer(
        self, planned: LorcPlan | MlaPlan, layer: int, weights: AttentionWeights, dtype: torch.dtype
    ) -> LayerOutput:
        if isinstance(planned, MlaPlan):
            return _mla_layer(planned, layer, weights, dtype)
        plan, layout = planned.ranks, planned.layout
        report: dict[str, Any] = {
            "layer": layer,
            "kappa_k": plan.kappa_k[layer],
            "kappa_v": plan.kappa_v[layer],
            "log10_kappa_cum": plan.log10_kappa_cum[layer],
            "rank_k": plan.rank_k[layer],
            "rank_v": plan.rank_v[layer],
        }
        for side, kls in (("k", plan.probe_kl_k), ("v", plan.probe_kl_v)):
            if kls and kls[layer] is not None:
                report[f"{side}_probe_kl"] = kls[layer]
        for side, points in plan.probes.items():
            if len(points[layer]) > 1:  # later rounds: (rank, KL) as measured
                report[f"{side}_probes"] = [list(p) for p in points[layer]]
        for key, value in planned.refine_log.get(layer, {}).items():
            report[f"refine_{key}"] = value
        if not plan.compressed[layer]:
            return LayerOutput(tensors={}, report=report, passthrough=True)
        targets = self._targets(planned.weighting, layout, layer, weights)
        joint = None if plan.joint_scales is None else plan.joint_scales[layer]
        spectra: dict[str, torch.Tensor] = {}  # σ of the closed-form truncations (refined sides: computed below)
        tensors = factor_attention(weights, layout, plan.rank_k[layer], plan.rank_v[layer],
                                   right=targets["k"][1], left_k=targets["k"][2], left_v=targets["v"][2],
                                   refined=planned.refined.get(layer, {}), joint=joint, spectra=spectra)  # fmt: skip
        if joint is not None:  # one latent: the stacked, loss-weighted matrix's relative error
            rank = plan.rank_k[layer]
            assert rank is not None
            if "kv" not in spectra:
                stacked, left, right = self._stacked(planned.weighting, layout, layer, weights, joint)
                spectra["kv"] = linalg.weighted_singular_values(stacked, right, left)
            report["kv_rel_output_error"] = linalg.relative_frobenius_error(spectra["kv"], rank)
            report["kv_scales"] = list(joint)
            return LayerOutput(tensors={k: v.to(dtype) for k, v in tensors.items()}, report=report)
        for side, rank in (("k", plan.rank_k[layer]), ("v", plan.rank_v[layer])):
            if rank is None:
                continue
            weight, right, left = targets[side]
            svals = spectra[side] if side in spectra else linalg.weighted_singular_values(weight, right, left)
            # calibrated: the relative error of what the side produces on the calibration inputs
            key = "rel_output_error" if right is not None else "rel_frobenius_error"
            report[f"{side}_{key}"] = linalg.relative_frobenius_error(svals, rank)
            report[f"{side}_sigma_next"] = float(svals[rank]) if rank < svals.numel() else 0.0
        return LayerOutput(tensors={k: v.to(dtype) for k, v in tensors.items()}, report=report)

    def refit(self, plan: LorcPlan | MlaPlan, directory: Path, source: Any, progress: bool = True) -> dict[str, Any]:
        """``--distill-steps``: the MLA export fitted through the whole model on calibration chunks of
        ``distill_len`` tokens (``methods.lorc.distill``)."""
        config = self.config
        if not isinstance(plan, MlaPlan) or not config.distill_steps:
            return {}
        from kvconvert.calib.text import calibration_set
        from kvconvert.methods.lorc.distill import distill_export

        length = min(config.distill_len, plan.layout.context)
        # up to ``distill_chunks``: a calibration text shorter than that many chunks gives what it holds
        calib = calibration_set(source.path, config.calib, config.distill_chunks * length, length, config.seed,
                                fewer=True)  # fmt: skip
        return {"distill": distill_export(directory, source.path, calib.chunks, config.distill_steps, config.seed,
                                          progress)}  # fmt: skip

    def summary(self, plan: LorcPlan | MlaPlan) -> dict[str, Any]:
        """Whole-model decisions (``kvconvert.json`` → ``plan``): the calibration and auto's probes; an MLA export's
        widths."""
        summary: dict[str, Any] = {"calibration": plan.calibration} if plan.calibration else {}
        if isinstance(plan, MlaPlan):
            summary["mla"] = {"kv_lora_rank": plan.kv_lora_rank, "rope_dim": plan.rope_dim}
            if plan.written:
                rank, rope = plan.written
                summary["mla"]["written"] = {"kv_lora_rank": rank, "rope_dim": rope, "for": self.config.mla_sizes}
        return summary

    def runtime_spec(
        self, plan: LorcPlan | MlaPlan, layout: AttentionLayout, tensor_names: list[list[str]]
    ) -> dict[str, Any]:
        if isinstance(plan, MlaPlan):
            # stock DeepSeek-V3 attention caches the normalised latent and the shared RoPE key itself: kvconvert's
            # runtime keeps every layer's stock module and cache layer
            return {"lorc_layers": [None] * layout.num_layers,
                    "lorc_mla": dict(zip(("kv_lora_rank", "rope_dim"), plan.cached, strict=True))}  # fmt: skip
        ranks = plan.ranks
        layers: list[dict[str, Any] | None] = []
        for i, names in enumerate(tensor_names):
            if not ranks.compressed[i]:
                layers.append(None)  # stock attention and weights
                continue
            layers.append({
                "rank_k": ranks.rank_k[i], "rank_v": ranks.rank_v[i],
                "biases": sorted(n.removesuffix(".bias") for n in names if n.endswith(".bias")),
                **({"joint": True} if ranks.joint_scales is not None else {}),
            })  # fmt: skip
        # the norm per head (Qwen3: a [dk] weight) or over all heads at once (OLMo 2)
        return {"lorc_layers": layers, **qk_norm_spec(layout)}


def _mla_layer(
    plan: MlaPlan, layer: int, weights: AttentionWeights, dtype: torch.dtype, padded: bool = True
) -> LayerOutput:  # fmt: skip
    """``latent="mla"``: one layer's DeepSeek-V3 attention tensors (``methods.lorc.mla``) and report; ``padded``: at
    the sizes the checkpoint is written at (``MlaPlan.written``), else at the plan's own."""
    from kvconvert.arch.mla import LATENT_NORM_EPS
    from kvconvert.methods.lorc.mla import mla_attention, mla_tensors, padded_mla

    tensors, report = mla_attention(weights, plan.layout, plan.input_grams[layer], plan.kv_lora_rank, plan.rope_dim,
                                    plan.rotations[layer], plan.query_scale, LATENT_NORM_EPS)  # fmt: skip
    if layer in plan.refined:
        tensors.update(mla_tensors(plan.refined[layer]))
    if plan.written and padded:
        tensors = padded_mla(tensors, plan.layout.num_heads, plan.layout.head_dim, plan.kv_lora_rank, *plan.written)
    report.update({f"refine_{key}": value for key, value in plan.refine_log.get(layer, {}).items()})
    return LayerOutput({k: v.to(dtype) for k, v in tensors.items()},
                       report={"layer": layer, "rank": plan.kv_lora_rank, **report})  # fmt: skip


def _affine(
    weight: torch.Tensor, rank: int, right: Any, left: Any, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Π, c)`` float32 with ``Π·(Wx + b) + c = up·down·x + b``: a truncated side as
    ``calib.projection.projected_kv`` applies it to the source's keys or values (the bias is kept exactly)."""
    projector = linalg.truncation_projector(weight, rank, right, left)
    offset = torch.zeros(projector.shape[0], dtype=linalg.F64) if bias is None else bias.to(linalg.F64)
    return projector.float(), (offset - projector @ offset).float()


def _head_blocks(matrix: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """Split rows of ``[heads·dk, …]`` into per-head ``[dk, …]`` blocks."""
    return list(matrix.view(heads, -1, *matrix.shape[1:]).unbind(0))


def _linear(out: dict[str, torch.Tensor], name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Store a Linear's weight (and bias, if any) under ``name.weight`` / ``name.bias``, float64."""
    out[f"{name}.weight"] = weight.to(linalg.F64)
    if bias is not None:
        out[f"{name}.bias"] = bias.to(linalg.F64)


def factor_attention(
    w: AttentionWeights, layout: AttentionLayout, rank_k: int | None, rank_v: int | None,
    right: torch.Tensor | None = None, left_k: torch.Tensor | None = None, left_v: torch.Tensor | None = None,
    refined: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    joint: tuple[float, float] | None = None, spectra: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """LoRC's rewritten projections for one layer, float64, names local to the attention module.

    Shapes (H query heads, G = H / Hkv per group, dk head dim, D hidden, r ranks):
    ``k_down [r_k, D]``; with RoPE ``k_up [Hkv·dk, r_k]`` (+ K bias), else ``q_proj [H·r_k, D]`` with
    U_K folded in per head (the K bias only adds a per-query constant to the scores: dropped, exact);
    ``v_down [r_v, D]`` and ``o_proj [D, H·r_v]`` with U_V folded in (V bias folded into the O bias).
    ``right``, ``left_k``, ``left_v``: the factors of ``linalg.weighted_truncation`` (None: plain SVD, the paper).
    ``refined[side] = (A, B)``: a side's truncation fitted by ``methods.lorc.refine`` instead (up = A, down = B·W).
    ``joint = (scale_k, scale_v)``: one latent for both (``rank_k == rank_v``), ``kv_down [r, D]`` in place
    of ``k_down`` and ``v_down``, factored by ``linalg.joint_truncation`` with these weights (refined: side "kv").
    ``spectra``: filled with each closed-form truncation's σ by side ("k", "v" or "kv"), for the report.
    """
    refined = refined or {}

    def truncate(side: str, weight: torch.Tensor, rank: int, left: torch.Tensor | None) -> tuple[Any, Any]:
        if side in refined:
            a, b = refined[side]
            return a.to(f64), b.to(f64) @ weight.to(f64)
        up, down, sigma = linalg.weighted_truncation(weight, rank, right, left)  # [e, r], [r, D]
        if spectra is not None:
            spectra[side] = sigma
        return up, down

    f64 = linalg.F64
    heads, kv_heads = layout.num_heads, layout.num_kv_heads
    group = heads // kv_heads
    out: dict[str, torch.Tensor] = {}
    factors: dict[str, tuple[Any, Any]] = {}  # side -> (up [e, r], down [r, D])
    if joint is not None:
        assert rank_k is not None and rank_k == rank_v, "a joint latent has one rank"
        # the stacked [W_K; W_V] is truncated like one side (closed form: ``linalg.joint_truncation``)
        stacked, left_kv = linalg.stacked_weights([w.k_weight, w.v_weight], list(joint), [left_k, left_v])
        up, down = truncate("kv", stacked, rank_k, left_kv)
        up_k, up_v = up.split([w.k_weight.shape[0], w.v_weight.shape[0]])
        factors = {"k": (up_k, down), "v": (up_v, down)}
        _linear(out, "kv_down", down, None)
    else:
        for side, weight, rank, left in (("k", w.k_weight, rank_k, left_k), ("v", w.v_weight, rank_v, left_v)):
            if rank is not None:
                factors[side] = truncate(side, weight, rank, left)
                _linear(out, f"{side}_down", factors[side][1], None)

    if rank_k is None:
        _linear(out, "k_proj", w.k_weight, w.k_bias)
        _linear(out, "q_proj", w.q_weight, w.q_bias)
    else:
        up = factors["k"][0]
        if layout.rotary:
            _linear(out, "k_up", up, w.k_bias)
            _linear(out, "q_proj", w.q_weight, w.q_bias)
        else:
            up_heads = _head_blocks(up, kv_heads)  # Hkv × [dk, r]
            q_heads = _head_blocks(w.q_weight.to(f64), heads)  # H × [dk, D]
            q_weight = torch.cat([up_heads[i // group].T @ q_heads[i] for i in range(heads)])
            q_bias = None
            if w.q_bias is not None:
                qb_heads = _head_blocks(w.q_bias.to(f64), heads)
                q_bias = torch.cat([up_heads[i // group].T @ qb_heads[i] for i in range(heads)])
            _linear(out, "q_proj", q_weight, q_bias)

    if rank_v is None:
        _linear(out, "v_proj", w.v_weight, w.v_bias)
        _linear(out, "o_proj", w.o_weight, w.o_bias)
    else:
        o_w = w.o_weight.to(f64)  # [D, H·dk]
        up = factors["v"][0]
        up_heads = _head_blocks(up, kv_heads)  # Hkv × [dk, r]
        o_heads = _head_blocks(o_w.T.contiguous(), heads)  # H × [dk, D]
        o_weight = torch.cat([o_heads[i].T @ up_heads[i // group] for i in range(heads)], dim=1)
        o_bias = None if w.o_bias is None else w.o_bias.to(f64)
        if w.v_bias is not None:
            # softmax rows sum to one, so the V bias reaches W_O unchanged: fold it into the O bias
            v_bias_per_query_head = w.v_bias.to(f64).view(kv_heads, -1).repeat_interleave(group, dim=0).reshape(-1)
            o_bias = (
                o_bias if o_bias is not None else torch.zeros(o_w.shape[0], dtype=f64)
            ) + o_w @ v_bias_per_query_head
        _linear(out, "o_proj", o_weight, o_bias)
    return {**out, **qk_norm_tensors(w)}  # QK-norm: applied as the source does
