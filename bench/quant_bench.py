"""Quantized KV storage on SmolLM2-135M (``make bench-quant``): quant alone, and methods composed with it.

Context-compression protocol (DESIGN.md's comparison with the alternatives): each window's first
1536 tokens go into the cache in one forward, the next 512 are scored in one forward through that
cache; 4 windows of wikitext-2 test and 4 of TinyStories validation. Budgets are the bytes the cache
holds after the context ÷ those of a 16-bit stock cache (the model runs in fp32, which would
otherwise flatter every compression 2×). Writes bench/results/quant-<date>.{json,md}.

``--quick``: wikitext-2 only, fewer candidates (a smoke run of the script). ``--only 'TEXT|TEXT…'``: run
the candidates whose label contains one of the TEXTs and merge their rows into the newest results file.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RESULTS, machine, markdown_table, write_results  # noqa: E402
from bench.models import eval_texts, prepare_models  # noqa: E402
from kvconvert.eval.runner import EvalConfig, run_eval  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods import build_method  # noqa: E402
from kvconvert.pipeline import convert  # noqa: E402
from kvconvert.recipe import parse_recipe  # noqa: E402

CONTEXT, CONTINUATION, WINDOWS = 1536, 512, 4
PROFILE = {"profile_tokens": 256}  # razor's head profile: 256 random tokens × 4 (minutes, not half an hour)

# (label, recipe, texts): the recipe keys are exactly what `kvconvert run` takes; "both" = wikitext-2 and
# TinyStories, "wiki" = wikitext-2 only (the candidates that only show a method does not pay)
EXT = {"kv_residual": 0, "kv_sink": 4, "kv_rotate": True}
RAZOR_SMALL = {"method": "razor", "kv_budget": 0.25, "window": 64, "induction_frac": 0.07, **PROFILE}
CANDIDATES: list[tuple[str, dict[str, Any], str]] = [
    ("quant 8-bit", {"method": "quant", "kv_bits": 8}, "wiki"),
    ("quant 4-bit", {"method": "quant", "kv_bits": 4}, "wiki"),
    ("quant 4-bit, residual 0", {"method": "quant", "kv_bits": 4, "kv_residual": 0}, "both"),
    ("quant 2-bit, residual 0", {"method": "quant", "kv_bits": 2, "kv_residual": 0}, "both"),
    ("razor 0.5 (16-bit)", {"method": "razor", "kv_budget": 0.5, **PROFILE}, "both"),
    ("razor 0.5 + 4-bit", {"method": "razor", "kv_budget": 0.5, "kv_bits": 4, **PROFILE}, "wiki"),
    (
        "razor 0.5 + 4-bit, residual 32",
        {"method": "razor", "kv_budget": 0.5, "kv_bits": 4, "kv_residual": 32, **PROFILE},
        "both",
    ),  # fmt: skip
    ("razor 0.25 (window 64) + 4-bit, residual 32", {**RAZOR_SMALL, "kv_bits": 4, "kv_residual": 32}, "both"),
    ("quant mixed 2/4-bit, budget 0.2 (ext.)", {"method": "quant", "kv_budget": 0.2}, "wiki"),
    (
        "quant mixed 2/4-bit, budget 0.22, residual 0 (ext.)",
        {"method": "quant", "kv_budget": 0.22, "kv_residual": 0},
        "wiki",
    ),  # fmt: skip
    (
        "lorc k 0.75 + 4-bit",
        {"method": "lorc", "kv_budget": 0.75, "compress": "k", "schedule": "uniform", "kv_bits": 4},
        "wiki",
    ),  # fmt: skip
    ("minicache (paper) + 4-bit", {"method": "minicache", "kv_bits": 4}, "wiki"),
    # the storage extensions: the first tokens exact (attention sinks), values rotated before quantizing
    ("quant 4-bit, residual 0, sink 4 + rotated values (ext.)", {"method": "quant", "kv_bits": 4, **EXT}, "both"),
    # the token layout: key block means + rotated per-token codes that torch's int4 kernel reads (decode speed)
    (
        "quant 4-bit token layout, residual 0, sink 4 (ext.)",
        {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"},
        "both",
    ),  # fmt: skip
    ("quant 3-bit, residual 0", {"method": "quant", "kv_bits": 3, "kv_residual": 0}, "wiki"),
    ("quant 3-bit, residual 0, sink 4 + rotated values (ext.)", {"method": "quant", "kv_bits": 3, **EXT}, "both"),
    ("quant 2-bit, residual 0, sink 4 + rotated values (ext.)", {"method": "quant", "kv_bits": 2, **EXT}, "wiki"),
    (
        "quant mixed 4/8-bit, budget 0.3, residual 0, sink 4 + rotated values (ext.)",
        {"method": "quant", "kv_budget": 0.3, "min_bits": 4, "max_bits": 8, **EXT},
        "both",
    ),  # fmt: skip
    (
        "quant mixed 2/3/4-bit, budget 0.2, residual 0, sink 4 + rotated values (ext.)",
        {"method": "quant", "kv_budget": 0.2, **EXT},
        "both",
    ),  # fmt: skip
    (
        "razor 0.5 + 3-bit, residual 32, sink 4 + rotated values (ext.)",
        {"method": "razor", "kv_budget": 0.5, "kv_bits": 3, **EXT, "kv_residual": 32, **PROFILE},
        "both",
    ),  # fmt: skip
]
QUICK = {"quant 8-bit", "quant 4-bit", "quant 2-bit, residual 0"}


def main() -> None:
    quick = "--quick" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1].split("|") if "--only" in sys.argv else None
    started = time.perf_counter()
    src = prepare_models()["smollm2-135m"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        texts = eval_texts(Path(tmp))
        if quick:
            texts = {"wikitext2": texts["wikitext2"]}
        configs = {
            name: EvalConfig(
                data=str(path),
                max_tokens=WINDOWS * (CONTEXT + CONTINUATION),
                context=CONTEXT,
                continuation=CONTINUATION,
                retrieval=False,
                speed=False,
                progress=False,
            )  # fmt: skip
            for name, path in texts.items()
        }
        for label, recipe, which in CANDIDATES:
            if (quick and label not in QUICK) or (only is not None and not any(text in label for text in only)):
                continue
            name, config, storage = parse_recipe(recipe, label)
            dst = Path(tmp) / "candidate"
            t0 = time.perf_counter()
            convert(open_source(str(src)), build_method(name, config, storage), dst, replace=True, progress=False)
            convert_s = time.perf_counter() - t0
            for data, eval_config in configs.items():
                if which == "wiki" and data != "wikitext2":
                    continue
                result = run_eval(str(dst), str(src), eval_config)
                row = {
                    "candidate": label, "recipe": recipe, "data": data, "convert_seconds": convert_s,
                    **{k: result[k] for k in ("ppl", "reference_ppl", "kl_mean", "top1_agreement",
                                              "kv_bytes_per_token", "kv_budget_measured", "kv_budget_vs_16bit",
                                              "tokens", "seconds")},
                }  # fmt: skip
                row["dppl_pct"] = 100 * (row["ppl"] / row["reference_ppl"] - 1)
                print(f"{label:<34} {data:<12} budget vs 16-bit {row['kv_budget_vs_16bit']:.3f}  "
                      f"Δppl {row['dppl_pct']:+.2f} %  KL {row['kl_mean']:.4f}", flush=True)  # fmt: skip
                rows.append(row)
                save(rows, quick, only, started)


def save(rows: list[dict[str, Any]], quick: bool, only: list[str] | None, started: float) -> None:
    """Write the results files (after every row, so that a stopped run keeps what it measured)."""
    if only is not None:  # merge into the newest results file: earlier rows of other candidates stay
        files = sorted(RESULTS.glob("quant-2*.json"))
        if files:
            previous = files[-1]
            labels = {r["candidate"] for r in rows}
            rows = [r for r in json.loads(previous.read_text())["rows"] if r["candidate"] not in labels] + rows
    table_rows = [
        [r["candidate"], r["data"], f"{r['kv_budget_vs_16bit']:.3f}", f"{r['kv_budget_measured']:.3f}",
         f"{r['ppl']:.3f}", f"{r['reference_ppl']:.3f}", f"{r['dppl_pct']:+.2f} %", f"{r['kl_mean']:.4f}",
         f"{r['top1_agreement']:.3f}"]
        for r in sorted(rows, key=lambda r: (r["data"], r["kv_budget_vs_16bit"]))
    ]  # fmt: skip
    table = markdown_table(
        ["candidate", "data", "KV budget vs 16-bit", "vs fp32 stock", "ppl", "reference ppl", "Δppl", "KL",
         "top-1"], table_rows,
    )  # fmt: skip
    table += (
        f"\n\nSmolLM2-135M-Instruct fp32; {WINDOWS} windows per text of {CONTEXT} context tokens into the cache "
        f"in one forward, then {CONTINUATION} scored through it. Budget vs 16-bit = bytes held after the context "
        "÷ a 16-bit stock cache's, both measured on bfloat16 copies (what a 16-bit deployment holds); vs fp32 "
        "stock = the same ratio in the fp32 run. Groups of 64; residual = newest tokens kept unquantized "
        "(default 128)."
    )
    payload = {"benchmark": "quant", "machine": machine(), "context": CONTEXT, "continuation": CONTINUATION,
               "windows": WINDOWS, "rows": rows, "seconds": time.perf_counter() - started}  # fmt: skip
    write_results("quant" + ("-quick" if quick else ""), payload, table)


if __name__ == "__main__":
    main()
