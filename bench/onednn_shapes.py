"""Why a half-precision decode step splits its products with the cache (``kvconvert_products.cache_scores`` /
``cache_mix``): per-call times of one layer's products with a cache that grows by one token a call (a decode step)
against the same products at a fixed length, in bfloat16 and float32; and ``q @ kᵀ`` against ``(k @ qᵀ)ᵀ`` (the
cache handed to oneDNN transposed or not). Writes bench/results/NAME-<date>.{json,md}.

    python bench/onednn_shapes.py --name onednn-shapes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from kvconvert.runtime.kvconvert_products import cache_mix, cache_scores  # noqa: E402


def per_call_us(product: Any, start: int, calls: int, growing: bool) -> float:
    """Mean µs of ``product(n)`` over ``calls`` calls, ``n`` growing by one a call from ``start`` or fixed at it."""
    product(start)  # the fixed length's kernel built before timing
    began = time.perf_counter()
    for i in range(calls):
        product(start + i if growing else start)
    return (time.perf_counter() - began) / calls * 1e6


def _products(query: torch.Tensor, cache: torch.Tensor, weights: torch.Tensor) -> dict[str, Any]:
    """Each way of taking one layer's products with the first ``n`` cached tokens, as a function of ``n``."""
    return {
        "scores q @ kᵀ": lambda n: torch.bmm(query, cache[:, :n].transpose(1, 2)),
        "scores (k @ qᵀ)ᵀ": lambda n: torch.bmm(cache[:, :n], query.transpose(1, 2)).transpose(1, 2),
        "scores cache_scores": lambda n: cache_scores(query, cache[:, :n]),
        "values p @ v": lambda n: torch.bmm(weights[:, :, :n].contiguous(), cache[:, :n]),
        "values cache_mix": lambda n: cache_mix(weights[:, :, :n].contiguous(), cache[:, :n]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="onednn-shapes")
    parser.add_argument("--calls", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    heads, width = 9, 107  # SmolLM2's 9 query heads against one ZACK layer's packed cache
    for batch, start in ((1, 1024), (8, 1024), (1, 4096)):
        for dtype in (torch.float32, torch.bfloat16):
            cache = torch.randn(batch, start + args.calls + 64, width, dtype=dtype)
            query = torch.randn(batch, heads, width, dtype=dtype)
            weights = torch.softmax(torch.randn(batch, heads, start + args.calls + 64), -1).to(dtype)
            for label, product in _products(query, cache, weights).items():
                row = {"batch": batch, "tokens": start, "dtype": str(dtype).removeprefix("torch."), "product": label,
                       "fixed_us": per_call_us(product, start, args.calls, False),
                       "growing_us": per_call_us(product, start + 1, args.calls, True)}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
    table = markdown_table(["batch", "tokens", "dtype", "product", "µs a call, fixed length", "µs a call, growing"],
                           [[r["batch"], r["tokens"], r["dtype"], r["product"], f"{r['fixed_us']:.0f}",
                             f"{r['growing_us']:.0f}"] for r in rows])  # fmt: skip
    write_results(args.name, {"machine": machine(), "heads": heads, "width": width, "calls": args.calls, "rows": rows},
                  table)  # fmt: skip


if __name__ == "__main__":
    main()
