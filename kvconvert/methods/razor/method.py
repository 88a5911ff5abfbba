"""RazorAttention (Tang et al. 2024): keep a full cache only for retrieval heads.

Retrieval heads are found by profiling (§3.3): top ``induction_frac`` of all heads by induction
score ∪ top ``echo_frac`` by echo score; for GQA a KV head is kept whole if any of its query heads
qualifies (§4.1.1). Weights are copied unchanged. The other heads keep ``sink`` first tokens, the
most recent L = max(window, N·window_frac) tokens and one compensation token (runtime).
ALiBi's analytic scope L_h (theorem 1) is not implemented: no supported architecture uses ALiBi.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.errors import KVConvertError
from kvconvert.methods.base import LayerOutput, Method, PlanContext, budget_words
from kvconvert.methods.razor.config import RazorConfig

PAPER_WINDOW = 4000  # Table 2: buffer length max(4000, N/5), for 32K-context models


def top_heads(scores: torch.Tensor, fraction: float) -> set[tuple[int, int]]:
    """(layer, head) of the top ``fraction`` of all heads by score (at least one when fraction > 0)."""
    if fraction <= 0:
        return set()
    count = max(1, round(fraction * scores.numel()))
    flat = torch.topk(scores.flatten(), count).indices
    return {(int(i) // scores.shape[1], int(i) % scores.shape[1]) for i in flat}


def retrieval_kv_heads(chosen: set[tuple[int, int]], num_layers: int, group: int) -> list[list[int]]:
    """Per layer, the KV heads kept in full: those with at least one chosen query head."""
    return [sorted({head // group for layer_, head in chosen if layer_ == layer}) for layer in range(num_layers)]


@dataclass(frozen=True)
class RazorPlan:
    """What razor decided for a model: every head's scores, the KV heads kept whole per layer, and the
    window of the others."""

    echo: torch.Tensor  # [layers, query heads]
    induction: torch.Tensor
    retrieval_kv_heads: list[list[int]]
    retrieval_share: float  # of the global layers' KV heads
    window: int
    window_frac: float
    profile_tokens: int


class RazorMethod(Method[RazorPlan]):
    name = "razor"
    token_layout = True  # the retrieval heads' full stores; the sliding windows stay in KIVI's layout
    unsupported: ClassVar[dict[str, str]] = {
        "softcap": "razor's attention computes the softmax itself and does not apply attention-logit soft-capping "
        "(not implemented); use quant",
    }

    @classmethod
    def headline(cls, report: dict[str, Any]) -> str:
        return f"razor, {budget_words(report, long_context=True)}"  # a window: reached at long context

    def __init__(self, config: RazorConfig | None = None):
        self.config = config or RazorConfig()

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        kept = sum(len(r["retrieval_kv_heads"]) for r in report["layers"])
        return (
            f"RazorAttention keeps the full cache for {kept} retrieval KV heads; the others keep "
            f"{report['params']['sink']} sink tokens, a recent window and one compensation token."
        )

    @classmethod
    def report_table(cls, report: dict[str, Any]) -> str:
        lines = [f"{'layer':>5}  {'retrieval KV heads':<24}  {'max induction':>13}  {'max echo':>9}"]
        for row in report["layers"]:
            heads = ",".join(map(str, row["retrieval_kv_heads"])) or "-"
            lines.append(f"{row['layer']:>5}  {heads:<24}  {max(row['induction_scores']):>13.3f}  "
                         f"{max(row['echo_scores']):>9.3f}")  # fmt: skip
        return "\n".join(lines)

    def plan(self, ctx: PlanContext) -> RazorPlan:
        """Profile echo/induction scores on the source model (one layer in memory at a time) and choose
        the retrieval heads."""
        layout, source = ctx.layout, ctx.source
        from kvconvert.arch import adapter_for
        from kvconvert.methods.razor.heads import profile_heads_layer_by_layer

        config = source.config
        context = layout.context
        tokens = self.config.profile_tokens or max(2, min(2500, context // 4))
        if 4 * tokens > context:
            raise KVConvertError(f"profile_tokens {tokens} × 4 exceeds the model's context ({context})")
        special = {t for t in (config.bos_token_id, config.eos_token_id, config.pad_token_id) if isinstance(t, int)}
        scores = profile_heads_layer_by_layer(source, adapter_for(config), tokens, special, seed=self.config.seed,
                                              progress=ctx.progress)  # fmt: skip
        chosen = top_heads(scores.induction, self.config.induction_frac) | top_heads(scores.echo, self.config.echo_frac)
        group = layout.num_heads // layout.num_kv_heads
        kept = retrieval_kv_heads(chosen, layout.num_layers, group)
        # sliding-window layers keep transformers' own windowed cache (runtime ``sliding_layer``): the budget
        # is spent on the global layers, whose cache grows with the sequence
        compressed = layout.global_layers
        share = sum(len(kept[i]) for i in compressed) / (len(compressed) * layout.num_kv_heads)
        window_frac = self.config.window_frac
        if self.config.kv_budget is not None:
            if self.config.kv_budget <= share:
                raise KVConvertError(
                    f"kv_budget {self.config.kv_budget} is not above the retrieval heads' share of the cache "
                    f"({share:.3f}); lower --induction-frac/--echo-frac or raise the budget"
                )
            window_frac = (self.config.kv_budget - share) / (1 - share) if share < 1 else 1.0
        window = self.config.window or min(PAPER_WINDOW, max(16, context // 16))
        return RazorPlan(scores.echo, scores.induction, kept, share, window, window_frac, tokens)

    def expected_kv_budget(self, plan: RazorPlan, layout: AttentionLayout) -> float:
        """Long-context limit: retrieval heads in full, the others at window_frac of the tokens (global
        layers; local ones hold a bounded window in the stock model and here alike)."""
        return plan.retrieval_share + (1 - plan.retrieval_share) * plan.window_frac

    def convert_layer(self, plan: RazorPlan, layer: int, weights: AttentionWeights, dtype: torch.dtype) -> LayerOutput:
        report = {
            "layer": layer,
            "retrieval_kv_heads": plan.retrieval_kv_heads[layer],
            "echo_scores": [round(float(x), 6) for x in plan.echo[layer]],
            "induction_scores": [round(float(x), 6) for x in plan.induction[layer]],
        }
        return LayerOutput(tensors={}, report=report, passthrough=True)

    def runtime_spec(self, plan: RazorPlan, layout: AttentionLayout, tensor_names: list[list[str]]) -> dict[str, Any]:
        return {
            "razor": {
                "retrieval_kv_heads": plan.retrieval_kv_heads,
                "sink": self.config.sink,
                "window": plan.window,
                "window_frac": plan.window_frac,
            }
        }
