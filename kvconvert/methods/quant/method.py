"""``kvconvert quant``: quantized KV-cache storage alone (KIVI's layout), every weight unchanged.

The baseline every other method is compared with at equal bytes: keys per channel over blocks of
tokens, values per token, the newest tokens unquantized (``kvconvert/runtime/kvconvert_codec.py``).
With ``--kv-budget`` (a kvconvert extension, not in KIVI) the width of every layer's keys and values
is chosen between ``min_bits`` and ``max_bits`` by measured loss on calibration text
(``kvconvert.methods.quant.bits``), so the budget lands where it costs the least.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import LayerOutput, Method, PlanContext, budget_words
from kvconvert.methods.quant.config import QuantConfig
from kvconvert.runtime.kvconvert_codec import QuantSpec


@dataclass(frozen=True)
class QuantPlan:
    """With ``--kv-budget``: the storage with a width per layer and side, and how it was chosen."""

    storage: QuantSpec
    report: dict[str, Any]  # kvconvert.json's ``plan``


class QuantMethod(Method[QuantPlan | None]):
    name = "quant"
    token_layout = True

    @classmethod
    def headline(cls, report: dict[str, Any]) -> str:
        storage = report["kv_storage"]
        widths = f"{storage['bits']}-bit" if "layers" not in storage else "widths per layer by measured loss"
        layout = ", token layout" if storage.get("layout") == "token" else ""
        return (f"quant {widths}{layout}, groups of {storage['group']}, {storage['residual']} recent tokens "
                f"unquantized; {budget_words(report)}")  # fmt: skip

    def __init__(self, config: QuantConfig | None = None):
        self.config = config or QuantConfig()

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        text = "Weights and attention are unchanged; only the cache's storage is quantized (below)."
        plan = report.get("plan") or {}
        if "layers" in plan:
            text += (
                f" Widths per layer (keys, values) were allocated by measured loss for a budget of "
                f"{plan['kv_budget']:.3f} of a 16-bit cache: {plan['layers']}."
            )
        return text

    def check(self, layout: AttentionLayout) -> None:
        if self.config.kv_budget is not None:
            if self.storage.bits != 16:
                raise KVConvertError("give --kv-bits (one width) or --kv-budget (widths chosen per layer), not both")
            return
        if not self.storage.quantized:
            raise KVConvertError(
                "quant needs --kv-bits 8, 4, 3 or 2 (16 would copy the model unchanged), or --kv-budget"
            )

    def plan(self, ctx: PlanContext) -> QuantPlan | None:
        """With ``kv_budget``: measure each layer's and side's sensitivity and allocate the widths."""
        layout, source = ctx.layout, ctx.source
        budget = self.config.kv_budget
        if budget is None:
            return None  # one width for every layer: the storage options say it all
        from kvconvert.calib.text import calibration_set
        from kvconvert.methods.quant.bits import measure_allocation

        config = self.config
        chunks = calibration_set(source.path, config.calib, config.calib_tokens, min(512, layout.context),
                                 config.seed)  # fmt: skip
        widths = [layout.num_kv_heads * layout.head_dim] * layout.num_layers
        storage = self.storage
        allocation, measured = measure_allocation(source, chunks.chunks, widths, config.choices, budget, storage,
                                                  layout.head_dim, ctx.progress)  # fmt: skip
        top = max(b for pair in allocation.layers for b in pair)
        return QuantPlan(dataclasses.replace(storage, bits=top, layers=allocation.layers), {
            "kv_budget": allocation.budget,
            "layers": [list(pair) for pair in allocation.layers],
            "calibration_kl_predicted": allocation.predicted_kl,
            "calibration_kl_measured": measured,
            "calibration": {"source": chunks.source, "tokens": chunks.tokens},
            "sensitivity": allocation.sensitivity,
        })  # fmt: skip

    def planned_storage(self, plan: QuantPlan | None) -> QuantSpec:
        return self.storage if plan is None else plan.storage

    def summary(self, plan: QuantPlan | None) -> dict[str, Any]:
        return {} if plan is None else plan.report

    def convert_layer(
        self, plan: QuantPlan | None, layer: int, weights: AttentionWeights, dtype: torch.dtype
    ) -> LayerOutput:
        return LayerOutput(tensors={}, report={"layer": layer}, passthrough=True)

    def expected_kv_budget(self, plan: QuantPlan | None, layout: AttentionLayout) -> float:
        return 1.0  # every token and channel kept; the storage factor comes on top
