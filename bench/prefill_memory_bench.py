"""Peak memory and time of a prompt that goes into the cache in one forward (what ``generate`` does with a prompt),
or ``--chunk`` tokens a forward (``eval --chunk``, engines' chunked prefill), converted checkpoints beside their
source, each in a fresh process.

    python bench/prefill_memory_bench.py DIR [DIR ...] [--tokens 8192] [--chunk 0] [--runtime CHECKOUT] [--name N]

Peak: the process's peak resident memory during the prefill over what it held once the model was loaded and warm
(``kvconvert.eval.memory.PeakMemory``); glibc is told to return every freed block of 64 KB or more
(``MALLOC_MMAP_THRESHOLD_``), so that the peak follows the live tensors instead of the heap's high-water mark. Held:
the bytes of the cache's tensors after it (``cache_nbytes``). ``--runtime``: another checkout of kvconvert whose
runtime loads the converted directories (the runtime before a change, side by side with this one's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402


def child(model_dir: str, tokens: int, chunk: int) -> dict[str, Any]:
    """One model's prefill (``chunk`` tokens a forward, 0: one forward), in this process (freshly started by
    ``main``): its peak above the warm model (``PeakMemory``) and the bytes its cache holds (``cache_nbytes``)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.environ["BENCH_RUNTIME"])  # the checkout whose runtime loads the models
    import kvconvert
    from kvconvert.eval.memory import PeakMemory, cache_nbytes
    from kvconvert.eval.quality import prefill

    converted = (Path(model_dir) / "kvconvert.json").exists()
    model = (kvconvert.load(model_dir) if converted else AutoModelForCausalLM.from_pretrained(model_dir)).eval()
    ids = torch.randint(3, model.config.vocab_size - 1, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids[:, :64], use_cache=True, logits_to_keep=1)  # every weight read, lazy kernels, first-call allocations
        with PeakMemory("cpu") as peak:
            began = time.perf_counter()
            cache, _ = prefill(model, ids, chunk or None)
            seconds = time.perf_counter() - began
    assert peak.bytes is not None, "the peak needs Linux's /proc/self/clear_refs"
    return {"peak_mib": round(peak.bytes / 2**20, 1), "held_mib": round(cache_nbytes(cache) / 2**20, 1),
            "seconds": round(seconds, 2), "runtime": kvconvert.__file__}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="converted checkpoint directories (of SmolLM2-135M by default)")
    parser.add_argument("--source", default=None, help="their source (default: SmolLM2-135M fp32)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=0, help="tokens a forward (0: the whole prompt in one)")
    parser.add_argument("--runtime", default=None, help="a kvconvert checkout whose runtime loads the models too")
    parser.add_argument("--name", default="prefill-memory")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.tokens, args.chunk)))
        return
    if args.source is None:
        from bench.models import prepare_models

        args.source = str(prepare_models()["smollm2-135m"])
    here = str(Path(__file__).resolve().parents[1])
    runtimes = {"this checkout": here, **({args.runtime: str(Path(args.runtime).resolve())} if args.runtime else {})}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # every freed block of 64 KB or more goes back
    rows, results, started = [], [], time.perf_counter()
    for model in [args.source, *args.models]:
        for label, root in runtimes.items() if model != args.source else [("", here)]:
            command = [
                sys.executable,
                __file__,
                "--child",
                model,
                "--tokens",
                str(args.tokens),
                "--chunk",
                str(args.chunk),
            ]
            child_env = {**env, "BENCH_RUNTIME": root}
            done = subprocess.run(command, env=child_env, capture_output=True, text=True, check=True)
            result = {"model": model, "runtime": label, **json.loads(done.stdout.strip().splitlines()[-1])}
            results.append(result)
            rows.append([Path(model).name, label, result["peak_mib"], result["held_mib"], result["seconds"]])
            print(rows[-1], flush=True)
    how = f"{args.chunk} a forward" if args.chunk else "in one forward"
    headers = ["model", "runtime", f"peak over the loaded model, MiB ({args.tokens} tokens {how})",
               "cache held, MiB", "seconds"]  # fmt: skip
    payload = {"machine": machine(), "source": args.source, "tokens": args.tokens, "chunk": args.chunk,
               "results": results, "seconds": time.perf_counter() - started, "command": " ".join(sys.argv)}  # fmt: skip
    write_results(args.name, payload, markdown_table(headers, rows))


if __name__ == "__main__":
    main()
