"""The KIVI readers alone, compiled and eager: ``kvconvert_folded.folded_scores`` (keys) and ``folded_value_sum``
(values) on random codes, µs a call (best of rounds of 30 calls), for the shapes of a decode step of SmolLM2 (G = 3
query rows a KV head, d = 64, groups of 64; ``--group 4 --dim 128``: Llama-3.1-8B's). Compare runtimes by running it
from each checkout.

    python bench/folded_readers_bench.py --bits 3 [--shapes 1x3x1024,8x3x4096] [--group 4 --dim 128]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvconvert.runtime import kvconvert_folded  # noqa: E402
from kvconvert.runtime.kvconvert_codec import quantize_tokens  # noqa: E402


def best(fn, rounds: int = 3, calls: int = 30) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--shapes", default="1x3x256,1x3x1024,8x3x256,8x3x1024,8x3x4096",
                        help="rows x KV heads x tokens, comma-separated")  # fmt: skip
    parser.add_argument("--group", type=int, default=3, help="query rows a KV head")
    parser.add_argument("--dim", type=int, default=64, help="a head's channels")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        rows, heads, tokens = (int(x) for x in shape.split("x"))
        states = torch.randn(rows, heads, tokens, args.dim)
        keys, values = quantize_tokens(states, args.bits, 64, True), quantize_tokens(states, args.bits, 64, False)
        query = torch.randn(rows, heads, args.group, args.dim)
        weights = torch.randn(rows, heads, args.group, tokens).softmax(-1)
        row = {"shape": shape, "bits": args.bits, "query_rows": args.group, "dim": args.dim}
        for mode in ("compiled", "eager"):
            os.environ["KVCONVERT_COMPILE"] = "on" if mode == "compiled" else "off"
            kvconvert_folded.FUSE_MIN_CODES = 0  # every size compiled in the compiled rows
            read_keys = (kvconvert_folded.folded_scores, query, keys.codes, keys.scale, keys.zero, args.bits)
            read_values = (kvconvert_folded.folded_value_sum, weights, values.codes, values.scale, values.zero,
                           args.bits)  # fmt: skip
            row[f"keys_{mode}_us"] = round(best(functools.partial(*read_keys)))
            row[f"values_{mode}_us"] = round(best(functools.partial(*read_values)))
        print(json.dumps(row), flush=True)
        results.append(row)


if __name__ == "__main__":
    main()
