"""Long-context tasks through the cache (``make bench-longctx``): RULER-style accuracy of converted SmolLM2-135M
against its source on the very same samples (``kvconvert eval --tasks``, ``kvconvert.eval.tasks``).

A first cut of the issue's suite: SmolLM2 at the lengths given (default 4096), the conversions below, N samples
per task (default 5: the average over seven tasks to about ±8 points). Each answer is generated greedily
through the model's cache after a chunked prefill. kvpress side by side and Gemma 3 at 16K are not in it yet.
Writes bench/results/longctx-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import prepare_models  # noqa: E402

# (label, recipe, budget against a 16-bit cache at long context as the conversion reports it)
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("quant fp8 (vLLM/SGLang format)", {"method": "quant", "kv_format": "fp8"}),
    ("quant 4-bit, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    ("razor (paper)", {"method": "razor", "profile_tokens": 256}),
    ("razor + 4-bit token layout, sink 4 (ext.)",
     {"method": "razor", "profile_tokens": 256, "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--tasks", default="all")
    parser.add_argument("--only", default=None, help="candidates whose label contains this text ('|': any of several)")
    args = parser.parse_args()
    started = time.time()

    import kvconvert
    from kvconvert.eval.runner import TaskEvalConfig, load_for_eval
    from kvconvert.eval.tasks import run_tasks
    from kvconvert.io.source import open_source
    from kvconvert.methods import build_method
    from kvconvert.pipeline import convert
    from kvconvert.recipe import parse_recipe

    config = TaskEvalConfig.parse(args.tasks, args.lengths, args.samples, 0, False, "cpu", True)
    source = prepare_models()["smollm2-135m"]
    reference, tokenizer = load_for_eval(str(source))
    models: dict[str, Any] = {"source": reference}
    budgets: dict[str, float] = {"source": 1.0}
    wanted = [c for c in CANDIDATES if args.only is None or any(p in c[0] for p in args.only.split("|"))]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, recipe) in enumerate(wanted):
            name, method_config, storage = parse_recipe(recipe, label)
            result = convert(open_source(str(source)), build_method(name, method_config, storage), Path(tmp) / str(i),
                             progress=False)  # fmt: skip
            budgets[label] = result.report.get("kv_budget_expected_vs_16bit", result.report["kv_budget_expected"])
            models[label] = kvconvert.load(Path(tmp) / str(i)).eval()
        outcome = run_tasks(models, tokenizer, config.tasks, config.lengths, config.samples, progress=True)

    rows = []
    for label in models:
        cells = [f"{outcome['accuracy'][label][task][str(n)]:.0f}" for n in config.lengths for task in config.tasks]
        rows.append([label, f"{budgets[label]:.3f}", *cells,
                     *(f"{outcome['average'][label][str(n)]:.1f}" for n in config.lengths)])  # fmt: skip
    headers = ["model", "KV budget", *(f"{t} {n}" for n in config.lengths for t in config.tasks),
               *(f"average {n}" for n in config.lengths)]  # fmt: skip
    table = (f"SmolLM2-135M, {config.samples} samples per task and length (seed 0), accuracy in %; budgets against "
             f"a 16-bit cache\n\n" + markdown_table(headers, rows))  # fmt: skip
    payload = {"machine": machine(), "budgets": budgets, "recipes": dict(wanted), **outcome,
               "seconds": time.time() - started}  # fmt: skip
    write_results("longctx", payload, table)


if __name__ == "__main__":
    main()
