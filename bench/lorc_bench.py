"""LoRC on SmolLM2-135M: progressive vs uniform schedule, K+V vs K-only allocation (``make bench-lorc``).

wikitext-2 test, first 4096 tokens, ctx 1024, budgets 0.9 / 0.75 / 0.6 / 0.5; quality only (ppl,
KL, top-1, measured budget). Writes bench/results/lorc-<date>.{json,md}.
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
from bench.models import smollm2_wikitext  # noqa: E402
from kvconvert.errors import KVConvertError  # noqa: E402
from kvconvert.eval.runner import run_eval  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods.lorc import LorcConfig, LorcMethod  # noqa: E402
from kvconvert.pipeline import convert  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.9, 0.75, 0.6, 0.5])
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args()
    started = time.perf_counter()
    src, config, base = smollm2_wikitext(args.max_tokens)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for budget in args.budgets:
            for compress in ("kv", "k"):
                for schedule in ("progressive", "uniform"):
                    row: dict[str, Any] = {"budget": budget, "compress": compress, "schedule": schedule}
                    dst = Path(tmp) / f"{budget}-{compress}-{schedule}"
                    try:
                        lorc = LorcConfig(kv_budget=budget, schedule=schedule, compress=compress)  # type: ignore[arg-type]
                        convert(open_source(str(src)), LorcMethod(lorc), dst, progress=False)
                    except KVConvertError as exc:
                        row["refused"] = str(exc)
                        rows.append(row)
                        print(row, flush=True)
                        continue
                    result = run_eval(str(dst), str(src), config)
                    row.update({k: result[k] for k in ("ppl", "kl_mean", "top1_agreement", "kv_budget_measured")})
                    rows.append(row)
                    print(row, flush=True)
    table_rows = []
    for r in rows:
        if "refused" in r:
            table_rows.append([r["budget"], r["compress"], r["schedule"], "—", "refused", "", "", ""])
            continue
        table_rows.append([
            r["budget"], r["compress"], r["schedule"], f"{r['kv_budget_measured']:.3f}", f"{r['ppl']:.2f}",
            f"{100 * (r['ppl'] / base['ppl'] - 1):+.1f}%", f"{r['kl_mean']:.3f}", f"{r['top1_agreement']:.3f}",
        ])  # fmt: skip
    table = markdown_table(
        ["budget", "factored", "schedule", "measured budget", "ppl", "Δppl", "KL", "top-1"], table_rows
    )
    table += (
        f"\n\nSmolLM2-135M fp32 reference ppl {base['ppl']:.3f} "
        f"(wikitext-2 test, first {args.max_tokens} tokens, ctx 1024)."
    )
    payload = {"benchmark": "lorc", "machine": machine(), "reference_ppl": base["ppl"], "rows": rows,
               "seconds": time.perf_counter() - started}  # fmt: skip
    write_results("lorc", payload, table)


if __name__ == "__main__":
    main()
