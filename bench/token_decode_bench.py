"""One layer's decode step in the token layout against the source's, side by side in one process.

For each context n: token-layout stores (4-bit, group 64, sink 4) hold n random key/value tokens of
SmolLM2-135M's shapes (9 query heads, 3 KV heads, width 64); a step is ``token_decode`` plus the two
appends, timed against what transformers' dynamic cache and SDPA do per layer (concatenate the new
token to the whole cache, then attend). ``--steps`` steps per round from the same state (the stores are
copied each round), alternating, best of ``--rounds``. Writes bench/results/NAME-<date>.{json,md}.
Where ``make bench-speed`` shows the whole model, this shows the attention alone: the fixed cost per
step that decides the ratio at short contexts.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from bench.common import machine, markdown_table, write_results  # noqa: E402
from kvconvert.runtime.kvconvert_codec import QuantSpec  # noqa: E402
from kvconvert.runtime.kvconvert_quant import int4_kernel_available, token_decode  # noqa: E402
from kvconvert.runtime.kvconvert_tokenlayout import TokenLayoutStore  # noqa: E402

HEADS, KV_HEADS, WIDTH, SCALING = 9, 3, 64, 0.125


class _Attention(torch.nn.Module):
    """What ``sdpa_attention_forward`` reads from an attention module."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def measure(context: int, steps: int, rounds: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(context)
    keys, values = (torch.randn(1, KV_HEADS, context, WIDTH, generator=generator) for _ in range(2))
    quant = QuantSpec(bits=4, group=64, residual=0, sink=4, layout="token")
    key_store, value_store = TokenLayoutStore(quant, keys=True), TokenLayoutStore(quant, keys=False)
    for start in range(0, context, 2048):  # as a chunked prefill stores them
        key_store.append(keys[..., start : start + 2048, :])
        value_store.append(values[..., start : start + 2048, :])
    queries = torch.randn(steps, 1, HEADS, 1, WIDTH, generator=generator)
    new_k, new_v = (torch.randn(steps, 1, KV_HEADS, 1, WIDTH, generator=generator) for _ in range(2))
    module = _Attention()

    def token_layout() -> None:
        k_store, v_store = copy.deepcopy(key_store), copy.deepcopy(value_store)
        for i in range(steps):
            token_decode(queries[i], new_k[i], new_v[i], None, k_store, v_store, SCALING)
            k_store.append(new_k[i])
            v_store.append(new_v[i])

    def source() -> None:
        k_cache, v_cache = keys.clone(), values.clone()
        for i in range(steps):
            k_cache, v_cache = torch.cat([k_cache, new_k[i]], dim=-2), torch.cat([v_cache, new_v[i]], dim=-2)
            sdpa_attention_forward(module, queries[i], k_cache, v_cache, None, scaling=SCALING)

    best = {"source": float("inf"), "token layout": float("inf")}
    for _ in range(rounds):
        for name, run in (("source", source), ("token layout", token_layout)):
            started = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - started) / steps)
    return {"context": context, "source_us": best["source"] * 1e6, "token_layout_us": best["token layout"] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--name", default="token-decode")
    args = parser.parse_args()
    if not int4_kernel_available(torch.device("cpu")):
        sys.exit("token_decode_bench: this torch/CPU has no int4 kernel whose layout the stores can write")
    rows = [measure(int(c), args.steps, args.rounds) for c in args.contexts.split(",")]
    table = markdown_table(
        ["context", "source µs/step/layer", "token layout µs/step/layer", "source ÷ token layout"],
        [[r["context"], f"{r['source_us']:.0f}", f"{r['token_layout_us']:.0f}",
          f"{r['source_us'] / r['token_layout_us']:.2f}"] for r in rows],
    )  # fmt: skip
    write_results(args.name, {"machine": machine(), "steps": args.steps, "rounds": args.rounds, "rows": rows}, table)


if __name__ == "__main__":
    main()
