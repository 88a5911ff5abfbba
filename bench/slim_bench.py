"""Slim attention benchmark: conversion cost and decode speed/memory on a >= 300 MB MHA model
(``--method lorc``: LoRC's conversion, budget 0.5, uniform ranks, on the same model).

Random weights are fine for timing (slim's cost does not depend on their values). Run with
``make bench-slim`` or ``python bench/slim_bench.py``; writes bench/results/slim-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from kvconvert.eval.memory import cache_nbytes  # noqa: E402


def build_source(path: Path, layers: int, max_positions: int = 8192) -> int:
    """Save a random MHA Llama (hidden 1024, 16 heads, vocab 16k) and return its size in bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=16000, max_position_embeddings=max_positions, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


# Runs a module as __main__ in a fresh interpreter and prints that process's own peak RSS last.
# VmHWM belongs to the address space exec() created; ru_maxrss would not do: Linux carries the
# parent's high-water mark across fork + exec, so every child would report at least this process's.
_PEAK_RSS_WRAPPER = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as exit_:
    if exit_.code not in (None, 0):
        raise
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(int(hwm.split()[1]), file=sys.stderr)
"""


def peak_rss_of(module: str, *args: str) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``python -m module args`` (VmHWM is in KiB)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS_WRAPPER, module, *args], check=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    return time.perf_counter() - start, int(done.stderr.strip().splitlines()[-1]) * 1024


@torch.no_grad()
def decode_speed(model, context: int, new_tokens: int) -> dict[str, float]:
    """Prefill ``context`` random tokens, then greedy-decode ``new_tokens`` one at a time."""
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    out = model(ids, use_cache=True)
    prefill = time.perf_counter() - start
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    bytes_at_context = cache_nbytes(cache)
    start = time.perf_counter()
    for _ in range(new_tokens):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    decode = time.perf_counter() - start
    return {
        "prefill_tokens_per_s": context / prefill,
        "decode_tokens_per_s": new_tokens / decode,
        "kv_bytes_per_token": (cache_nbytes(cache) - bytes_at_context) / new_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="*",
        default=[512, 2048, 4096],
        help="decode contexts; none (a bare --contexts) times the conversion only",
    )
    parser.add_argument("--repeats", type=int, default=2, help="conversions timed (best kept)")
    parser.add_argument("--name", default=None, help="results file stem (default: the method)")
    parser.add_argument(
        "--method",
        choices=["slim", "lorc"],
        default="slim",
        help="lorc: --kv-budget 0.5 --schedule uniform (its conversion speed, issue #18)",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "converted"
        command = ["slim"] if args.method == "slim" else ["lorc", "--kv-budget", "0.5", "--schedule", "uniform"]
        size = build_source(src, args.layers)
        # Floor: imports, config and shard index — everything a conversion does except converting.
        # Best of --repeats for both (the page cache's writeback makes single runs noisy).
        floor_wall, floor_rss = min(peak_rss_of("bench._import_floor", str(src)) for _ in range(args.repeats))
        runs = []
        for _ in range(args.repeats):
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()  # the last run's output is flushed before this one starts, not while it runs
            runs.append(peak_rss_of("kvconvert.cli", *command, "--model", str(src), "--out", str(dst), "--quiet"))
        wall, rss = min(runs)
        converting = []  # the conversion alone, timed in its process after imports and opening the source
        for _ in range(args.repeats):
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()
            timed = [sys.executable, "-m", "bench._timed_conversion", str(src), str(dst), args.method]
            done = subprocess.run(timed, check=True, capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parents[1])  # fmt: skip
            converting.append(float(done.stdout.strip().splitlines()[-1]))
        convert_seconds = min(converting)
        params = dict(LlamaForCausalLM.from_pretrained(src).named_parameters())
        largest_tensor = max(p.numel() * p.element_size() for p in params.values())
        layer_bytes = sum(p.numel() * p.element_size() for n, p in params.items() if ".layers.0." in n)
        del params

        original = LlamaForCausalLM.from_pretrained(src).eval()
        converted = AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True).eval()
        speed = []
        for context in args.contexts:
            for name, model in (("original", original), (args.method, converted)):
                row = {"model": name, "context": context, **decode_speed(model, context, args.new_tokens)}
                print(row, flush=True)
                speed.append(row)

    conversion = {
        "model_bytes": size,
        "layers": args.layers,
        "wall_seconds": wall,
        "import_floor_seconds": floor_wall,
        "convert_seconds": convert_seconds,
        "conversion_mb_per_s": size / 1e6 / convert_seconds,
        "wall_mb_per_s": size / 1e6 / wall,
        "peak_rss_bytes": rss,
        "import_floor_rss_bytes": floor_rss,
        "largest_tensor_bytes": largest_tensor,
        "layer_bytes": layer_bytes,
    }
    payload = {"benchmark": args.method, "machine": machine(), "conversion": conversion, "decode": speed}
    mb = 1024**2
    conv_table = markdown_table(
        ["model size", f"`kvconvert {' '.join(command)}` wall", "start-up (imports, config, index)", "conversion alone",
         "MB/s (conversion)", "MB/s (whole command)", "peak RSS", "RSS without converting", "one layer",
         "largest tensor"],
        [[f"{size / mb:.0f} MiB", f"{wall:.2f} s", f"{floor_wall:.2f} s", f"{convert_seconds:.2f} s",
          f"{conversion['conversion_mb_per_s']:.0f}",
          f"{conversion['wall_mb_per_s']:.0f}", f"{rss / mb:.0f} MiB", f"{floor_rss / mb:.0f} MiB",
          f"{layer_bytes / mb:.0f} MiB", f"{largest_tensor / mb:.0f} MiB"]],
    )  # fmt: skip
    rows = []
    for context in args.contexts:
        o, s = (next(r for r in speed if r["model"] == m and r["context"] == context)
                for m in ("original", args.method))  # fmt: skip
        rows.append([
            context, f"{o['decode_tokens_per_s']:.1f}", f"{s['decode_tokens_per_s']:.1f}",
            f"{o['prefill_tokens_per_s']:.0f}", f"{s['prefill_tokens_per_s']:.0f}",
            f"{o['kv_bytes_per_token']:.0f}", f"{s['kv_bytes_per_token']:.0f}",
            f"{s['kv_bytes_per_token'] / o['kv_bytes_per_token']:.3f}",
        ])  # fmt: skip
    speed_table = markdown_table(
        ["context", "decode tok/s orig", f"decode tok/s {args.method}", "prefill tok/s orig",
         f"prefill tok/s {args.method}", "KV B/token orig", f"KV B/token {args.method}", "KV ratio"],
        rows,
    )  # fmt: skip
    table = f"{conv_table}\n\n{speed_table if rows else ''}\n\nMachine: {payload['machine']}"
    write_results(args.name or args.method, payload, table)


if __name__ == "__main__":
    main()
