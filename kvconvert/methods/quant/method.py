"""``kvconvert quant``: quantized KV-cache storage alone (KIVI's layout), the model unchanged.

The baseline every other method is compared with at equal bytes: keys per channel over blocks of
tokens, values per token, the newest tokens unquantized (``kvconvert/runtime/kvconvert_codec.py``).
With ``--kv-budget`` (a kvconvert extension, not in KIVI) the width of every layer's keys and values
is chosen between ``min_bits`` and ``max_bits`` by measured loss on calibration text
(``kvconvert.methods.quant.bits``), so the budget lands where it costs the least.

With ``--kv-format fp8`` the output is the serving engines' format instead: float8 e4m3 keys and values
with static scales calibrated on text (``kvconvert.methods.quant.fp8``), written as compressed-tensors'
``kv_cache_scheme``, so that vLLM and SGLang load the checkpoint as it is and stock transformers does with
compressed-tensors installed; kvconvert's runtime reads the same scales.

With ``--kv-rotate`` (values rotated per channel group before quantizing) the rotation is folded into W_V and
W_O where the architecture keeps them as separate tensors and the groups tile a head
(``kvconvert.methods.quant.rotation``): the model computes what the source computes, and a decode step reads
the stored values as they are instead of rotating every cached value back (half the values' read measured at 4K).
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
    """The storage when conversion decided something about it: widths per layer and side (``--kv-budget``), fp8
    scales, or the values' rotation folded into the weights (``rotated_values``: what writes W_V and W_O)."""

    storage: QuantSpec
    report: dict[str, Any]  # kvconvert.json's ``plan``
    layout: AttentionLayout | None = None
    rotated_values: Any = None  # the adapter's ``value_output_tensors`` when the rotation is folded


class QuantMethod(Method[QuantPlan | None]):
    name = "quant"
    token_layout = True

    @classmethod
    def headline(cls, report: dict[str, Any]) -> str:
        storage = report["kv_storage"]
        if storage.get("format") == "fp8":
            return f"quant fp8 e4m3, static scales per {storage['scale_strategy']}; {budget_words(report)}"
        widths = f"{storage['bits']}-bit" if "layers" not in storage else "widths per layer by measured loss"
        if "value_bits" in storage:
            widths = f"keys {storage['bits']}-bit, values {storage['value_bits']}-bit"
        layout = ", token layout" if storage.get("layout") == "token" else ""
        return (f"quant {widths}{layout}, groups of {storage['group']}, {storage['residual']} recent tokens "
                f"unquantized; {budget_words(report)}")  # fmt: skip

    def __init__(self, config: QuantConfig | None = None):
        self.config = config or QuantConfig()

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        plan = report.get("plan") or {}
        text = "Weights and attention are unchanged; only the cache's storage is quantized (below)."
        if plan.get("values_rotated_in_weights"):
            text = (
                "The values' rotation is folded into W_V and W_O (the model computes what the source computes); "
                "attention is unchanged and the cache's storage is quantized (below)."
            )
        if "layers" in plan:
            text += (
                f" Widths per layer (keys, values) were allocated by measured loss for a budget of "
                f"{plan['kv_budget']:.3f} of a 16-bit cache: {plan['layers']}."
            )
        if plan.get("window_layers"):
            text += (f" The sliding-window layers {plan['window_layers']} hold a bounded window and were not "
                     f"allocated: the budget is the global layers' at long context.")  # fmt: skip
        return text

    def check(self, layout: AttentionLayout) -> None:
        if self.storage.fp8:
            if self.config.kv_budget is not None:
                raise KVConvertError("--kv-format fp8 is 8 bits everywhere: it takes no --kv-budget")
            if not layout.engine_kv_scales:
                raise KVConvertError(
                    "--kv-format fp8 writes scales where vLLM and SGLang read them (self_attn.k_scale / v_scale), "
                    "which this architecture has no place for"
                )
            if layout.local_layers:
                raise KVConvertError(
                    "--kv-format fp8 on a model with sliding-window layers is not supported: the engines quantize "
                    "those layers too, and kvconvert's runtime keeps them stock"
                )
            return
        if self.config.recall_context > layout.context:
            raise KVConvertError(f"--recall-context {self.config.recall_context} exceeds the model's context of "
                                 f"{layout.context} tokens")  # fmt: skip
        if self.config.kv_budget is not None:
            if self.storage.bits != 16 or self.storage.local_bits is not None or self.storage.value_bits is not None:
                raise KVConvertError("give --kv-bits / --kv-local-bits / --kv-value-bits (widths) or --kv-budget "
                                     "(widths chosen per layer and side), not both")  # fmt: skip
            if 3 in self.config.choices and self.storage.group % 8:
                raise KVConvertError(f"--kv-budget tries 3-bit widths, which pack 8 tokens in 3 bytes: --kv-group "
                                     f"{self.storage.group} is not a multiple of 8 (or leave 3 out with --min-bits 4 "
                                     f"or --max-bits 2)")  # fmt: skip
            return
        if not self.storage.quantized:
            raise KVConvertError(
                "quant needs --kv-bits 8, 4, 3 or 2 (16 would copy the model unchanged), or --kv-budget"
            )

    def plan(self, ctx: PlanContext) -> QuantPlan | None:
        """With ``kv_budget``: measure each layer's and side's sensitivity and allocate the widths; with ``kv_rotate``,
        fold the rotation into the weights where the architecture allows."""
        plan = self._plan_storage(ctx)
        storage = self.storage if plan is None else plan.storage
        if ctx.source is None or not storage.rotate or storage.layout != "kivi":
            return plan
        from kvconvert.arch import adapter_for
        from kvconvert.runtime.kvconvert_codec import channel_groups

        adapter, layout = adapter_for(ctx.source.config), ctx.layout
        groups, size = channel_groups(layout.head_dim, storage.group)
        if not adapter.writes_values or groups * size != layout.head_dim:
            return plan  # the stores rotate (and rotate back) themselves, as every method's do
        report = {**({} if plan is None else plan.report), "values_rotated_in_weights": True}
        return QuantPlan(dataclasses.replace(storage, rotate_in_weights=True), report, layout,
                         adapter.value_output_tensors)  # fmt: skip

    def _plan_storage(self, ctx: PlanContext) -> QuantPlan | None:
        layout, source = ctx.layout, ctx.source
        if self.storage.fp8:
            return self._plan_fp8(ctx)
        budget = self.config.kv_budget
        if budget is None:
            return None  # one width for every layer: the storage options say it all
        from kvconvert.calib.text import calibration_set
        from kvconvert.methods.quant.bits import measure_allocation

        config = self.config
        chunks = calibration_set(source.path, config.calib, config.calib_tokens, min(512, layout.context),
                                 config.seed)  # fmt: skip
        storage = self.storage
        # sliding-window layers hold a bounded window: the long-context budget is spent on the global layers,
        # and the windows stay as the runtime keeps them (stock, or at the widest choice with --kv-include-local)
        local = frozenset(layout.local_layers) if layout.sliding_window else frozenset()
        widths = [0 if i in local else layout.num_kv_heads * layout.head_dim for i in range(layout.num_layers)]
        stock = frozenset() if storage.include_local else local
        recall, recall_loss = None, None
        if config.recall_context:
            from kvconvert.methods.quant.recall import floor_width, recall_sensitivity, recall_set

            recall = recall_set(source.path, config.calib, config.recall_context, config.recall_prompts, config.seed)
            floor = floor_width(widths, config.choices, budget, storage, layout.head_dim)
            recall_loss = recall_sensitivity(source, recall, widths, config.choices, storage, floor, ctx.progress)
        allocation, measured = measure_allocation(source, chunks.chunks, widths, config.choices, budget, storage,
                                                  layout.head_dim, ctx.progress, stock, recall_loss)  # fmt: skip
        top = max(b for pair in allocation.layers for b in pair)
        recall_report = {} if recall is None else {"recall": {
            "context": config.recall_context, "prompts": config.recall_prompts, "source": recall.source,
            "others_at": floor,
            "sensitivity": [[{str(b): round(v, 6) for b, v in side.items()} for side in layer]
                            for layer in recall_loss or []],
        }}  # fmt: skip
        return QuantPlan(dataclasses.replace(storage, bits=top, layers=allocation.layers), {
            "kv_budget": allocation.budget,
            "layers": [list(pair) for pair in allocation.layers],
            "calibration_kl_predicted": allocation.predicted_kl,
            "calibration_kl_measured": measured,
            "calibration": {"source": chunks.source, "tokens": chunks.tokens},
            "sensitivity": allocation.sensitivity,
            **({"window_layers": sorted(local)} if local else {}),
            **recall_report,
        })  # fmt: skip

    def _plan_fp8(self, ctx: PlanContext) -> QuantPlan:
        """Calibrate the fp8 scales: every layer's largest key and value per KV head on calibration text."""
        import contextlib

        from kvconvert.arch import adapter_for
        from kvconvert.calib.sequential import run_layer_by_layer
        from kvconvert.calib.text import calibration_set
        from kvconvert.methods.quant.fp8 import kv_amax, scales_from_amax

        config, layout, storage = self.config, ctx.layout, self.storage
        chunks = calibration_set(ctx.source.path, config.calib, config.calib_tokens, min(512, layout.context),
                                 config.seed)  # fmt: skip
        seen: list[list[list[torch.Tensor]]] = []

        @contextlib.contextmanager
        def observe(model: Any) -> Any:
            with kv_amax(model, layout.num_layers, layout.num_kv_heads) as amax:
                seen.append(amax)
                yield

        run_layer_by_layer(ctx.source, adapter_for(ctx.source.config), chunks.chunks, observe, progress=ctx.progress)
        dtype = ctx.dtype or torch.float32
        scales = tuple(tuple(tuple(scales_from_amax(side, storage.scale_strategy, dtype).tolist()) for side in pair)
                       for pair in seen[0])  # fmt: skip
        return QuantPlan(dataclasses.replace(storage, scales=scales), {  # type: ignore[arg-type]
            "fp8": {
                "scale_strategy": storage.scale_strategy,
                "key_amax": [round(float(pair[0].max()), 4) for pair in seen[0]],
                "value_amax": [round(float(pair[1].max()), 4) for pair in seen[0]],
            },
            "calibration": {"source": chunks.source, "tokens": chunks.tokens},
        })  # fmt: skip

    def engine_config(self, plan: QuantPlan | None) -> dict[str, Any]:
        if plan is None or not plan.storage.fp8:
            return {}
        from kvconvert.methods.quant.fp8 import kv_cache_scheme

        return {"quantization_config": kv_cache_scheme(plan.storage.scale_strategy)}

    def planned_storage(self, plan: QuantPlan | None) -> QuantSpec:
        return self.storage if plan is None else plan.storage

    def summary(self, plan: QuantPlan | None) -> dict[str, Any]:
        return {} if plan is None else plan.report

    def convert_layer(
        self, plan: QuantPlan | None, layer: int, weights: AttentionWeights, dtype: torch.dtype
    ) -> LayerOutput:
        if plan is not None and plan.rotated_values is not None:
            from kvconvert.methods.quant.rotation import fold_value_rotation
            from kvconvert.runtime.kvconvert_codec import channel_groups, rotation

            layout = plan.layout
            assert layout is not None
            size = channel_groups(layout.head_dim, plan.storage.group)[1]
            folded = fold_value_rotation(weights, layout.num_heads, layout.num_kv_heads, layout.head_dim,
                                         rotation(size))  # fmt: skip
            tensors = {name: t.to(dtype) for name, t in plan.rotated_values(folded).items()}
            return LayerOutput(tensors=tensors, report={"layer": layer}, passthrough=True)
        if plan is None or plan.storage.scales is None:
            return LayerOutput(tensors={}, report={"layer": layer}, passthrough=True)
        from kvconvert.methods.quant.fp8 import scale_tensor

        strategy = plan.storage.scale_strategy
        k, v = plan.storage.scales[layer]
        tensors = {"k_scale": scale_tensor(k, strategy, dtype), "v_scale": scale_tensor(v, strategy, dtype)}
        return LayerOutput(tensors=tensors, report={"layer": layer, "k_scale": max(k), "v_scale": max(v)},
                           passthrough=True)  # fmt: skip

    def expected_kv_budget(self, plan: QuantPlan | None, layout: AttentionLayout) -> float:
        return 1.0  # every token and channel kept; the storage factor comes on top
