"""Prefill time of converted checkpoints beside their source, one process: the same wikitext-2 prompt into each
model's cache 512 tokens at a time (``quality.prefill``, what ``eval``, ``plan`` and the tasks do), best of
``--rounds``, the models taking turns.

    python bench/prefill_bench.py DIR [DIR ...] [--tokens 4096] [--rounds 2] [--name prefill]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import SHARED  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="converted checkpoint directories (of SmolLM2-135M by default)")
    parser.add_argument("--source", default=None, help="their source (default: SmolLM2-135M fp32)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="prefill")
    args = parser.parse_args()
    import torch

    from kvconvert.calib.text import load_tokenizer
    from kvconvert.eval.quality import prefill
    from kvconvert.eval.runner import load_model

    if args.source is None:
        from bench.models import prepare_models

        args.source = str(prepare_models()["smollm2-135m"])
    data = SHARED / "data" / "wikitext2" / "wikitext2_raw_test.txt"
    ids = load_tokenizer(Path(args.source))(data.read_text()[: 40 * args.tokens], return_tensors="pt").input_ids
    ids = ids[:, : args.tokens]
    models = {"source": load_model(args.source).eval(), **{m: load_model(m).eval() for m in args.models}}
    best = dict.fromkeys(models, float("inf"))
    started = time.perf_counter()
    with torch.no_grad():
        for model in models.values():  # warm: first-call allocations and lazy kernels
            prefill(model, ids[:, : args.chunk + 64], args.chunk)
        for _ in range(args.rounds):
            for name, model in models.items():
                began = time.perf_counter()
                prefill(model, ids, args.chunk)
                best[name] = min(best[name], time.perf_counter() - began)
    rows = [[name, f"{seconds:.2f}", f"{best['source'] / seconds:.3f}"] for name, seconds in best.items()]
    headers = ["model", f"prefill of {args.tokens} tokens, s (best of {args.rounds})", "× the source's speed"]
    table = markdown_table(headers, rows)
    payload = {"machine": machine(), "source": args.source, "tokens": args.tokens, "chunk": args.chunk,
               "rounds": args.rounds, "seconds": time.perf_counter() - started, "best": best}  # fmt: skip
    write_results(args.name, payload, table)


if __name__ == "__main__":
    main()
