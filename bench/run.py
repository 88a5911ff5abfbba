"""Quality / memory / speed of every implemented method on real models (``make bench``).

For each model: the original, then each method at each KV budget of the ladder (exact methods at
their natural point), evaluated with ``kvconvert eval`` on wikitext-2 test and TinyStories
validation. Writes bench/results/quality-<date>.{json,md}.
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
from bench.models import eval_texts, prepare_models  # noqa: E402
from kvconvert.errors import KVConvertError  # noqa: E402
from kvconvert.eval.runner import EvalConfig, run_eval  # noqa: E402

LADDER = (1.0, 0.9, 0.75, 0.6, 0.5)


def conversions() -> list[tuple[str, float, Any]]:
    """(method, budget, factory) for every implemented method; exact methods at their natural point."""
    from kvconvert.methods.lorc.method import LorcConfig, LorcMethod
    from kvconvert.methods.slim.method import SlimMethod

    ladder: list[tuple[str, float, Any]] = [("slim", 0.5, SlimMethod)]
    for budget in LADDER:
        ladder.append(("lorc", budget, lambda b=budget: LorcMethod(LorcConfig(kv_budget=b))))
    return ladder


def convert(src: Path, dst: Path, factory: Any) -> str | None:
    """Convert; return None on success or the refusal message (e.g. GQA for slim)."""
    from kvconvert.io.source import open_source
    from kvconvert.pipeline import convert as run_convert

    try:
        run_convert(open_source(str(src)), factory(), dst, progress=False)
    except KVConvertError as exc:
        return str(exc)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="llama2.c models only, 1024 tokens, short retrieval")
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args()
    max_tokens = 1024 if args.quick else args.max_tokens
    # passkey/copy with generate() dominate the run time on CPU; two lengths keep `make bench` < 20 min
    lengths = (128,) if args.quick else (256, 1024)

    started = time.perf_counter()
    models = prepare_models(include_smollm=not args.quick)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        texts = eval_texts(Path(tmp))
        if not texts:
            raise SystemExit("no evaluation text: ../shared/data is missing")
        for model_name, src in models.items():
            converted: dict[str, Path | str] = {}
            for method, budget, factory in conversions():
                dst = Path(tmp) / f"{model_name}-{method}-{budget}"
                refusal = convert(src, dst, factory)
                converted[f"{method}@{budget}"] = refusal if refusal else dst
            base_speed = None
            for first, (text_name, text) in zip((True, False, False), texts.items(), strict=False):
                # passkey/copy and speed do not depend on the text: measure them on the first text only
                config = EvalConfig(
                    data=str(text), ctx=1024, max_tokens=max_tokens, retrieval_lengths=lengths, progress=False,
                    retrieval=first, speed=first, reference_extras=False,
                )  # fmt: skip
                base = run_eval(str(src), None, config)
                base_speed = base.get("decode_tokens_per_s", base_speed)
                rows.append({**base, "model": model_name, "data": text_name, "method": "original", "budget": 1.0})
                print(f"{model_name} {text_name} original ppl {base['ppl']:.3f}", flush=True)
                for key, target in converted.items():
                    method, budget = key.split("@")
                    row: dict[str, Any] = {"model": model_name, "data": text_name, "method": method,
                                           "budget": float(budget)}  # fmt: skip
                    if isinstance(target, str):
                        row["refused"] = target
                    else:
                        row = {**run_eval(str(target), str(src), config), **row}
                        if "decode_tokens_per_s" in row and base_speed:
                            row["decode_speed_ratio"] = row["decode_tokens_per_s"] / base_speed
                        print(f"{model_name} {text_name} {key} ppl {row['ppl']:.3f}", flush=True)
                    rows.append(row)

    payload = {"benchmark": "quality", "machine": machine(), "seconds": time.perf_counter() - started, "rows": rows}
    write_results("quality-quick" if args.quick else "quality", payload, render(rows))


def _passkey(row: dict[str, Any]) -> str:
    if "passkey" not in row:
        return ""  # measured on the first text only
    values = [v for v in row["passkey"].values() if v is not None]
    return f"{sum(values) / len(values):.2f}" if values else "n/a"


def render(rows: list[dict[str, Any]]) -> str:
    table = []
    for row in rows:
        if "refused" in row:
            reason = "refused: " + row["refused"].split(" but ")[0].split(": it would")[0]
            table.append([row["model"], row["data"], row["method"], f"{row['budget']:.2f}", "—", "", "", "", "", "",
                          "", reason])  # fmt: skip
            continue
        base = next(r for r in rows if r["model"] == row["model"] and r["data"] == row["data"]
                    and r["method"] == "original")  # fmt: skip
        delta = 100 * (row["ppl"] / base["ppl"] - 1)
        has_ref = row.get("reference") is not None
        table.append([
            row["model"], row["data"], row["method"], f"{row['budget']:.2f}",
            f"{row['kv_budget_measured']:.3f}" if has_ref else "1.000",
            f"{row['ppl']:.3f}", f"{delta:+.2f}%" if has_ref else "",
            f"{row['kl_mean']:.2e}" if has_ref else "", f"{row['top1_agreement']:.4f}" if has_ref else "",
            _passkey(row), f"{row['decode_speed_ratio']:.2f}" if "decode_speed_ratio" in row else "",
            f"ctx {row['ctx']}",
        ])  # fmt: skip
    headers = ["model", "data", "method", "budget", "measured budget", "ppl", "Δppl", "KL", "top-1", "passkey",
               "decode speed ×", "note"]  # fmt: skip
    return markdown_table(headers, table)


if __name__ == "__main__":
    main()
