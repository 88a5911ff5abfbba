"""Time to answer RULER-style samples with and without ``SharedPrefixes`` (each prompt starting from a copy of an
earlier prompt's cache at the last chunk boundary they share), one model, the same samples and order, one process;
the answers must agree.

    python bench/shared_prefix_bench.py [--model DIR] [--tasks niah_single,niah_multikey] [--length 8192]
        [--samples 3] [--seed 0] [--name shared-prefix]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: SmolLM2-135M fp32)")
    parser.add_argument("--tasks", default="niah_single,niah_multikey")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--name", default="shared-prefix")
    args = parser.parse_args()
    import torch

    from kvconvert.calib.text import load_tokenizer
    from kvconvert.eval.runner import load_model
    from kvconvert.eval.tasks import SharedPrefixes, answer, make_batches

    if args.model is None:
        from bench.models import prepare_models

        args.model = str(prepare_models()["smollm2-135m"])
    model = load_model(args.model).eval()  # a converted checkpoint through the installed runtime
    tokenizer = load_tokenizer(Path(args.model))
    batches = make_batches(tokenizer, tuple(args.tasks.split(",")), (args.length,), args.samples, args.seed)
    samples = [s for batch in batches.values() for s in batch]
    runs: dict[str, dict] = {}
    for label, keep in (("each prompt from scratch", 0), ("shared prefixes", None)):
        shared = SharedPrefixes([s.prompt for s in samples], args.chunk, **({} if keep is None else {"keep_bytes": 0}))
        started = time.perf_counter()
        with torch.no_grad():
            answers = [answer(model, tokenizer, s, args.chunk, functools.partial(shared.prefill, index=j))
                       for j, s in enumerate(samples)]  # fmt: skip
        runs[label] = {"seconds": time.perf_counter() - started, "prefilled_tokens": shared.prefilled,
                       "answers": answers}  # fmt: skip
    assert runs["shared prefixes"]["answers"] == runs["each prompt from scratch"]["answers"], "answers differ"
    base = runs["each prompt from scratch"]["seconds"]
    rows = [[label, f"{r['seconds']:.1f}", f"{r['seconds'] / base:.3f}", r["prefilled_tokens"]]
            for label, r in runs.items()]  # fmt: skip
    table = markdown_table(["run", "seconds", "× from scratch", "tokens prefilled"], rows)
    payload = {"machine": machine(), "model": args.model, "tasks": args.tasks, "length": args.length,
               "samples": args.samples, "seed": args.seed, "chunk": args.chunk, "runs": runs,
               "prompt_tokens": sum(len(s.prompt) for s in samples)}  # fmt: skip
    write_results(args.name, payload, table)


if __name__ == "__main__":
    main()
