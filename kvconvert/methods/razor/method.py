"""RazorAttention (Tang et al. 2024): keep a full cache only for retrieval heads.

Retrieval heads are found by profiling (§3.3): top ``induction_frac`` of all heads by induction
score ∪ top ``echo_frac`` by echo score; for GQA a KV head is kept whole if any of its query heads
qualifies (§4.1.1). Weights are copied unchanged. The other heads keep ``sink`` first tokens, the
most recent L = max(window, N·window_frac) tokens and one compensation token (runtime).
ALiBi's analytic scope L_h (theorem 1) is not implemented: no supported architecture uses ALiBi.

``--heads-by window-error`` (kvconvert extension) keeps whole the ``whole_share`` of KV heads whose window would
move the layer's output most (``heads.window_errors``, measured on calibration text at long context) instead.
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
# the options of each head ranking (``--heads-by``): those of the ranking not chosen act on nothing
BY_INDUCTION = ("induction_frac", "echo_frac", "profile_tokens")
BY_WINDOW_ERROR = ("heads_by", "whole_share", "profile_context", "profile_windows", "calib")


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


def costliest_kv_heads(errors: torch.Tensor, layers: tuple[int, ...], group: int, count: int) -> list[list[int]]:
    """Per layer, the KV heads kept in full: the ``count`` KV heads of ``layers`` whose query heads' ``errors [L, H]``
    (what windowing each would add to the layer's output) sum highest; a KV head windowed windows its whole group."""
    per_kv = errors.reshape(errors.shape[0], -1, group).sum(dim=-1)  # [L, Hkv]
    kv_heads = per_kv.shape[1]
    candidates = torch.tensor([layer * kv_heads + g for layer in layers for g in range(kv_heads)], dtype=torch.long)
    chosen = candidates[torch.topk(per_kv.flatten()[candidates], count).indices] if count else candidates[:0]
    picked = [(int(i) // kv_heads, int(i) % kv_heads) for i in chosen]
    return [sorted(g for layer_, g in picked if layer_ == layer) for layer in range(errors.shape[0])]


@dataclass(frozen=True)
class RazorPlan:
    """What razor decided for a model: every head's scores, the KV heads kept whole per layer, and the
    window of the others."""

    echo: torch.Tensor | None  # [layers, query heads]; None when the heads were chosen by window error
    induction: torch.Tensor | None
    retrieval_kv_heads: list[list[int]]
    retrieval_share: float  # of the global layers' KV heads
    window: int
    window_frac: float
    profile_tokens: int  # K random tokens (induction), or tokens per calibration window (window error)
    window_error: torch.Tensor | None = None  # [layers, query heads]: ``heads.window_errors``, when chosen by it


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

    def params(self) -> dict[str, Any]:
        """The config's fields but the other head ranking's, which act on nothing: a recipe says what its conversion
        used, and razor's outputs from before ``--heads-by`` stay what they were, byte for byte."""
        unused = BY_INDUCTION if self.config.heads_by == "window-error" else BY_WINDOW_ERROR
        return {name: value for name, value in super().params().items() if name not in unused}

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        kept = sum(len(r["retrieval_kv_heads"]) for r in report["layers"])
        return (
            f"RazorAttention keeps the full cache for {kept} retrieval KV heads; the others keep "
            f"{report['params']['sink']} sink tokens, a recent window and one compensation token."
        )

    @classmethod
    def report_table(cls, report: dict[str, Any]) -> str:
        by_error = "window_errors" in report["layers"][0]
        scores = ("window_errors",) if by_error else ("induction_scores", "echo_scores")
        titles = ("max window error",) if by_error else ("max induction", "max echo")
        lines = [f"{'layer':>5}  {'retrieval KV heads':<24}" + "".join(f"  {t:>16}" for t in titles)]
        for row in report["layers"]:
            heads = ",".join(map(str, row["retrieval_kv_heads"])) or "-"
            lines.append(f"{row['layer']:>5}  {heads:<24}" + "".join(f"  {max(row[s]):>16.3f}" for s in scores))
        return "\n".join(lines)

    def plan(self, ctx: PlanContext) -> RazorPlan:
        """Profile the source (one layer in memory at a time) and choose the KV heads kept whole: by echo/induction
        score, or by the error their window would make (``--heads-by window-error``)."""
        layout, config = ctx.layout, ctx.source.config
        # sliding-window layers keep transformers' own windowed cache (runtime ``sliding_layer``): the budget
        # is spent on the global layers, whose cache grows with the sequence
        compressed = layout.global_layers
        group, total = layout.num_heads // layout.num_kv_heads, len(compressed) * layout.num_kv_heads
        window = self.config.window or min(PAPER_WINDOW, max(16, layout.context // 16))
        if self.config.heads_by == "window-error":
            count = round(self.config.whole_share * total)
            share = count / total
            window_frac = self._window_frac(share)
            errors, tokens = self._window_errors(ctx, window, window_frac)
            kept = costliest_kv_heads(errors, compressed, group, count)
            return RazorPlan(None, None, kept, share, window, window_frac, tokens, errors)
        from kvconvert.arch import adapter_for
        from kvconvert.methods.razor.heads import profile_heads_layer_by_layer

        tokens = self.config.profile_tokens or max(2, min(2500, layout.context // 4))
        if 4 * tokens > layout.context:
            raise KVConvertError(f"profile_tokens {tokens} × 4 exceeds the model's context ({layout.context})")
        special = {t for t in (config.bos_token_id, config.eos_token_id, config.pad_token_id) if isinstance(t, int)}
        scores = profile_heads_layer_by_layer(ctx.source, adapter_for(config), tokens, special, seed=self.config.seed,
                                              progress=ctx.progress)  # fmt: skip
        chosen = top_heads(scores.induction, self.config.induction_frac) | top_heads(scores.echo, self.config.echo_frac)
        kept = retrieval_kv_heads(chosen, layout.num_layers, group)
        share = sum(len(kept[i]) for i in compressed) / total
        return RazorPlan(scores.echo, scores.induction, kept, share, window, self._window_frac(share), tokens)

    def _window_frac(self, share: float) -> float:
        """``--window-frac``, or what ``--kv-budget`` leaves the windows beside ``share`` of the KV heads whole."""
        budget = self.config.kv_budget
        if budget is None:
            return self.config.window_frac
        if budget <= share:
            raise KVConvertError(
                f"kv_budget {budget} is not above the retrieval heads' share of the cache ({share:.3f}); lower "
                + ("--whole-share" if self.config.heads_by == "window-error" else "--induction-frac/--echo-frac")
                + " or raise the budget"
            )
        return (budget - share) / (1 - share) if share < 1 else 1.0

    def _window_errors(self, ctx: PlanContext, window: int, window_frac: float) -> tuple[torch.Tensor, int]:
        """``heads.window_errors`` of every head ``[L, H]`` on ``--profile-windows`` windows of calibration text,
        and the windows' length."""
        from kvconvert.arch import adapter_for
        from kvconvert.calib.text import calibration_set
        from kvconvert.linalg import head_output_grams
        from kvconvert.methods.razor.heads import profile_window_errors_layer_by_layer

        layout, config = ctx.layout, self.config
        tokens = config.profile_context or min(layout.context, 8192)
        if tokens > layout.context:
            raise KVConvertError(f"--profile-context {tokens} exceeds the model's context ({layout.context})")
        chunks = calibration_set(ctx.source.path, config.calib, tokens * config.profile_windows, tokens, config.seed,
                                 fewer=True, asked="--profile-context").chunks  # fmt: skip
        o_grams = [head_output_grams(w.o_weight, layout.num_heads, layout.head_dim) for w in ctx.layers]
        adapter = adapter_for(ctx.source.config)
        # only the layers razor windows: sliding-window layers keep transformers' own window (their rows stay 0)
        errors = profile_window_errors_layer_by_layer(ctx.source, adapter, chunks, o_grams, config.sink, window,
                                                      window_frac, layers=layout.global_layers,
                                                      progress=ctx.progress)  # fmt: skip
        return errors, tokens

    def expected_kv_budget(self, plan: RazorPlan, layout: AttentionLayout) -> float:
        """Long-context limit: retrieval heads in full, the others at window_frac of the tokens (global
        layers; local ones hold a bounded window in the stock model and here alike)."""
        return plan.retrieval_share + (1 - plan.retrieval_share) * plan.window_frac

    def convert_layer(self, plan: RazorPlan, layer: int, weights: AttentionWeights, dtype: torch.dtype) -> LayerOutput:
        report = {
            "layer": layer,
            "retrieval_kv_heads": plan.retrieval_kv_heads[layer],
        }
        scores = {"echo_scores": plan.echo, "induction_scores": plan.induction, "window_errors": plan.window_error}
        for name, values in scores.items():
            if values is not None:
                report[name] = [round(float(x), 6) for x in values[layer]]
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
