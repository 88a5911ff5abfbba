"""Slim attention (Graef & Wasielewski 2025): cache K only, V = K·W_KV with W_KV = W_K⁻¹·W_V.

Exact for MHA. W_KV replaces W_V in the checkpoint; K and V biases are handled exactly by
folding into the output bias (paper §4, extended to RoPE models by caching the K bias with K).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvconvert import linalg
from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import (
    LayerOutput,
    Method,
    PlanContext,
    layer_table,
    qk_norm_spec,
    qk_norm_tensors,
    rope_spec,
)
from kvconvert.methods.slim.config import SlimConfig


class SlimMethod(Method[None]):
    name = "slim"
    unsupported: ClassVar[dict[str, str]] = {
        "local_layers": "its sliding-window layers need a cache that forgets beyond the window; slim's keeps every "
                        "token (not implemented); use quant or razor",
        "softcap": "slim's attention does not apply attention-logit soft-capping; use quant",
        "layer_rope": "slim re-rotates cached keys with one RoPE table, and this model has one per layer type",
        "interleaved_rope": "slim re-rotates cached keys the rotate-half way, and this model's RoPE rotates "
                            "interleaved channel pairs (not implemented); use quant, razor or minicache",
    }  # fmt: skip

    def __init__(self, config: SlimConfig | None = None):
        self.config = config or SlimConfig()

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        worst = max(report["layers"], key=lambda r: r["v_rel_error"])
        return (
            "Slim attention caches only K and computes V = K·W_KV (exact up to rounding). "
            f"Largest κ(W_K): {max(r['kappa_k'] for r in report['layers']):.3g}; largest relative V error "
            f"on random inputs in {report['dtype']}: {worst['v_rel_error']:.2e} (layer {worst['layer']})."
        )

    @classmethod
    def report_table(cls, report: dict[str, Any]) -> str:
        return layer_table(report, [("κ(W_K)", "kappa_k", ".3g"), ("V rel. error", "v_rel_error", ".2e"),
                                    ("dtype rounding", "dtype_rel_error", ".2e")])  # fmt: skip

    def check(self, layout: AttentionLayout) -> None:
        if layout.num_kv_heads != layout.num_heads:
            raise KVConvertError(
                f"slim needs multi-head attention (one K head per query head) but this model has "
                f"{layout.num_heads} query heads sharing {layout.num_kv_heads} KV heads (GQA/MQA): "
                "V cannot be computed from a shared K; use lorc or razor instead"
            )
        if layout.qk_norm and (not layout.rotary or layout.nope_layers):  # no such model: QK-norm comes with RoPE
            raise KVConvertError("slim supports QK-norm only with RoPE in every layer (its keys are normed where "
                                 "they are rotated)")  # fmt: skip
        if layout.kv_width < layout.hidden_size:
            raise KVConvertError(
                f"slim needs K at least as wide as the hidden state ({layout.kv_width} < {layout.hidden_size}): "
                "W_K is not invertible"
            )

    def plan(self, ctx: PlanContext) -> None:
        """Nothing to decide for the whole model: every layer's W_KV follows from its own weights."""

    def expected_kv_budget(self, plan: None, layout: AttentionLayout) -> float:
        return 0.5

    def side_budgets(self, plan: None, layout: AttentionLayout) -> list[tuple[float, float]]:
        return [(1.0, 0.0)] * layout.num_layers  # the keys alone: values are rebuilt from them

    def convert_layer(self, plan: None, layer: int, weights: AttentionWeights, dtype: torch.dtype) -> LayerOutput:
        w = weights
        # float64 copies made once: the solve, κ and the error check all read them (a no-op for float64 input)
        k64, v64 = w.k_weight.to(linalg.F64), w.v_weight.to(linalg.F64)
        if k64.shape[0] == k64.shape[1]:  # standard MHA: one LU serves the map and κ
            try:
                factor = linalg.lu_factor(k64.T)
            except RuntimeError:  # an exactly zero pivot
                raise KVConvertError(f"layer {layer}: W_K is singular, so V cannot be computed from K") from None
            kv_weight = linalg.key_to_value_map(k64, v64, factor)  # [e, e] float64
            kappa = linalg.condition_number_from_lu(k64.T, factor)
        else:
            kv_weight = linalg.key_to_value_map(k64, v64)  # [e_v, e] float64, right inverse
            kappa = linalg.kappa(k64)
        o_bias = linalg.fold_value_bias(w.v_bias, w.k_bias, kv_weight, w.o_weight, w.o_bias)
        v_error, dtype_error = self._value_error(layer, k64, v64, w.k_bias, w.v_bias, kv_weight, dtype)

        tensors = {
            "q_proj.weight": w.q_weight,
            "k_proj.weight": w.k_weight,
            "kv_proj.weight": kv_weight,
            "o_proj.weight": w.o_weight,
        }
        for name, bias in (("q_proj.bias", w.q_bias), ("k_proj.bias", w.k_bias), ("o_proj.bias", o_bias)):
            if bias is not None:
                tensors[name] = bias
        # QK-norm: the cache keeps W_K·x before the norm (V = K·W_KV needs it linear), normed where it is read
        tensors.update(qk_norm_tensors(w))
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
        report = {"layer": layer, "kappa_k": kappa, "v_rel_error": v_error, "dtype_rel_error": dtype_error}
        return LayerOutput(tensors=tensors, report=report)

    def _value_error(
        self,
        layer: int,
        k_weight: torch.Tensor,
        v_weight: torch.Tensor,
        k_bias: torch.Tensor | None,
        v_bias: torch.Tensor | None,
        kv_weight: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[float, float]:
        """Relative error of V rebuilt from a K cache stored in ``dtype``, vs the exact V, in float64
        (``k_weight``, ``v_weight`` and ``kv_weight`` float64).

        Returns (slim error, error of simply storing the exact V in ``dtype``) so the user can see
        how much slim adds to the rounding the original model already has.
        """
        gen = torch.Generator().manual_seed(self.config.seed + layer)
        # Drawn in float32 (a quarter of the time of float64 draws here), then exact in float64.
        x = torch.randn(self.config.error_samples, k_weight.shape[1], generator=gen).to(linalg.F64)
        k = x @ k_weight.T  # [n, e], without the bias: it is added before rounding and taken off after
        v_exact = x @ v_weight.T  # [n, e_v]
        if k_bias is not None:
            k_cached = (k + k_bias.to(linalg.F64)).to(dtype).to(linalg.F64) - k_bias.to(linalg.F64)
        else:
            k_cached = k.to(dtype).to(linalg.F64)
        v_slim = k_cached @ kv_weight.to(dtype).to(linalg.F64).T
        if v_bias is not None:
            v_slim += v_bias.to(linalg.F64)
            v_exact += v_bias.to(linalg.F64)
        return linalg.relative_error(v_slim, v_exact), linalg.relative_error(v_exact.to(dtype), v_exact)

    def finish(self, plan: None, reports: list[dict[str, Any]]) -> None:
        worst = max(reports, key=lambda r: r["v_rel_error"])
        if not worst["v_rel_error"] <= self.config.max_v_error and not self.config.accept_v_error:
            raise KVConvertError(
                f"layer {worst['layer']}: κ(W_K) = {worst['kappa_k']:.3g} makes V = K·W_KV deviate by "
                f"{worst['v_rel_error']:.3g} relative RMS (limit {self.config.max_v_error:.3g}) in this dtype; "
                "convert with --dtype float32, raise --max-v-error, or pass --accept-v-error"
            )

    def runtime_spec(self, plan: None, layout: AttentionLayout, tensor_names: list[list[str]]) -> dict[str, Any]:
        first = set(tensor_names[0])  # biases exist in every layer or in none (one architecture)
        return {
            "q_bias": "q_proj.bias" in first,
            "k_bias": "k_proj.bias" in first,
            "o_bias": "o_proj.bias" in first,
            **qk_norm_spec(layout),
            **rope_spec(layout),  # layers without RoPE: their keys cached and read without it
        }
