"""``make bench-frontier``: ``kvconvert plan`` on SmolLM2-135M-Instruct, scored on wikitext-2 test and on
TinyStories validation (every method's candidates, each really converted), with the frontier picture
README shows at the top.

Protocol: ``--windows`` windows per text of ``--context`` tokens into the cache in one forward, the next
``--continuation`` scored through it; budgets are bytes held after the context ÷ a 16-bit stock cache's
(both measured). Writes bench/results/frontier-<date>.{json,md} and frontier-<data>-<date>.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RESULTS, machine, markdown_table, write_results  # noqa: E402
from bench.models import eval_texts, prepare_models  # noqa: E402
from kvconvert.plan import CANDIDATES, PlanConfig, format_report, run_plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--continuation", type=int, default=512)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--methods", default=None, help="comma-separated (default: every method)")
    parser.add_argument("--data", default=None, help="wikitext2 or tinystories (default: both)")
    parser.add_argument(
        "--only",
        default=None,
        help="only candidates whose label contains this text (a rerun of "
        "some rows: results go to frontier-<data>-only-<date>.*, the frontier picture is not redrawn)",
    )
    parser.add_argument("--name", default=None, help="results file stem instead (bench/results/NAME-<date>.*)")
    args = parser.parse_args()
    if args.only:
        for method, candidates in CANDIDATES.items():
            CANDIDATES[method] = [c for c in candidates if args.only in c[0]]
    started = time.perf_counter()
    src = prepare_models()["smollm2-135m"]
    results: dict[str, Any] = {}
    tables = []
    stamp = dt.date.today().isoformat()
    with tempfile.TemporaryDirectory() as tmp:
        for data, path in eval_texts(Path(tmp)).items():
            if args.data and data != args.data:
                continue
            config = PlanConfig(
                budgets=(0.5, 0.3, 0.2, 0.15), max_dppl=3.0, data=str(path), context=args.context,
                continuation=args.continuation, windows=args.windows, device="cpu",
                **({"methods": tuple(args.methods.split(","))} if args.methods else {}),
            )  # fmt: skip
            out = Path(tmp) / f"plan-{data}"
            result = run_plan(str(src), out, config)
            print(format_report(result), flush=True)
            RESULTS.mkdir(parents=True, exist_ok=True)
            if not args.only:
                shutil.copy(out / "frontier.png", RESULTS / f"frontier-{data}-{stamp}.png")
            results[data] = result
            front = set(result["pareto"])
            rows = sorted(result["candidates"], key=lambda r: r["kv_budget"])
            tables.append(f"### {data}: reference ppl {result['reference_ppl']:.3f}\n\n" + markdown_table(
                ["candidate", "KV budget vs 16-bit", "Δppl", "KL", "top-1", "on the front", "seconds"],
                [[r["label"], f"{r['kv_budget']:.3f}", f"{r['dppl']:+.2f} %", f"{r['kl']:.4f}", f"{r['top1']:.3f}",
                  "✓" if r["label"] in front else "", f"{r['seconds']:.0f}"] for r in rows],
            ) + "\n\n" + format_report(result).replace("\n", "  \n"))  # fmt: skip
    payload = {"benchmark": "frontier", "machine": machine(), "model": "SmolLM2-135M-Instruct fp32",
               "plans": results, "seconds": time.perf_counter() - started}  # fmt: skip
    header = (f"`kvconvert plan` on SmolLM2-135M-Instruct fp32: {args.windows} windows per text of {args.context} "
              f"context tokens into the cache, the next {args.continuation} scored through it; budget = bytes held "
              "after the context ÷ a 16-bit stock cache's (both measured). Every candidate really converted.\n\n"
              )  # fmt: skip
    name = args.name or "frontier" + (f"-{args.data}" if args.data else "") + ("-only" if args.only else "")
    write_results(name, payload, header + "\n\n".join(tables))


if __name__ == "__main__":
    main()
