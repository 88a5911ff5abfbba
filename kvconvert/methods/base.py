"""The contract between the conversion pipeline and a method."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch

from kvconvert.arch import AttentionLayout, AttentionWeights
from kvconvert.runtime.kvconvert_codec import QuantSpec


@dataclass
class LayerOutput:
    """A converted layer: new attention tensors (names local to the attention block) + a report."""

    tensors: dict[str, torch.Tensor]
    report: dict[str, Any] = field(default_factory=dict)
    passthrough: bool = False  # keep the layer's original attention tensors and stock module (+ ``tensors``)


@dataclass(frozen=True)
class PlanContext:
    """What a method's ``plan`` reads, the same for every method.

    ``layers``: each layer's attention weights, read lazily, one at a time (iterate once); ``source`` (a
    ``SourceCheckpoint``): for methods that run the model (calibration, profiling), on the device
    ``kvconvert.devices.computing_on`` chose; ``dtype``: the converted attention tensors'; ``progress``:
    bars for calibration and profiling (off under --quiet, in batch jobs and in the planner)."""

    layout: AttentionLayout
    layers: Iterable[AttentionWeights] = ()
    source: Any = None
    dtype: torch.dtype | None = None
    progress: bool = True


P = TypeVar("P")  # a method's plan: a frozen dataclass of everything ``plan`` decided (None: nothing to decide)


class Method(Generic[P]):
    """One KV-cache compression method: its config and the storage of what its cache holds (``storage``,
    shared by every method: 16 bits or quantized), nothing else. ``plan`` returns what it decides for a
    model as one frozen object; the pipeline hands that plan back to every later step, which only reads
    it (the contract tests check that converting layers changes nothing), so layers convert in any order
    and one method object converts any number of models."""

    name: ClassVar[str]
    storage: QuantSpec = QuantSpec()
    config: Any  # the method's config dataclass
    # attention features (``kvconvert.arch.FEATURES``) this method cannot convert -> the exact reason
    unsupported: ClassVar[dict[str, str]] = {}
    # its runtime can hold (and decode from) the token layout (``--kv-layout token``)
    token_layout: ClassVar[bool] = False

    def check_features(self, layout: AttentionLayout) -> None:
        """Refuse, with the reason, a model whose attention has a feature this method cannot handle."""
        from kvconvert.errors import KVConvertError

        for feature in layout.features:
            if feature in self.unsupported:
                raise KVConvertError(f"{self.name} cannot convert this model: {self.unsupported[feature]}")

    def check_storage(self, layout: AttentionLayout) -> None:
        """Refuse a storage layout this method's runtime cannot hold. The token layout is read by the
        quant and razor runtimes' decode paths only, and needs head widths that are multiples of 32."""
        from kvconvert.errors import KVConvertError
        from kvconvert.runtime.kvconvert_codec import token_group_size

        if self.storage.fp8 and self.name != "quant":
            raise KVConvertError(f"--kv-format fp8 (static scales, the serving engines' format) is quant's; "
                                 f"{self.name} stores what its own runtime reads: use --kv-bits 8")  # fmt: skip
        if self.storage.local_bits is not None and not layout.local_layers:
            raise KVConvertError("--kv-local-bits is the width of sliding-window layers' caches, and this model has "
                                 "no sliding-window layers: use --kv-bits")  # fmt: skip
        if self.storage.layout != "token":
            return
        if not self.token_layout:
            raise KVConvertError(f"--kv-layout token is for quant and razor only ({self.name} stores its cache in "
                                 "KIVI's layout)")  # fmt: skip
        if token_group_size(layout.head_dim, self.storage.group) is None:
            raise KVConvertError(f"--kv-layout token needs a head width that is a multiple of 32; this model's is "
                                 f"{layout.head_dim}")  # fmt: skip

    def check(self, layout: AttentionLayout) -> None:
        """Raise ``KVConvertError`` if the model cannot be converted by this method."""

    def plan(self, ctx: PlanContext) -> P:
        """Whole-model decisions before any layer is converted (spectra, calibration, profiling, rank
        search), returned as the method's frozen plan. Everything a method decides is decided here."""
        raise NotImplementedError

    def convert_layer(self, plan: P, layer: int, weights: AttentionWeights, dtype: torch.dtype) -> LayerOutput:
        raise NotImplementedError

    def finish(self, plan: P, reports: list[dict[str, Any]]) -> None:
        """Called once all layers are converted; may refuse the result (raise ``KVConvertError``)."""

    def refit(self, plan: P, directory: Path, source: Any, progress: bool = True) -> dict[str, Any]:
        """Once every file of the output is in ``directory`` (its temporary place, before it is published): a fit
        through the whole converted model, which may rewrite its weight files (lorc's MLA export,
        ``--distill-steps``). Returns what ``kvconvert.json`` reports of it under ``refit`` (empty: nothing ran)."""
        return {}

    def runtime_spec(self, plan: P, layout: AttentionLayout, tensor_names: list[list[str]]) -> dict[str, Any]:
        """Method-specific entries of ``config.kvconvert`` that the runtime reads.

        ``tensor_names[layer]``: the local names ``convert_layer`` produced for that layer.
        """
        return {}

    def expected_kv_budget(self, plan: P, layout: AttentionLayout) -> float:
        raise NotImplementedError

    def side_budgets(self, plan: P, layout: AttentionLayout) -> list[tuple[float, float]] | None:
        """Per layer, the shares of the source's keys and of its values that the cache holds before storage, for a
        method whose two sides differ: storage may then give them different widths (``--kv-value-bits``), and a
        budget that weighs both alike misstates the bytes. None (default): ``expected_kv_budget`` for both."""
        return None

    def engine_config(self, plan: P) -> dict[str, Any]:
        """What ``config.json`` says to serving engines besides kvconvert's runtime spec (quant's fp8
        ``quantization_config``; lorc's MLA export: a whole DeepSeek-V3 config, ``model_type`` and
        ``architectures`` included). Non-empty: the output has the source's ``model_type`` (or the one given
        here), so that engines and stock transformers load it without kvconvert; empty: ``model_type: kvconvert``."""
        return {}

    def added_tensors(self, plan: P) -> dict[str, str]:
        """Tensors outside attention an export adds, as output name -> the source tensor copied under it (lorc's
        MLA export: the output head of a source that ties it, since engines do not tie DeepSeek-V3's)."""
        return {}

    def planned_storage(self, plan: P) -> QuantSpec:
        """The storage the converted cache uses: ``storage``, unless the plan chose it (widths per layer)."""
        return self.storage

    def summary(self, plan: P) -> dict[str, Any]:
        """Whole-model decisions for ``kvconvert.json``'s ``plan`` (empty: no such section)."""
        return {}

    def params(self) -> dict[str, Any]:
        """The options that reproduce this conversion (``kvconvert.json``'s ``params``, the recipe): every
        method's config is a dataclass, so all of its fields."""
        return dataclasses.asdict(self.config)

    @classmethod
    def headline(cls, report: dict[str, Any]) -> str:
        """What ``wrote OUT (…)`` says of a conversion, from its ``kvconvert.json`` report."""
        return f"{cls.name}, {budget_words(report)}"

    @classmethod
    def report_table(cls, report: dict[str, Any]) -> str:
        """What the command prints after converting, from the ``kvconvert.json`` report ("" for nothing)."""
        return ""

    @classmethod
    def describe(cls, report: dict[str, Any]) -> str:
        """The model card's paragraph on what this method did, from its ``kvconvert.json`` report."""
        return ""


def qk_norm_spec(layout: AttentionLayout) -> dict[str, Any]:
    """The runtime spec's entry for a model with QK-norm (``runtime.kvconvert_common.qk_norms`` builds the norms
    from it), for methods whose own attention modules apply it; empty without one."""
    if not layout.qk_norm:
        return {}
    offset = {"offset": layout.qk_norm_offset} if layout.qk_norm_offset else {}  # Gemma 3: 1 + weight
    return {"qk_norm": {"eps": layout.qk_norm_eps, "per_head": layout.qk_norm_per_head, **offset}}


def rope_spec(layout: AttentionLayout) -> dict[str, Any]:
    """The runtime spec's entries for RoPE other than rotate-half in every layer, for methods whose own attention
    modules turn keys: the layers without RoPE (SmolLM3: the runtime builds their modules without it) and RoPE on
    interleaved pairs (GLM, Cohere: turned by the family's own function); empty for a plain rotary model."""
    nope = {"nope_layers": list(layout.nope_layers)} if layout.nope_layers else {}
    return {**nope, **({"interleaved_rope": True} if layout.interleaved_rope else {})}


def qk_norm_tensors(weights: AttentionWeights) -> dict[str, torch.Tensor]:
    """A layer's QK-norm weights as the source stores them (``q_norm.weight``, ``k_norm.weight``), for the
    converted layer to carry unchanged; empty without QK-norm."""
    return {f"{name}.weight": norm for name, norm in (("q_norm", weights.q_norm), ("k_norm", weights.k_norm))
            if norm is not None}  # fmt: skip


def layer_table(report: dict[str, Any], columns: list[tuple[str, str, str]]) -> str:
    """A per-layer table of a conversion report: ``columns`` are (title, report key, format); missing
    values print as '-'."""
    lines = [f"{'layer':>5}  " + "  ".join(f"{title:>14}" for title, _, _ in columns)]
    for row in report["layers"]:
        cells = ["-" if row.get(key) is None else format(row[key], fmt) for _, key, fmt in columns]
        lines.append(f"{row['layer']:>5}  " + "  ".join(f"{c:>14}" for c in cells))
    return "\n".join(lines)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def budget_words(report: dict[str, Any], long_context: bool = False) -> str:
    """The expected KV budget of a conversion, quantized storage included (then against a 16-bit cache);
    ``long_context``: a budget the cache reaches only once it is longer than what it keeps whole (a window)."""
    if "kv_budget_expected_vs_16bit" in report:
        words = f"KV budget {report['kv_budget_expected_vs_16bit']:.3f} of a 16-bit cache at long context"
    else:
        words = f"KV budget {report['kv_budget_expected']:.3f}" + (" at long context" if long_context else "")
    if at := report.get("kv_budget_at_tokens"):  # sliding-window layers: the budget depends on the length
        words += " (" + ", ".join(f"{budget:.3f} at {_tokens(int(n))}" for n, budget in at.items()) + " tokens)"
    return words
