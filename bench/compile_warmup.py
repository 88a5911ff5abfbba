"""What the CPU readers' ``torch.compile`` costs a user: the first ``generate`` calls of a fresh process, one
checkpoint, each ``KVCONVERT_COMPILE`` setting (``on`` with a cold Inductor cache and again warm, ``auto``, ``off``).

Every setting runs in a process of its own (dynamo's and Inductor's in-memory caches die with it): 1 row of 1K
tokens, 16 new tokens, twice; then 8 left-padded rows the same (a batch of one is a graph of its own). Wall seconds
of each call, so the build shows as the first call's excess over ``off``.

    python bench/compile_warmup.py [--recipe LABEL] [--context 1024] [--new 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402

SOURCE = Path(__file__).parent / ".cache" / "smollm2-135m-fp32"
CALLS = ((1, "1 row, first"), (1, "1 row, again"), (8, "8 rows, first"), (8, "8 rows, again"))


def _child(checkpoint: str, context: int, new: int) -> None:
    """The calls of ``CALLS`` in this process; their wall seconds as one JSON line."""
    import torch

    import kvconvert
    from kvconvert.eval.speed import ragged_batch

    model = kvconvert.load(checkpoint).eval()
    seconds = []
    for rows, _ in CALLS:  # 8 rows: left-padded to different lengths, as a server's batch
        batch, mask = ragged_batch(model.config.vocab_size, context, rows)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)  # fmt: skip
        seconds.append(time.perf_counter() - start)
    print(json.dumps(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="quant 3-bit KIVI layout, sink 4 (ext.)", help="a bench/speed_bench label")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child, args.context, args.new)

    from bench.models import prepare_models
    from bench.speed_bench import CANDIDATES, _converted

    prepare_models()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model"
        _converted(SOURCE, dict(CANDIDATES)[args.recipe], args.recipe, checkpoint)
        runs: list[dict[str, Any]] = []
        inductor = Path(tmp) / "inductor"  # a fresh Inductor cache: what a new machine (or a CI job) starts with
        for setting, cache in (("off", "cold"), ("on", "cold"), ("on", "warm"), ("auto", "warm")):
            env = {**os.environ, "KVCONVERT_COMPILE": setting, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
            command = [sys.executable, __file__, "--child", str(checkpoint), "--context", str(args.context),
                       "--new", str(args.new)]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            seconds = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append({"setting": setting, "inductor_cache": cache, "seconds": seconds})
            print(setting, cache, [f"{s:.1f}" for s in seconds], flush=True)
    rows = [[f"`{r['setting']}`", r["inductor_cache"], *(f"{s:.1f} s" for s in r["seconds"])] for r in runs]
    table = markdown_table(["KVCONVERT_COMPILE", "Inductor cache", *(name for _, name in CALLS)], rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = (f"# First generate calls of a process: {args.recipe}, SmolLM2-135M fp32, {args.context} tokens + "
              f"{args.new} new, greedy\n\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()} "
              f"× {os.cpu_count()}, commit {commit} (and its working tree). "
              f"`python bench/compile_warmup.py --recipe {args.recipe!r}`; wall seconds of "
              "each `generate` call, each setting in a fresh process, in this order (`on` cold is the first build "
              "on this machine, `on` warm finds Inductor's compiled code on disk).\n\n")  # fmt: skip
    payload = {"machine": machine(), "recipe": args.recipe, "context": args.context, "new_tokens": args.new,
               "runs": runs, "seconds": time.time() - started}  # fmt: skip
    write_results("compile-warmup", payload, header + table)


if __name__ == "__main__":
    main()
