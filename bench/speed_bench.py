"""Decode speed at long context (``make bench-speed``): converted models against their source, side by side.

For each context length: every model prefills the same random tokens once (its own cache), then
the models take turns decoding ``--steps`` greedy tokens from where they are, ``--rounds`` times
(interleaved, so a slow spell of the machine hits every model alike); the best round counts.
Reported: decode tokens/s, the ratio to the source measured in the same process, and the bytes the
cache holds after the prefill. The source runs as users run it: transformers' default dynamic cache
in the checkpoint's dtype (float32 for the GGUF-imported SmolLM2). Writes
bench/results/speed-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import prepare_models  # noqa: E402
from kvconvert.eval.speed import side_by_side  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods import build_method  # noqa: E402
from kvconvert.pipeline import convert  # noqa: E402
from kvconvert.recipe import parse_recipe  # noqa: E402

# (label, recipe): the conversions timed against the source
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("quant 4-bit KIVI layout, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    ("quant 4-bit token layout, sink 4 (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,16384", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=None, help="candidates whose label contains this text")
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    import kvconvert

    started = time.perf_counter()
    source_dir = prepare_models(include_smollm=True)["smollm2-135m"]
    source = AutoModelForCausalLM.from_pretrained(source_dir).eval()
    models: dict[str, Any] = {"source": source}
    recipes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, recipe in CANDIDATES:
            if args.only and args.only not in label:
                continue
            name, config, storage = parse_recipe(recipe, label)
            method = build_method(name, config, storage)
            out = Path(tmp) / f"m{len(models)}"
            convert(open_source(str(source_dir)), method, out, progress=False)
            models[label] = kvconvert.load(out).eval()
            recipes[label] = recipe
        rows: list[dict[str, Any]] = []
        for context in (int(c) for c in args.contexts.split(",")):
            measured = side_by_side(models, context, args.steps, args.rounds)
            source_speed, source_bytes = measured["source"]["decode_tokens_per_s"], measured["source"]["cache_bytes"]
            for label, row in measured.items():
                rows.append({
                    "context": context, "model": label, "recipe": recipes.get(label),
                    "decode_tokens_per_s": row["decode_tokens_per_s"],
                    "ratio_to_source": row["decode_tokens_per_s"] / source_speed,
                    "cache_bytes_after_prefill": row["cache_bytes"],
                    "cache_ratio_to_source": row["cache_bytes"] / source_bytes,
                })  # fmt: skip
                print(rows[-1], flush=True)
    table = markdown_table(
        ["context", "model", "decode tok/s", "× source", "cache MiB", "cache ÷ source (fp32)"],
        [[r["context"], r["model"], f"{r['decode_tokens_per_s']:.2f}", f"{r['ratio_to_source']:.2f}",
          f"{r['cache_bytes_after_prefill'] / 2**20:.1f}", f"{r['cache_ratio_to_source']:.3f}"] for r in rows],
    )  # fmt: skip
    payload = {"machine": machine(), "model": "smollm2-135m (fp32)", "steps": args.steps, "rounds": args.rounds,
               "rows": rows, "seconds": time.perf_counter() - started}  # fmt: skip
    write_results("speed", payload, table)


if __name__ == "__main__":
    main()
