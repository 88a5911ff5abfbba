"""ZACK on SmolLM2-135M at budgets 0.9 / 0.75 / 0.6 / 0.5, K+V (the paper) and K only, the paper's V‖W_O
basis and kvconvert's output-weighted one (``--value-basis output``), the paper's one removal rate and
kvconvert's widths by measured loss (``--schedule auto``), next to LoRC, plus the paper's headline
search: the smallest cache keeping 99 % top-1 agreement (``make bench-zack``).

wikitext-2 test, first 4096 tokens, ctx 1024: ppl, KL, top-1 agreement and the KV budget measured
from the cache. Calibration: the shipped calib_data/ (16 384 tokens). LoRC rows come from the
newest bench/results/lorc-*.json (same text and settings); run ``make bench-lorc`` to refresh them.
Also records the peak RSS and time of one conversion (calibration included), in a child process.
Writes bench/results/zack-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RESULTS, machine, markdown_table, write_results  # noqa: E402
from bench.models import smollm2_wikitext  # noqa: E402
from kvconvert.errors import KVConvertError  # noqa: E402
from kvconvert.eval.runner import run_eval  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods.zack.method import ZackConfig, ZackMethod  # noqa: E402
from kvconvert.pipeline import convert  # noqa: E402


def peak_conversion(src: Path, dst: Path) -> dict[str, float]:
    """Wall time and peak RSS (VmHWM) of ``kvconvert zack --kv-budget 0.75`` in a fresh process."""
    code = (
        "import sys, time; from kvconvert.cli import main; t = time.perf_counter()\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('WALL', time.perf_counter() - t)\n"
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent (the bench itself)
        "print('PEAK', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"
    )
    out = subprocess.run([sys.executable, "-c", code, "zack", "--model", str(src), "--out", str(dst), "--kv-budget",
                          "0.75", "--quiet"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    values = dict(line.split() for line in out.splitlines() if line.startswith(("WALL", "PEAK")))
    return {"seconds": float(values["WALL"]), "peak_rss_mib": float(values["PEAK"]) / 1024}


def seconds_of(row: dict[str, Any]) -> str:
    """A row's conversion time for the table (rows written before it was recorded have none)."""
    return f"{row['convert_seconds']:.0f}" if "convert_seconds" in row else ""


def newest_lorc_rows() -> list[dict[str, Any]]:
    """Rows of the newest full ``make bench-lorc`` run on wikitext-2 (``lorc-<date>.json``; not a subset of
    rows, not TinyStories)."""
    full = sorted(f for f in RESULTS.glob("lorc-*.json") if re.fullmatch(r"lorc-\d{4}-\d{2}-\d{2}\.json", f.name))
    return list(json.loads(full[-1].read_text())["rows"]) if full else []


def render(rows: list[dict[str, Any]], base_ppl: float, budgets: list[float], max_tokens: int,
           cost: dict[str, float]) -> str:  # fmt: skip
    """The Markdown table: these ZACK rows, then bench-lorc's 16-bit rows at the same budgets."""
    lorc = newest_lorc_rows()
    table_rows = []
    for r in rows:
        variant = r["value_basis"] + (" (paper)" if r["value_basis"] == "paper" else " (ext.)")
        if r.get("schedule") == "auto":
            variant += ", --schedule auto (ext.)"
        head = ["zack", r["target"], r["compress"], variant]
        if "refused" in r:
            table_rows.append([*head, "—", "refused", "", "", "", "", ""])
            continue
        setting = "widths by loss" if r["removal_rate"] is None else f"r={r['removal_rate']:.4f}"
        table_rows.append([
            *head, setting, f"{r['kv_budget_measured']:.3f}",
            f"{r['ppl']:.2f}", f"{100 * (r['ppl'] / base_ppl - 1):+.1f}%", f"{r['kl_mean']:.3f}",
            f"{r['top1_agreement']:.3f}", seconds_of(r),
        ])  # fmt: skip
    for r in lorc:  # bench-lorc's 16-bit rows at these budgets, for comparison
        if r.get("kv_bits") is None and r.get("lorc_budget") in budgets and "refused" not in r:
            table_rows.append([
                "lorc", r["lorc_budget"], r["options"].get("compress", "kv"), r["variant"], "",
                f"{r['kv_budget_measured']:.3f}", f"{r['ppl']:.2f}", f"{100 * (r['ppl'] / base_ppl - 1):+.1f}%",
                f"{r['kl_mean']:.3f}", f"{r['top1_agreement']:.3f}", seconds_of(r),
            ])  # fmt: skip
    table = markdown_table(
        ["method", "target", "truncated", "V basis / variant", "setting", "measured budget", "ppl", "Δppl", "KL",
         "top-1", "convert s"], table_rows,
    )  # fmt: skip
    table += (
        f"\n\nSmolLM2-135M fp32 reference ppl {base_ppl:.3f} (wikitext-2 test, first {max_tokens} tokens, "
        f"ctx 1024). ZACK calibrated on calib_data/ (16 384 tokens); the agreement rows search r on held-out "
        f"calib_data chunks, then are scored on wikitext like the others. One conversion (budget 0.75, "
        f"calibration included): {cost['seconds']:.1f} s, peak RSS {cost['peak_rss_mib']:.0f} MiB."
    )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.9, 0.75, 0.6, 0.5])
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--target-agreement", type=float, default=0.99, help="0: skip the search rows.")
    parser.add_argument("--compress", nargs="+", default=["kv", "k"])
    parser.add_argument("--value-bases", nargs="+", default=["paper", "output"])
    parser.add_argument("--auto-budgets", type=float, nargs="*", default=[0.75, 0.5],
                        help="--schedule auto rows (K+V, each V basis): ~6 minutes each on 2 cores.")  # fmt: skip
    parser.add_argument("--name", default="zack", help="Results file stem (bench/results/<name>-<date>).")
    args = parser.parse_args()
    started = time.perf_counter()
    src, config, base = smollm2_wikitext(args.max_tokens)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cost = peak_conversion(src, Path(tmp) / "peak")
        print(cost, flush=True)
        jobs: list[tuple[str, ZackConfig]] = []
        for compress in args.compress:
            for basis in args.value_bases:
                common = {"compress": compress, "value_basis": basis}
                for budget in args.budgets:
                    jobs.append((f"{budget}", ZackConfig(kv_budget=budget, **common)))
                # auto allocates K and V itself, so one truncated-side setting is enough
                for budget in args.auto_budgets if compress == "kv" else []:
                    jobs.append((f"{budget}", ZackConfig(kv_budget=budget, schedule="auto", **common)))
                if args.target_agreement > 0:
                    jobs.append((f"agreement ≥ {args.target_agreement}",
                                 ZackConfig(target_agreement=args.target_agreement, **common)))  # fmt: skip
        for label, zack in jobs:
            dst = Path(tmp) / f"{label}-{zack.compress}-{zack.value_basis}-{zack.schedule}".replace(" ", "")
            try:
                began = time.perf_counter()
                result = convert(open_source(str(src)), ZackMethod(zack), dst, progress=False)
                seconds = time.perf_counter() - began
            except KVConvertError as exc:  # e.g. K-only cannot go below ~0.5
                rows.append({"target": label, "compress": zack.compress, "value_basis": zack.value_basis,
                             "schedule": zack.schedule, "refused": str(exc)})  # fmt: skip
                print(rows[-1], flush=True)
                continue
            first = result.report["plan"]  # removal rate and calibration: whole-model decisions
            evaluation = run_eval(str(dst), str(src), config)
            scores = {k: evaluation[k] for k in ("ppl", "kl_mean", "top1_agreement", "kv_budget_measured")}
            row = {"target": label, "compress": zack.compress, "value_basis": zack.value_basis,
                   "schedule": zack.schedule, "removal_rate": first["removal_rate"], "convert_seconds": seconds,
                   **scores}  # fmt: skip
            if "search" in first["calibration"]:
                row["search"] = first["calibration"]["search"]
            rows.append(row)
            print({k: v for k, v in row.items() if k != "search"}, flush=True)
    table = render(rows, base["ppl"], sorted({*args.budgets, *args.auto_budgets}), args.max_tokens, cost)
    payload = {"benchmark": "zack", "machine": machine(), "reference_ppl": base["ppl"], "conversion": cost,
               "rows": rows, "seconds": time.perf_counter() - started}  # fmt: skip
    write_results(args.name, payload, table)


if __name__ == "__main__":
    main()
