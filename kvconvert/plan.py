"""``kvconvert plan``: measure the quality/memory frontier of every method on the user's own model, and
write the recipe that wins at each requested KV budget.

Each candidate (a method with the knob that sets its budget, with and without quantized storage) is
really converted into a temporary directory and scored with the context-compression protocol
(``context`` tokens into the cache in one forward, the next ``continuation`` scored through it) against
the source, on text the user chooses (``--data``) or on the end of the calibration text. Its budget is
the bytes its cache holds after the context ÷ a 16-bit stock cache's, both measured (``eval``'s
``kv_budget_vs_16bit``), so the planner's numbers are ``kvconvert eval``'s numbers for the checkpoint
``kvconvert run`` builds from the recipe it writes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvconvert.errors import KVConvertError

if TYPE_CHECKING:  # torch loads when a plan runs: ``kvconvert --help`` imports this module for its method list
    import torch

# method -> (label, recipe) candidates; labels say which are extensions beyond the paper's default
SINK_ROTATE = {"kv_sink": 4, "kv_rotate": True}
# razor's head profile on 256 random tokens × 4, not min(2500, context/4): minutes instead of half an hour
# on a 2-core machine, and the recipe written keeps it, so the checkpoint built is the one scored
PROFILE = {"profile_tokens": 256}
CANDIDATES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "quant": [
        ("quant 8-bit", {"kv_bits": 8, "kv_residual": 0}),
        # the one KV format vLLM and SGLang read from a checkpoint: a candidate wherever serving is the point
        ("quant fp8, static scales (vLLM/SGLang format)", {"kv_format": "fp8"}),
        ("quant 4-bit", {"kv_bits": 4, "kv_residual": 0}),
        ("quant 4-bit, sink 4 + rotated values (ext.)", {"kv_bits": 4, "kv_residual": 0, **SINK_ROTATE}),
        ("quant 4-bit token layout, sink 4 (ext.)", {"kv_bits": 4, "kv_residual": 0, "kv_sink": 4,
                                                     "kv_layout": "token"}),
        # the token layout's keys (per token around their block's channel means) beside 2-bit values: at 8K on
        # SmolLM2 the source's needle accuracy at 0.227 of the cache, where KIVI's per-channel 3-4-bit keys lost most
        # multikey needles at the same bytes (bench/results/longctx-8k-token-keys-v2*)
        ("quant token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
         {"kv_bits": 4, "kv_value_bits": 2, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
        # the same in groups of 128 (half the scale and block-mean bytes): on Gemma 3 at 16K with 8-bit windows 0.249
        # of the cache and the source's needle accuracy over 15 samples per task (longctx-gemma3-16k-*-g128*)
        ("quant token-layout keys 4-bit, values 2-bit, groups of 128, sink 4 (ext.)",
         {"kv_bits": 4, "kv_value_bits": 2, "kv_group": 128, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
        ("quant 3-bit, sink 4 + rotated values (ext.)", {"kv_bits": 3, "kv_residual": 0, **SINK_ROTATE}),
        # the bits where they matter: keys (their error goes through the softmax) at 3, values at 2. On SmolLM2
        # (wikitext-2, 1536 + 512) 0.19 of the cache at KL 0.0195, where keys at 2 and values at 3 (same bytes) had
        # 0.138 and 2-bit both 0.160 (bench/results/kv-value-bits-2026-11-27.md)
        ("quant keys 3-bit, values 2-bit, sink 4 + rotated values (ext.)",
         {"kv_bits": 3, "kv_value_bits": 2, "kv_residual": 0, **SINK_ROTATE}),
        ("quant 2-bit, sink 4 + rotated values (ext.)", {"kv_bits": 2, "kv_residual": 0, **SINK_ROTATE}),
    ],
    "razor": [
        ("razor (paper)", {**PROFILE}),
        ("razor + 4-bit, sink 4 + rotated values (ext.)", {"kv_bits": 4, "kv_residual": 32, **SINK_ROTATE, **PROFILE}),
        ("razor + 4-bit token layout, sink 4 (ext.)", {"kv_bits": 4, "kv_residual": 0, "kv_sink": 4,
                                                       "kv_layout": "token", **PROFILE}),
        ("razor + 3-bit, sink 4 + rotated values (ext.)", {"kv_bits": 3, "kv_residual": 32, **SINK_ROTATE, **PROFILE}),
        # keys 3 / values 2 bits: with half the heads kept (--induction-frac 0.5) the best recipe under 0.15 of the
        # cache on the 8K needle tasks (README, long-context tasks); here at the paper's share, as the others
        ("razor + keys 3-bit, values 2-bit, sink 4 + rotated values (ext.)",
         {"kv_bits": 3, "kv_value_bits": 2, "kv_residual": 32, **SINK_ROTATE, **PROFILE}),
        ("razor + 2-bit, sink 4 + rotated values (ext.)", {"kv_bits": 2, "kv_residual": 32, **SINK_ROTATE, **PROFILE}),
        # half the KV heads kept whole, chosen by the error their window would make in the layer's output at long
        # context, beside the token-layout keys and 2-bit values: at 8K on SmolLM2 (0.556 of the heads, 0.146 of the
        # cache) the source's needle accuracy over 25 samples a task, where induction's choice of as many heads lost
        # half the needles (bench/results/longctx-8k-razor-53-heads*, longctx-8k-razor-window-error*)
        ("razor by window error, half the KV heads whole + token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
         {"heads_by": "window-error", "whole_share": 0.5, "kv_bits": 4, "kv_value_bits": 2, "kv_residual": 0,
          "kv_sink": 4, "kv_layout": "token"}),
    ],
    "lorc": [
        ("lorc 0.5, progressive ranks (paper)", {"kv_budget": 0.5}),
        # one latent for K and V, activation-aware, ranks by measured loss: better than separate latents
        # at every budget measured (docs/lorc.md), so the planner tries it instead
        ("lorc 0.5, one K/V latent, ranks by measured loss (ext.)",
         {"kv_budget": 0.5, "schedule": "auto", "latent": "joint"}),
        ("lorc 0.75, one K/V latent + 4-bit (ext.)",
         {"kv_budget": 0.75, "schedule": "auto", "latent": "joint", "kv_bits": 4, "kv_residual": 0}),
        # a standard DeepSeek-V3 checkpoint that stock transformers and engines with MLA kernels load: what
        # serving without kvconvert costs (refused, with the reason, on models the layout cannot express)
        ("lorc 0.75 as a DeepSeek-V3 (MLA) checkpoint (engines' format, ext.)", {"kv_budget": 0.75, "latent": "mla"}),
    ],
    "zack": [
        ("zack 0.5 (paper)", {"kv_budget": 0.5}),
        ("zack 0.5, output-weighted V basis + 4-bit (ext.)", {"kv_budget": 0.5, "value_basis": "output", "kv_bits": 4,
                                                              "kv_residual": 0}),
    ],
    "minicache": [
        ("minicache (paper)", {}),
        ("minicache + 4-bit", {"kv_bits": 4, "kv_residual": 0}),
        ("minicache shared subspaces 0.75, widths by loss + 4-bit (ext.)",
         {"merge": "subspace", "kv_budget": 0.75, "kv_bits": 4, "kv_residual": 0}),
    ],
    "slim": [
        ("slim (paper)", {}),
        ("slim + 4-bit", {"kv_bits": 4, "kv_residual": 0}),
    ],
}  # fmt: skip


# the long-context tasks a plan scores by default, from TASK_MIN_LENGTH tokens on: retrieval is what a compressed
# cache loses first, and below 2K tokens a window of a few hundred holds most needles anyway
AUTO_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
TASK_MIN_LENGTH = 2048


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    budgets: tuple[float, ...] = (0.5, 0.35, 0.25, 0.15)
    max_dppl: float | None = None  # also: the smallest budget within this Δppl (%)
    methods: tuple[str, ...] = tuple(CANDIDATES)
    calib: str | None = None  # calibration source of the methods that calibrate; scored on its end
    data: str | None = None  # score on this text instead (its first windows × (context + continuation))
    context: int = 512
    continuation: int = 128
    windows: int = 2
    device: str = "auto"
    progress: bool = True
    chunk: int = 512  # context tokens per prefill forward: memory stays bounded at 8K-32K (≤ 512: one forward)
    # long-context tasks at the window's length (context + continuation); None: AUTO_TASKS from TASK_MIN_LENGTH on
    tasks: tuple[str, ...] | None = None
    task_samples: int = 5  # per task
    max_task_drop: float = 2.0  # points of average accuracy a recommended recipe may lose against the source
    task_tries: int = 3  # candidates task-checked per pick, in order of KL (each costs a conversion and the tasks)
    task_seed: int = 0

    def task_names(self) -> tuple[str, ...]:
        if self.tasks is not None:
            return self.tasks
        return AUTO_TASKS if self.context + self.continuation >= TASK_MIN_LENGTH else ()

    def __post_init__(self) -> None:
        if not self.budgets or any(not 0 < b <= 1 for b in self.budgets):
            raise KVConvertError(f"--budgets must be numbers in (0, 1], got {','.join(map(str, self.budgets))}")
        unknown = [m for m in self.methods if m not in CANDIDATES]
        if unknown or not self.methods:
            raise KVConvertError(f"--methods must be some of {', '.join(CANDIDATES)}; got {','.join(self.methods)}")
        if self.context < 1 or self.continuation < 2 or self.windows < 1:
            raise KVConvertError("--context must be >= 1, --continuation >= 2 and --windows >= 1")
        if self.max_dppl is not None and self.max_dppl < 0:
            raise KVConvertError(f"--max-dppl must be >= 0, got {self.max_dppl}")
        if self.task_samples < 1 or self.task_tries < 1 or self.max_task_drop < 0:
            raise KVConvertError("--task-samples and --task-tries must be >= 1 and --max-task-drop >= 0")


def candidates(methods: tuple[str, ...], local_layers: bool) -> list[tuple[str, str, dict[str, Any]]]:
    """``(method, label, recipe)`` of every candidate of ``methods``. On a model with sliding-window layers (Gemma 2/3)
    quant's integer storage quantizes their windows too, at 8 bits (``kv_local_bits``): left at 16 bits they hold most
    of a long context's quantized cache (Gemma 3: 13.5 % of the 16-bit cache at 16K, 38 % at 4K, so nothing would fit
    0.25), while beside 8-bit global layers 8-bit windows measured KL 1.3e-5 against 7.7e-6 with 16-bit ones, and they
    kept the needles at 16K where 4-bit windows lost one (docs/results.md, Gemma 3)."""
    jobs = []
    for method in methods:
        for label, recipe in CANDIDATES[method]:
            if local_layers and method == "quant" and recipe.get("kv_bits", 16) < 16:
                stem, ext = (label[: -len(" (ext.)")], " (ext.)") if label.endswith(" (ext.)") else (label, "")
                label, recipe = f"{stem}, local layers at 8 bits{ext}", {**recipe, "kv_local_bits": 8}
            jobs.append((method, label, recipe))
    return jobs


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates no other beats on both axes (lower budget and lower Δppl), by ascending budget:
    each has a strictly lower Δppl than every candidate at a smaller or equal budget."""
    front: list[dict[str, Any]] = []
    for row in sorted(rows, key=lambda r: (r["kv_budget"], r["dppl"])):
        if not front or row["dppl"] < front[-1]["dppl"]:
            front.append(row)
    return front


def _first_passing(ordered: list[dict[str, Any]], passes: Any, tries: int) -> tuple[dict[str, Any] | None, list[str]]:
    """The first of ``ordered`` that ``passes`` among the first ``tries`` (each check may cost minutes), and
    the labels of those checked and rejected."""
    rejected: list[str] = []
    for row in ordered[:tries]:
        if passes(row):
            return row, rejected
        rejected.append(row["label"])
    return None, rejected


def best_within(rows: list[dict[str, Any]], budget: float, passes: Any = None, tries: int = 3) -> dict[str, Any] | None:
    """The winner at ``budget``: the lowest mean KL to the source among candidates that hold at most that
    much (and, with ``passes``, the first of the ``tries`` best by KL that passes it: the long-context task
    check), with the best candidate of any other method as ``runner_up`` and the margins; None if none fits.

    KL, not Δppl: both measure what the cache loses on the scored tokens, but Δppl reads the model's
    probability of the one token the text has, KL its whole distribution against the source's. At a
    few thousand scored tokens Δppl moves by ±0.2 % (it even goes below zero) where good candidates
    differ by less, so ranking by it picks noise; KL separates them (e.g. 0.0014 vs 0.0039 for two
    4-bit layouts whose Δppl were +0.02 % and −0.04 %). Δppl breaks KL ties."""
    fitting = sorted((r for r in rows if r["kv_budget"] <= budget), key=lambda r: (r["kl"], r["dppl"]))
    if not fitting:
        return None
    winner, rejected = (fitting[0], []) if passes is None else _first_passing(fitting, passes, tries)
    if winner is None:
        return {"budget": budget, "winner": None, "rejected_by_tasks": rejected}
    other = next((r for r in fitting if r["method"] != winner["method"] and r["label"] not in rejected), None)
    return {
        "budget": budget, "winner": winner["label"], "method": winner["method"], "dppl": winner["dppl"],
        "kl": winner["kl"], "kv_budget": winner["kv_budget"], "runner_up": None if other is None else other["label"],
        "margin_kl": None if other is None else other["kl"] - winner["kl"],
        "margin_dppl": None if other is None else other["dppl"] - winner["dppl"],
        "task_drop": winner.get("task_drop"), "rejected_by_tasks": rejected,
    }  # fmt: skip


def smallest_within(
    rows: list[dict[str, Any]], max_dppl: float, passes: Any = None, tries: int = 3
) -> tuple[dict[str, Any] | None, list[str]]:
    """The candidate with the smallest budget whose Δppl is at most ``max_dppl`` % (and that ``passes``, among
    the ``tries`` smallest), and the labels the task check rejected."""
    fitting = sorted((r for r in rows if r["dppl"] <= max_dppl), key=lambda r: (r["kv_budget"], r["dppl"]))
    if passes is None:
        return (fitting[0] if fitting else None), []
    return _first_passing(fitting, passes, tries)


def scoring_ids(source_path: Path, config: PlanConfig) -> tuple[torch.Tensor, str]:
    """``[windows × (context + continuation)]`` token ids to score on, and where they come from."""
    import torch

    from kvconvert.calib.text import load_tokenizer, read_calibration_text
    from kvconvert.eval.data import load_text

    text, where = (load_text(config.data), config.data) if config.data else read_calibration_text(config.calib)
    ids = load_tokenizer(source_path)(text, add_special_tokens=False)["input_ids"]
    need = config.windows * (config.context + config.continuation)
    if len(ids) < need:
        raise KVConvertError(f"{where} gives {len(ids)} tokens; the plan scores {need} "
                             f"(--windows × (--context + --continuation)): pass more text or lower them")  # fmt: skip
    chosen = ids[:need] if config.data else ids[-need:]
    return torch.tensor(chosen), (f"{where} (first {need} tokens)" if config.data else f"{where} (last {need} tokens)")


def run_plan(model: str, out: Path, config: PlanConfig, replace: bool = False) -> dict[str, Any]:
    """Convert and score every candidate; write ``frontier.json``, ``frontier.png`` and the recipes
    (atomically: on any error ``out`` is left as it was)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar over the candidates, not one per weight load
    try:
        return _run_plan(model, out, config, replace)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _run_plan(model: str, out: Path, config: PlanConfig, replace: bool) -> dict[str, Any]:
    from tqdm import tqdm

    from kvconvert.arch import adapter_for
    from kvconvert.calib.text import load_tokenizer
    from kvconvert.devices import resolve_device
    from kvconvert.eval.quality import FixedReference, evaluate_quality
    from kvconvert.eval.runner import ContextBytes, EvalConfig, bytes_16bit, load_model, model_context
    from kvconvert.eval.tasks import average_accuracy, make_batches
    from kvconvert.io.outdir import atomic_output_dir
    from kvconvert.io.source import open_source

    device = resolve_device(config.device)
    source = open_source(model)
    source.check()  # once, before the reference loads: a broken source is one error, not every candidate refused
    ids, scored_on = scoring_ids(source.path, config)
    ctx = config.context + config.continuation
    reference = load_model(str(source.path), device=device)
    if ctx > model_context(reference):
        raise KVConvertError(f"--context + --continuation = {ctx} exceeds the model's context of "
                             f"{model_context(reference)}")  # fmt: skip
    tokenizer = load_tokenizer(source.path)
    # every task sample first: a window too short for a task's needles is one error before minutes of work
    batches = make_batches(tokenizer, config.task_names(), (ctx,), config.task_samples, config.task_seed)
    eval_config = EvalConfig(data=scored_on, context=config.context, continuation=config.continuation,
                             chunk=config.chunk)  # fmt: skip
    ids = ids.to(device)
    fixed = FixedReference(reference, ids, ctx, config.context)  # the source's logits, once for every candidate
    reference_bytes = bytes_16bit(reference, ids, eval_config, ctx)
    jobs = candidates(config.methods, bool(adapter_for(source.config).layout().local_layers))
    rows: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    with (
        atomic_output_dir(out, replace, sources=[source.path], command="plan") as tmp,
        tempfile.TemporaryDirectory() as work,
    ):
        for index, (name, label, recipe) in enumerate(tqdm(jobs, desc="candidates", disable=not config.progress)):
            started = time.perf_counter()
            directory = Path(work) / f"c{index}"
            try:
                recipe_dict = _convert_candidate(source, {"method": name, **recipe}, label, config, directory, device)
            except KVConvertError as exc:
                refused.append({"label": label, "method": name, "recipe": {"method": name, **recipe},
                                "reason": str(exc)})  # fmt: skip
                continue
            candidate = load_model(str(directory), device=device)
            held = ContextBytes(candidate)  # ``bytes_16bit``'s number, measured on the way (no second pass)
            quality = evaluate_quality(candidate, ids, ctx, fixed, context=config.context, chunk=config.chunk,
                                       context_bytes=held)  # fmt: skip
            assert quality.reference_ppl is not None and held.bytes is not None
            budget = held.bytes / config.context / reference_bytes
            rows.append({
                "label": label, "method": name, "recipe": recipe_dict,
                "kv_budget": budget, "ppl": quality.ppl, "reference_ppl": quality.reference_ppl,
                "dppl": 100 * (quality.ppl / quality.reference_ppl - 1), "kl": quality.kl_mean,
                "top1": quality.top1_agreement, "seconds": time.perf_counter() - started,
            })  # fmt: skip
            del candidate
            shutil.rmtree(directory)  # one candidate on disk at a time (each is a whole checkpoint)

        tasks = None
        passes = None
        if batches:
            from kvconvert.eval.tasks import checked_accuracy

            started = time.perf_counter()

            def bar(label: str) -> str | None:
                return f"tasks: {label}" if config.progress else None

            by_sample: dict[Any, float] = {}
            source_tasks = checked_accuracy(reference, tokenizer, batches, config.chunk, bar("source"),
                                            scores=by_sample)[0]  # fmt: skip
            # candidates answer first what the source missed: as a rule they miss it too, so a check bound to fail
            # is out of reach after fewer samples (each a prefill of the whole length); the verdict is the same
            order = sorted(by_sample, key=lambda key: by_sample[key])  # stable: missed first, then as batched
            source_average = average_accuracy(source_tasks)[str(ctx)]
            tasks = {"names": list(config.task_names()), "length": ctx, "samples": config.task_samples,
                     "seed": config.task_seed, "max_drop": config.max_task_drop, "source": source_tasks,
                     "source_average": source_average, "seconds": time.perf_counter() - started}  # fmt: skip

            def passes(row: dict[str, Any]) -> bool:
                """Task accuracy of a candidate (converted again from its recipe, once) within the bound; the check
                stops at the sample after which the bound is out of reach (``checked_accuracy``), and the drop
                recorded is then a lower bound (``task_check_stopped``)."""
                if "task_drop" not in row:
                    began = time.perf_counter()
                    directory = Path(work) / "tasks"
                    _convert_candidate(source, row["recipe"], row["label"], config, directory, device)
                    candidate = load_model(str(directory), device=device)
                    floor = source_average - config.max_task_drop
                    row["tasks"], complete = checked_accuracy(candidate, tokenizer, batches, config.chunk,
                                                              bar(row["label"]), floor, order)  # fmt: skip
                    row["task_check_stopped"] = not complete
                    row["task_average"] = average_accuracy(row["tasks"])[str(ctx)]
                    row["task_drop"] = source_average - row["task_average"]
                    row["task_seconds"] = time.perf_counter() - began
                    del candidate
                    shutil.rmtree(directory)
                return bool(row["task_drop"] <= config.max_task_drop)

        result = _summary(model, scored_on, config, rows, refused, str(device), passes)
        result["tasks"] = tasks
        (tmp / "frontier.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_frontier(result, tmp / "frontier.png")
        (tmp / "recipes").mkdir()
        for pick in result["budgets"]:
            if pick["winner"] is not None:
                row = next(r for r in rows if r["label"] == pick["winner"])
                (tmp / "recipes" / f"budget-{pick['budget']:g}.yaml").write_text(_recipe_file(row))
        if result["max_dppl"] is not None and result["max_dppl"]["winner"] is not None:
            row = next(r for r in rows if r["label"] == result["max_dppl"]["winner"])
            (tmp / "recipes" / f"max-dppl-{config.max_dppl:g}.yaml").write_text(_recipe_file(row))
    return result


def _convert_candidate(
    source: Any, full: dict[str, Any], label: str, config: PlanConfig, directory: Path, device: torch.device
) -> dict[str, Any]:
    """Convert one candidate recipe into ``directory``; return the recipe as ``kvconvert run`` reads it
    (``KVConvertError`` when the method refuses this model). The same recipe converts to the same bytes."""
    from kvconvert.devices import computing_on
    from kvconvert.methods import build_method
    from kvconvert.pipeline import convert
    from kvconvert.recipe import parse_recipe, recipe_text

    name, method_config, storage = parse_recipe(full, label)
    if config.calib is not None and hasattr(method_config, "calib"):
        method_config = dataclasses.replace(method_config, calib=config.calib)
    method = build_method(name, method_config, storage)
    with computing_on(device):  # calibration and head profiles run where scoring does
        convert(source, method, directory, progress=False)
    return dict(yaml.safe_load(recipe_text(method)))


def _recipe_file(row: dict[str, Any]) -> str:
    tasks = "" if "task_drop" not in row else f", long-context tasks {0.0 - row['task_drop']:+.1f} points vs the source"
    header = (f"# kvconvert plan: {row['label']}; measured budget {row['kv_budget']:.3f} of a 16-bit cache, "
              f"Δppl {row['dppl']:+.2f} %, KL {row['kl']:.4f}{tasks}\n")  # fmt: skip
    return header + yaml.safe_dump(row["recipe"], sort_keys=False)


def _summary(model: str, scored_on: str, config: PlanConfig, rows: list[dict[str, Any]],
             refused: list[dict[str, Any]], device: str, passes: Any = None) -> dict[str, Any]:  # fmt: skip
    front = pareto_front(rows)
    picks = []
    for budget in sorted(config.budgets, reverse=True):
        pick = best_within(rows, budget, passes, config.task_tries)
        picks.append(pick if pick is not None else {"budget": budget, "winner": None})
    within = None
    if config.max_dppl is not None:
        best, rejected = smallest_within(rows, config.max_dppl, passes, config.task_tries)
        within = {"max_dppl": config.max_dppl, "winner": None if best is None else best["label"],
                  "kv_budget": None if best is None else best["kv_budget"],
                  "dppl": None if best is None else best["dppl"], "rejected_by_tasks": rejected,
                  "task_drop": None if best is None else best.get("task_drop")}  # fmt: skip
    return {
        "model": model, "scored_on": scored_on, "device": device,
        "protocol": {"context": config.context, "continuation": config.continuation, "windows": config.windows,
                     "chunk": config.chunk},
        "reference_ppl": rows[0]["reference_ppl"] if rows else None,
        "candidates": rows, "refused": refused, "pareto": [r["label"] for r in front],
        "budgets": picks, "max_dppl": within,
    }  # fmt: skip


def plot_frontier(result: dict[str, Any], path: Path) -> None:
    """Budget against Δppl, one marker per method, the Pareto front drawn, requested budgets dotted."""
    from kvconvert.analysis.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = dict(zip(CANDIDATES, "os^vDP", strict=True))
    for name in CANDIDATES:
        rows = [r for r in result["candidates"] if r["method"] == name]
        if rows:
            ax.scatter([r["kv_budget"] for r in rows], [r["dppl"] for r in rows], marker=markers[name], label=name)
    front = [r for r in result["candidates"] if r["label"] in result["pareto"]]
    front.sort(key=lambda r: r["kv_budget"])
    if front:
        ax.step([r["kv_budget"] for r in front], [r["dppl"] for r in front], where="post", color="k", lw=1,
                label="Pareto front")  # fmt: skip
    for pick in result["budgets"]:
        ax.axvline(pick["budget"], color="grey", ls=":", lw=0.8)
    ax.set_yscale("symlog", linthresh=1.0)
    values = [r["dppl"] for r in result["candidates"]]
    if values:  # symlog does not pad its limits: keep the extreme markers whole
        ax.set_ylim(min(-1.0, min(values) * 1.5), max(1.0, max(values) * 2.0))
    ax.set_xlabel("KV cache bytes ÷ a 16-bit cache's (measured)")
    ax.set_ylabel("Δ perplexity, % (symlog)")
    ax.set_title(f"{Path(result['model']).name}: quality against cache size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_report(result: dict[str, Any]) -> str:
    """Human-readable summary: the winner at each budget and by how much, the task check, the refusals."""
    lines = [f"scored on {result['scored_on']}; reference ppl {result['reference_ppl']:.3f}"
             if result["reference_ppl"] is not None else f"scored on {result['scored_on']}"]  # fmt: skip
    tasks = result.get("tasks")
    drops = {r["label"]: r["task_drop"] for r in result["candidates"] if "task_drop" in r}
    stopped = {r["label"] for r in result["candidates"] if r.get("task_check_stopped")}
    if tasks is not None:
        # what one answer is worth: a bound finer than that cannot tell a lossless recipe from one lucky draw
        step = 100 / (tasks["samples"] * len(tasks["names"]))
        coarse = "; more --task-samples resolve finer" if step > tasks["max_drop"] else ""
        lines.append(f"tasks {', '.join(tasks['names'])} at {tasks['length']} tokens, {tasks['samples']} samples each "
                     f"(seed {tasks['seed']}): source {tasks['source_average']:.1f} %; a recipe is recommended only "
                     f"within {tasks['max_drop']:g} points of it (one answer moves the average by up to "
                     f"{step:.1f} points{coarse})")  # fmt: skip

    def rejected(pick: dict[str, Any]) -> str:
        names = pick.get("rejected_by_tasks") or []
        return "".join(f"\n  rejected by the tasks: {n} ({'at most ' if n in stopped else ''}{0.0 - drops[n]:+.1f} "
                       f"points{', stopped once out of reach' if n in stopped else ''})" for n in names)  # fmt: skip

    def task_note(drop: float | None) -> str:
        return "" if drop is None else f", tasks {0.0 - drop:+.1f} points"

    for pick in result["budgets"]:
        if pick["winner"] is None:
            why = "no candidate passes the task check" if pick.get("rejected_by_tasks") else "no candidate fits"
            lines.append(f"budget {pick['budget']:g}: {why}{rejected(pick)}")
            continue
        runner_up = pick["runner_up"]
        margin = "" if runner_up is None else (
            f"; runner-up {runner_up}: KL +{pick['margin_kl']:.4f}, Δppl {pick['margin_dppl']:+.2f}")  # fmt: skip
        lines.append(f"budget {pick['budget']:g}: {pick['winner']} (budget {pick['kv_budget']:.3f}, "
                     f"KL {pick['kl']:.4f}, Δppl {pick['dppl']:+.2f} %{task_note(pick.get('task_drop'))})"
                     f"{margin}{rejected(pick)}")  # fmt: skip
    within = result["max_dppl"]
    if within is not None:
        found = "nothing" if within["winner"] is None else (
            f"{within['winner']} at budget {within['kv_budget']:.3f} (Δppl {within['dppl']:+.2f} %"
            f"{task_note(within.get('task_drop'))})")  # fmt: skip
        lines.append(f"within Δppl {within['max_dppl']:g} %: {found}{rejected(within)}")
    for row in result["refused"]:
        lines.append(f"refused: {row['label']}: {row['reason']}")
    return "\n".join(lines)
