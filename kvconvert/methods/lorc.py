"""LoRC (Zhang et al. 2024): low-rank K/V weights with a progressive, condition-number-driven rank schedule.

Per layer, W_K ≈ U_K·(Σ_K V_Kᵀ) and W_V ≈ U_V·(Σ_V V_Vᵀ) by truncated SVD (paper eqs. 5–9). The cache
holds the rank-d_c latents ``x·(ΣVᵀ)ᵀ``; U_V is folded into W_O so values are never rebuilt; U_K is
folded into W_Q when there is no RoPE, and with RoPE keys are rebuilt per head from the latent and
rotated at attention time (appendix E; the latent cannot absorb a position-dependent rotation).
Ranks follow eq. 13 over the cumulative condition numbers of eq. 12; layers above ``threshold``
(log10 κ̃) are left uncompressed (appendix F.1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

import torch

from kvconvert import linalg
from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import LayerOutput, Method

Schedule = Literal["progressive", "uniform"]
Target = Literal["kv", "k", "v"]


@dataclass(frozen=True)
class LorcConfig:
    """Options of ``kvconvert lorc``."""

    kv_budget: float
    schedule: Schedule = "progressive"
    # Layers with log10 κ̃ above this stay uncompressed (paper F.1 gives 30 for Llama-3-8B and 90 for
    # Llama-2-13B / Llama-3-70B without units; raw κ̃ reaches 1e68 on SmolLM2, so it must be log10).
    threshold: float | None = None
    compress: Target = "kv"  # which of K and V are factored

    def __post_init__(self) -> None:
        if not 0 < self.kv_budget <= 1:
            raise KVConvertError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if self.schedule not in ("progressive", "uniform"):
            raise KVConvertError(f"schedule must be progressive or uniform, got {self.schedule!r}")
        if self.compress not in ("kv", "k", "v"):
            raise KVConvertError(f"compress must be kv, k or v, got {self.compress!r}")


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


@dataclass
class LorcPlan:
    kappa_k: list[float]
    kappa_v: list[float]
    log10_kappa_cum: list[float]
    compressed: list[bool]  # False: left uncompressed (threshold)
    rank_k: list[int | None]  # None: K not factored in this layer
    rank_v: list[int | None]
    budget: float = field(default=0.0)


def plan_ranks(config: LorcConfig, kappa_k: list[float], kappa_v: list[float], width: int) -> LorcPlan:
    """Decide per-layer ranks so that Σ cached widths / (2·L·e) equals ``config.kv_budget``."""
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
    if config.schedule == "progressive":
        ranks = progressive_ranks(ln_cum, compressed, width, per_side)
    else:
        ranks = uniform_ranks(compressed, width, per_side)
    rank_k = [r if c and "k" in factored else None for r, c in zip(ranks, compressed, strict=True)]
    rank_v = [r if c and "v" in factored else None for r, c in zip(ranks, compressed, strict=True)]
    cached = sum((rk or width) + (rv or width) for rk, rv in zip(rank_k, rank_v, strict=True))
    return LorcPlan(kappa_k, kappa_v, log10_cum, compressed, rank_k, rank_v, budget=cached / (2 * layers * width))


class LorcMethod(Method):
    name = "lorc"
    unsupported: ClassVar[dict[str, str]] = {
        "qk_norm": "its keys are RMS-normalised per head before RoPE (QK-norm): keys rebuilt from a low-rank latent "
                   "would need the norm applied after the up-projection (not implemented); use quant or razor",
        "local_layers": "its sliding-window layers need a cache that forgets beyond the window (not implemented for "
                        "lorc); use quant or razor",
        "softcap": "lorc's attention does not apply attention-logit soft-capping; use quant",
        "layer_rope": "lorc re-rotates rebuilt keys with one RoPE table, and this model has one per layer type",
    }  # fmt: skip

    def __init__(self, config: LorcConfig):
        self.config = config
        self.plan_: LorcPlan | None = None
        self.layout: AttentionLayout | None = None

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        ranks = [r["rank_k"] for r in report["layers"]]
        return (
            "LoRC caches rank-d_c latents of K and V (low-rank W_K, W_V by SVD; U_V folded into W_O). "
            f"Schedule {report['params']['schedule']}, factored {report['params']['compress']}; "
            f"K ranks per layer: {ranks}."
        )

    def params(self) -> dict[str, Any]:
        return asdict(self.config)

    def expected_kv_budget(self, layout: AttentionLayout) -> float:
        assert self.plan_ is not None
        return self.plan_.budget

    def plan(
        self, layout: AttentionLayout, layers: Iterable[AttentionWeights], source: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        """κ(W_K), κ(W_V) of every layer (full D × n_kv·d matrices, appendix D), then the ranks."""
        kappa_k, kappa_v = [], []
        for w in layers:
            kappa_k.append(linalg.condition_number(w.k_weight))
            kappa_v.append(linalg.condition_number(w.v_weight))
        self.layout = layout
        self.plan_ = plan_ranks(self.config, kappa_k, kappa_v, layout.kv_width)

    def convert_layer(self, layer: int, weights: AttentionWeights, dtype: torch.dtype) -> LayerOutput:
        plan, layout = self.plan_, self.layout
        assert plan is not None and layout is not None, "plan() runs before convert_layer()"
        report: dict[str, Any] = {
            "layer": layer,
            "kappa_k": plan.kappa_k[layer],
            "kappa_v": plan.kappa_v[layer],
            "log10_kappa_cum": plan.log10_kappa_cum[layer],
            "rank_k": plan.rank_k[layer],
            "rank_v": plan.rank_v[layer],
        }
        if not plan.compressed[layer]:
            return LayerOutput(tensors={}, report=report, passthrough=True)
        tensors = factor_attention(weights, layout, plan.rank_k[layer], plan.rank_v[layer])
        for side, rank, weight in (
            ("k", plan.rank_k[layer], weights.k_weight),
            ("v", plan.rank_v[layer], weights.v_weight),
        ):
            if rank is not None:
                svals = torch.linalg.svdvals(weight.to(linalg.F64))
                report[f"{side}_rel_frobenius_error"] = linalg.relative_frobenius_error(svals, rank)
                report[f"{side}_sigma_next"] = float(svals[rank]) if rank < svals.numel() else 0.0
        return LayerOutput(tensors={k: v.to(dtype) for k, v in tensors.items()}, report=report)

    def runtime_spec(self, layout: AttentionLayout, tensor_names: list[list[str]]) -> dict[str, Any]:
        assert self.plan_ is not None
        layers: list[dict[str, Any] | None] = []
        for i, names in enumerate(tensor_names):
            if not self.plan_.compressed[i]:
                layers.append(None)  # stock attention and weights
                continue
            layers.append({
                "rank_k": self.plan_.rank_k[i], "rank_v": self.plan_.rank_v[i],
                "biases": sorted(n.removesuffix(".bias") for n in names if n.endswith(".bias")),
            })  # fmt: skip
        return {"lorc_layers": layers}


def _head_blocks(matrix: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """Split rows of ``[heads·dk, …]`` into per-head ``[dk, …]`` blocks."""
    return list(matrix.view(heads, -1, *matrix.shape[1:]).unbind(0))


def _linear(out: dict[str, torch.Tensor], name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Store a Linear's weight (and bias, if any) under ``name.weight`` / ``name.bias``, float64."""
    out[f"{name}.weight"] = weight.to(linalg.F64)
    if bias is not None:
        out[f"{name}.bias"] = bias.to(linalg.F64)


def factor_attention(
    w: AttentionWeights, layout: AttentionLayout, rank_k: int | None, rank_v: int | None
) -> dict[str, torch.Tensor]:
    """LoRC's rewritten projections for one layer, float64, names local to the attention module.

    Shapes (H query heads, G = H / Hkv per group, dk head dim, D hidden, r ranks):
    ``k_down [r_k, D]``; with RoPE ``k_up [Hkv·dk, r_k]`` (+ K bias), else ``q_proj [H·r_k, D]`` with
    U_K folded in per head (the K bias only adds a per-query constant to the scores: dropped, exact);
    ``v_down [r_v, D]`` and ``o_proj [D, H·r_v]`` with U_V folded in (V bias folded into the O bias).
    """
    f64 = linalg.F64
    heads, kv_heads = layout.num_heads, layout.num_kv_heads
    group = heads // kv_heads
    out: dict[str, torch.Tensor] = {}

    if rank_k is None:
        _linear(out, "k_proj", w.k_weight, w.k_bias)
        _linear(out, "q_proj", w.q_weight, w.q_bias)
    else:
        up, down = linalg.truncated_svd(w.k_weight, rank_k)  # [e, r], [r, D]
        _linear(out, "k_down", down, None)
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
        up, down = linalg.truncated_svd(w.v_weight, rank_v)
        _linear(out, "v_down", down, None)
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
    return out
