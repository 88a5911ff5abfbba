"""MiniCache (Liu et al. 2024): adjacent layers from mid-depth share one KV direction tensor.

Weights are copied unchanged; the conversion only decides the merge plan (§4.1): the start layer
S (default L/2, the paper's choice), the pairs (S, S+1), (S+2, S+3), … up to the last layer, the
SLERP parameter t (0.6) and the retention threshold γ (0.05). S can instead follow from a KV
budget (how many of the deepest layers to merge) or from measured adjacent-layer similarity on
calibration text (the shallowest S from which every pair keeps a target cosine similarity).
The runtime (``kvconvert_minicache``) does the merging, retention and restoration.

``merge="subspace"`` (an extension, after xKV 2025) shares a *subspace* instead of a direction: per
pair and side, one latent per token ``z = Σ_m (x_m − μ_m)·E_m`` from which each layer reads back its own
states ``x̂_m = μ_m + z·D_m``. E and D are the weighted principal subspace of the pair's stacked states
on calibration text (``linalg.shared_subspace``: key errors weighted by the queries that read them,
value errors by W_O), each layer's part of it written next to that layer's attention weights; the
latent widths are allocated over all pairs and sides by the measured loss (``linalg.allocate_ranks``).
It needs no similarity between the layers' states, only shared structure, which plain per-layer
truncation is the block-diagonal special case of.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvconvert import linalg
from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import LayerOutput, Method, PlanContext, budget_words
from kvconvert.methods.minicache.config import MiniCacheConfig

NORM_BYTES = 4  # per token, layer and side: norms are float32 whatever the cache dtype
INDEX_BYTES = 8  # per retained token and side: (batch row, position) as int32


def merge_pairs(start: int, num_layers: int) -> list[tuple[int, int]]:
    """(S, S+1), (S+2, S+3), … while both layers exist (an odd layer left at the end stays unmerged)."""
    return [(first, first + 1) for first in range(start, num_layers - 1, 2)]


def kv_bytes_per_token(
    layout: AttentionLayout,
    pairs: int,
    element_bytes: int,
    retained_k: float,
    retained_v: float,
    merge: str = "slerp",
) -> tuple[int | float, int]:
    """(MiniCache bytes, original bytes) per token for ``pairs`` merged pairs.

    Per pair and side: one direction vector (h elements), two float32 norms (SLERP only) and, for
    the retained share f of tokens, both layers' exact vectors (2h elements) and their int32
    (row, position). The paper's appendix E counts the same parts, (3.1h + 2) per token in place
    of 4h for half the layers merged at f = 0.05 (norms and indices there in units of one element).
    """
    h = layout.kv_width
    original = 2 * layout.num_layers * h * element_bytes
    unmerged = 2 * (layout.num_layers - 2 * pairs) * h * element_bytes
    norms = 2 * NORM_BYTES if merge == "slerp" else 0
    per_side = [h * element_bytes + norms + f * (2 * h * element_bytes + INDEX_BYTES) for f in (retained_k, retained_v)]
    return unmerged + pairs * sum(per_side), original


def subspace_bytes_per_token(
    layout: AttentionLayout, ranks: list[tuple[int, int]], element_bytes: int
) -> tuple[int, int]:
    """(bytes, original bytes) per token with ``ranks[p] = (r_k, r_v)`` latent widths per merged pair."""
    h = layout.kv_width
    original = 2 * layout.num_layers * h * element_bytes
    unmerged = 2 * (layout.num_layers - 2 * len(ranks)) * h * element_bytes
    return unmerged + sum(r_k + r_v for r_k, r_v in ranks) * element_bytes, original


@dataclass
class SubspaceFit:
    """One pair's side: ``lower``, ``vectors``, ``eigenvalues`` of ``linalg.shared_subspace`` (losses in
    units of each layer's own weighted energy) and the stacked mean ``[2·h]``."""

    lower: torch.Tensor
    vectors: torch.Tensor
    eigenvalues: torch.Tensor
    mean: torch.Tensor

    def losses(self) -> torch.Tensor:
        """Loss at latent width r = 0..2h: Σ of the eigenvalues left out (2 at r = 0, 0 at full width)."""
        return linalg.tail_energy(self.eigenvalues.sqrt()) * self.eigenvalues.sum()


def fit_pair_subspace(mean: torch.Tensor, covariance: torch.Tensor, metrics: list[torch.Tensor]) -> SubspaceFit:
    """``shared_subspace`` of one pair's side, each member's ``metrics [Hkv, dk, dk]`` scaled so that its own
    weighted energy ``tr(M_m C_mm)`` is 1: an error is then a share of what that layer holds."""
    width = covariance.shape[0] // 2
    scaled = []
    for member, metric in enumerate(metrics):
        block = covariance[member * width : (member + 1) * width, member * width : (member + 1) * width]
        energy = float((torch.block_diag(*metric.to(torch.float64)) * block).sum())  # tr(M C), both symmetric
        scaled.append(metric.to(torch.float64) / max(energy, 1e-300))
    lower, vectors, eigenvalues = linalg.shared_subspace(covariance, torch.cat(scaled))
    return SubspaceFit(lower, vectors, eigenvalues, mean)


@dataclass(frozen=True)
class MiniCachePlan:
    """What minicache decided for a model: the first merged layer (the pairs follow), the bytes of one
    cached element, the retention shares the budget counts (appendix E's γ, or measured), the adjacent-layer
    similarity when measured; ``merge: subspace``: each pair's fitted (keys, values) subspaces, their latent
    widths and the calibration text."""

    num_layers: int
    start: int
    element_bytes: int
    retained: tuple[float, float]
    similarity: dict[str, Any] | None = None
    fits: tuple[tuple[SubspaceFit, SubspaceFit], ...] = ()
    ranks: tuple[tuple[int, int], ...] = ()
    calib_source: str | None = None

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return merge_pairs(self.start, self.num_layers)


class MiniCacheMethod(Method[MiniCachePlan]):
    name = "minicache"
    unsupported: ClassVar[dict[str, str]] = {
        "local_layers": "merging needs two adjacent layers that cache the same tokens, and a sliding-window layer "
        "caches only its window (not implemented); use quant or razor",
        "softcap": "minicache's attention does not apply attention-logit soft-capping; use quant",
    }

    @classmethod
    def headline(cls, report: dict[str, Any]) -> str:
        plan = report["plan"]
        pairs = ", ".join(f"{a}-{b}" for a, b in plan["pairs"]) or "none"
        return f"minicache from layer {plan['start_layer']}, pairs {pairs}; {budget_words(report)}"

    def __init__(self, config: MiniCacheConfig | None = None):
        self.config = config or MiniCacheConfig()

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        plan = report["plan"]
        pairs = ", ".join(f"{a}-{b}" for a, b in plan["pairs"]) or "none"
        if plan["merge"] == "subspace":
            return (
                f"MiniCache with shared subspaces (a kvconvert extension after xKV, not the paper's merge): adjacent "
                f"layer pairs ({pairs}) store one latent per token and side, from which each layer restores its own "
                "keys and values through its decoder; the subspaces are fitted on calibration text and the latent "
                "widths allocated by the measured loss. Quality shows when text is decoded through the cache "
                "(`kvconvert eval --chunk 1`), not in a single forward."
            )
        return (
            f"MiniCache: adjacent layer pairs ({pairs}) share one K and one V direction tensor "
            f"(SLERP, t = {plan['t']}) plus per-token norms of each layer; tokens at the far end of the "
            f"distance range (γ = {plan['gamma']}) are kept unmerged. Only cached states are merged, so quality "
            "shows when text is decoded through the cache (`kvconvert eval --chunk 1`), not in a single forward."
        )

    @classmethod
    def report_table(cls, report: dict[str, Any]) -> str:
        from kvconvert.methods.minicache.layer_similarity import similarity_table

        plan, lines = report["plan"], []
        if "layer_similarity" in plan:
            lines.append(similarity_table(plan["layer_similarity"], merged={tuple(p) for p in plan["pairs"]}))
        if "ranks" in plan:
            lines.append(f"{'pair':>7}  {'K width':>7}  {'K loss':>8}  {'V width':>7}  {'V loss':>8}")
            for (a, b), (r_k, r_v) in zip(plan["pairs"], plan["ranks"], strict=True):
                row = report["layers"][a]
                lines.append(f"{a:>3}-{b:<3}  {r_k:>7}  {row['loss_k']:>8.4f}  {r_v:>7}  {row['loss_v']:>8.4f}")
        return "\n".join(lines)

    def check(self, layout: AttentionLayout) -> None:
        if self.config.start_layer is not None and self.config.start_layer > layout.num_layers:
            raise KVConvertError(
                f"--start-layer {self.config.start_layer} is past the model's {layout.num_layers} layers "
                f"(use {layout.num_layers} to merge nothing)"
            )

    def budget(
        self, layout: AttentionLayout, pairs: int, element_bytes: int, retained: tuple[float, float],
        ranks: tuple[tuple[int, int], ...] = (),
    ) -> float:  # fmt: skip
        """Cache bytes ÷ the source's with ``pairs`` merged pairs (subspace: of ``ranks`` widths)."""
        if self.config.merge == "subspace":
            latent, full = subspace_bytes_per_token(layout, list(ranks), element_bytes)
            return latent / full
        new, original = kv_bytes_per_token(layout, pairs, element_bytes, *retained, self.config.merge)
        return new / original

    def plan(self, ctx: PlanContext) -> MiniCachePlan:
        config, layout, layers, source, dtype = self.config, ctx.layout, ctx.layers, ctx.source, ctx.dtype
        element_bytes = 2
        if dtype is not None:  # the merged states are cached in the converted model's dtype
            element_bytes = torch.empty((), dtype=dtype).element_size()
        else:
            remaining = iter(layers)
            first = next(remaining, None)
            if first is not None:
                element_bytes = first.k_weight.element_size()
                layers = itertools.chain([first], remaining)  # the subspace fit reads every layer's W_O
        if config.merge == "subspace":
            return self._plan_subspace(layout, layers, source, element_bytes, ctx.progress)
        similarity = None
        if config.measures:
            from kvconvert.methods.minicache.layer_similarity import measure_layer_similarity

            similarity = measure_layer_similarity(source, config.calib, config.calib_tokens, config.chunk_len,
                                                  config.seed, config.gamma, ctx.progress)  # fmt: skip
        retained = (config.gamma, config.gamma)  # appendix E's assumption until measured
        if config.start_layer is not None:
            start = config.start_layer
        elif config.kv_budget is not None:
            start = self._start_for_budget(layout, config.kv_budget, element_bytes, retained)
        elif config.min_similarity is not None:
            assert similarity is not None
            start = self._start_for_similarity(layout, config.min_similarity, similarity)
        else:
            start = layout.num_layers // 2
        pairs = merge_pairs(start, layout.num_layers)
        if similarity is not None and pairs:  # measured retention replaces the assumed one
            chosen = [similarity["pairs"][first_layer] for first_layer, _ in pairs]
            retained = (
                sum(p["retained_k"] for p in chosen) / len(chosen),
                sum(p["retained_v"] for p in chosen) / len(chosen),
            )
        return MiniCachePlan(layout.num_layers, start, element_bytes, retained, similarity)

    def _plan_subspace(
        self, layout: AttentionLayout, layers: Iterable[AttentionWeights], source: Any, element_bytes: int,
        progress: bool,
    ) -> MiniCachePlan:  # fmt: skip
        """Pairs from S (default: every layer with ``kv_budget``, L/2 without), fitted on calibration text;
        latent widths: half of each pair's stacked width, or allocated by loss to meet ``kv_budget``."""
        from kvconvert.arch import adapter_for
        from kvconvert.calib.text import calibration_set
        from kvconvert.methods.minicache.subspace import collect_pair_moments

        config = self.config
        if config.start_layer is not None:
            start = config.start_layer
        else:
            start = 0 if config.kv_budget is not None else layout.num_layers // 2
        retained = (config.gamma, config.gamma)
        pairs = merge_pairs(start, layout.num_layers)
        members = {layer for pair in pairs for layer in pair}
        o_grams = {i: linalg.output_gram(w.o_weight, layout.num_heads, layout.num_kv_heads, layout.head_dim)
                   for i, w in enumerate(layers) if i in members}  # fmt: skip
        if not pairs:
            return MiniCachePlan(layout.num_layers, start, element_bytes, retained)
        adapter = adapter_for(source.config)
        calib_set = calibration_set(source.path, config.calib, config.calib_tokens,
                                    min(config.chunk_len, layout.context), config.seed)  # fmt: skip
        moments = collect_pair_moments(source, adapter, pairs, calib_set.chunks, progress=progress)
        fits = []
        for p, (a, b) in enumerate(pairs):
            keys = fit_pair_subspace(*moments.covariance(p, 0), [moments.query[a], moments.query[b]])
            values = fit_pair_subspace(*moments.covariance(p, 1), [o_grams[a], o_grams[b]])
            fits.append((keys, values))
        width = 2 * layout.kv_width
        curves = [fit.losses() for pair in fits for fit in pair]
        if config.kv_budget is None:
            widths = [width // 2] * len(curves)
        elif config.kv_budget >= 1:
            widths = [width] * len(curves)
        else:
            unmerged = 2 * (layout.num_layers - 2 * len(pairs)) * layout.kv_width
            total = int(config.kv_budget * 2 * layout.num_layers * layout.kv_width) - unmerged
            if total < len(curves):
                raise KVConvertError(f"kv_budget {config.kv_budget} leaves less than one latent channel per merged "
                                     f"pair and side; raise it")  # fmt: skip
            widths = linalg.allocate_ranks(curves, total, low=1)
        ranks = tuple((widths[2 * p], widths[2 * p + 1]) for p in range(len(pairs)))
        return MiniCachePlan(layout.num_layers, start, element_bytes, retained, None, tuple(fits), ranks,
                             calib_set.source)  # fmt: skip

    def _start_for_budget(
        self, layout: AttentionLayout, kv_budget: float, element_bytes: int, retained: tuple[float, float]
    ) -> int:
        most = layout.num_layers // 2
        for count in range(most + 1):
            if self.budget(layout, count, element_bytes, retained) <= kv_budget:
                return layout.num_layers - 2 * count
        raise KVConvertError(
            f"kv_budget {kv_budget} is below what merging every layer pair reaches "
            f"({self.budget(layout, most, element_bytes, retained):.3f} at γ = {self.config.gamma}); raise it or "
            "lower --gamma"
        )

    def _start_for_similarity(self, layout: AttentionLayout, min_similarity: float, similarity: dict[str, Any]) -> int:
        from kvconvert.methods.minicache.layer_similarity import pair_similarity, shallowest_start

        pairs = similarity["pairs"]
        start = shallowest_start(pairs, layout.num_layers, min_similarity)
        if start is None:
            best = max(pairs, key=pair_similarity)
            raise KVConvertError(
                f"no layer pair reaches mean cosine similarity {min_similarity} on the calibration text (best: "
                f"{pair_similarity(best):.3f} at layers {best['layers'][0]}-{best['layers'][1]}); lower "
                "--min-similarity or set --start-layer"
            )
        return start

    def expected_kv_budget(self, plan: MiniCachePlan, layout: AttentionLayout) -> float:
        return self.budget(layout, len(plan.pairs), plan.element_bytes, plan.retained, plan.ranks)

    def convert_layer(
        self, plan: MiniCachePlan, layer: int, weights: AttentionWeights, dtype: torch.dtype
    ) -> LayerOutput:
        pairs = plan.pairs
        pair = next((p for p, members in enumerate(pairs) if layer in members), None)
        partner = None if pair is None else sum(pairs[pair]) - layer
        report: dict[str, Any] = {"layer": layer, "merged_with": partner}
        if plan.similarity is not None and layer > 0:
            row = plan.similarity["pairs"][layer - 1]
            report.update(cos_k_with_previous=round(row["cos_k"], 6), cos_v_with_previous=round(row["cos_v"], 6))
        tensors: dict[str, torch.Tensor] = {}
        if plan.fits and pair is not None:
            member = pairs[pair].index(layer)
            for side, fit, rank in zip("kv", plan.fits[pair], plan.ranks[pair], strict=True):
                tensors.update(subspace_tensors(fit, rank, member, side, dtype))
                report[f"rank_{side}"] = rank
                report[f"loss_{side}"] = round(float(fit.losses()[rank]) / 2, 6)  # share of the pair's energy
        return LayerOutput(tensors=tensors, report=report, passthrough=True)

    def runtime_spec(
        self, plan: MiniCachePlan, layout: AttentionLayout, tensor_names: list[list[str]]
    ) -> dict[str, Any]:
        return {"minicache": self.merge_plan(plan)}

    def merge_plan(self, plan: MiniCachePlan) -> dict[str, Any]:
        """What the runtime merges: the pairs, SLERP's t, the retention threshold (subspace: the widths)."""
        merge: dict[str, Any] = {
            "start_layer": plan.start,
            "pairs": [list(p) for p in plan.pairs],
            "t": self.config.t,
            "gamma": self.config.gamma,
            "merge": self.config.merge,
        }
        if self.config.merge == "subspace":
            merge["ranks"] = [list(r) for r in plan.ranks]
            merge["sink"] = self.config.sink
        return merge

    def summary(self, plan: MiniCachePlan) -> dict[str, Any]:
        """kvconvert.json's ``plan``: the merge plan, the retention shares the budget assumes, and the
        adjacent-layer similarity when it was measured."""
        if self.config.merge == "subspace":
            calibration = {"source": plan.calib_source, "tokens": self.config.calib_tokens}
            return {**self.merge_plan(plan), "calibration": calibration}
        summary: dict[str, Any] = {**self.merge_plan(plan), "retained_share_assumed": list(plan.retained)}
        summary["retention_source"] = "measured on calibration text" if plan.similarity else "γ (paper appendix E)"
        if plan.similarity is not None:
            summary["layer_similarity"] = plan.similarity
        return summary


def subspace_tensors(
    fit: SubspaceFit, rank: int, member: int, side: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Pair member ``member``'s share of a rank-``rank`` subspace, named as the runtime's parameters:
    ``subspace_{side}_encoder [h, r]``, ``subspace_{side}_decoder [r, h]``, ``subspace_{side}_mean [h]``."""
    encoder, decoder = linalg.subspace_factors(fit.lower, fit.vectors, rank)
    h = encoder.shape[0] // 2
    rows = slice(member * h, (member + 1) * h)
    return {
        f"subspace_{side}_encoder": encoder[rows].to(dtype).contiguous(),
        f"subspace_{side}_decoder": decoder[:, rows].to(dtype).contiguous(),
        f"subspace_{side}_mean": fit.mean[rows].to(dtype).contiguous(),
    }
