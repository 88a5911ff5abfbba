"""Decode kernels on a GPU (``make bench-kernels``): attention-kernel time against SDPA on the original
shapes, achieved bandwidth against the bytes each kernel must read, and end-to-end decode tokens/s
of converted models against the original at 1K / 8K / 32K context, batch 1 and 16.

Kernel shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128; slim: the MHA
Llama-2-7B shape, 32 × 128); widths are what each method keeps at KV budget ≈ 0.5–0.75. The end-to-end
model is a random-weight MHA Llama (12 layers, hidden 1024, 16 heads) converted by slim, LoRC (0.5,
uniform), razor and minicache, so no download is needed. ``--smoke`` runs tiny sizes on the CPU
through the torch references (checks the script, measures nothing meaningful). Writes
bench/results/kernels-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from kvconvert.runtime import kvconvert_kernels as kernels  # noqa: E402

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # HBM bytes/s (SXM datasheets)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` (CUDA-synchronised)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def kernel_cases(batch: int, n: int, device: str, dtype: torch.dtype, small: bool) -> list[dict[str, Any]]:
    """(name, callable, bytes that must be read) per kernel at one (batch, context)."""
    heads, kv_heads, dk = (4, 2, 16) if small else (32, 8, 128)
    group = heads // kv_heads
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    size = torch.finfo(dtype).bits // 8
    cases: list[dict[str, Any]] = []
    q, k, v = rand(batch, heads, 1, dk), rand(batch, kv_heads, n, dk), rand(batch, kv_heads, n, dk)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases.append({"kernel": "sdpa (original GQA)", "bytes": 2 * batch * kv_heads * n * dk * size,
                  "run": lambda: sdpa(q, k, v, enable_gqa=True)})  # fmt: skip

    # ZACK: per-KV-head widths between 40 % and 90 % of dk (budget ≈ 0.65), packed side by side
    wk_g = [int(dk * (0.4 + 0.5 * i / max(1, kv_heads - 1))) for i in range(kv_heads)]
    wv_g = list(reversed(wk_g))
    wk = [wk_g[h // group] for h in range(heads)]
    wv = [wv_g[h // group] for h in range(heads)]
    zack_cols = kernels.HeadColumns.build([sum(wk_g[: h // group]) for h in range(heads)], wk,
                                          [sum(wv_g[: h // group]) for h in range(heads)], wv, device)  # fmt: skip
    zq, zk, zv = rand(batch, sum(wk)), rand(batch, n, sum(wk_g)), rand(batch, n, sum(wv_g))
    cases.append({"kernel": "zack packed (budget 0.65)", "bytes": batch * n * (sum(wk_g) + sum(wv_g)) * size,
                  "run": lambda: launch(zq, zk, zv, zack_cols, dk**-0.5)})  # fmt: skip

    # LoRC: full RoPE'd keys per KV group, values as one latent of rank e/2 shared by all heads
    rank = kv_heads * dk // 2
    lorc_cols = kernels.HeadColumns.build([(h // group) * dk for h in range(heads)],
                                          [dk] * heads, [0] * heads, [rank] * heads, device)  # fmt: skip
    lq, lk, lv = rand(batch, heads * dk), rand(batch, n, kv_heads * dk), rand(batch, n, rank)
    cases.append({"kernel": "lorc latent V (r_v = e/2)", "bytes": batch * n * (kv_heads * dk + rank) * size,
                  "run": lambda: launch(lq, lk, lv, lorc_cols, dk**-0.5)})  # fmt: skip

    # slim (MHA): scores on RoPE'd keys, weights on whole pre-RoPE key rows; W_KV applied afterwards
    e = heads * dk
    slim_cols = kernels.HeadColumns.build([h * dk for h in range(heads)],
                                          [dk] * heads, [0] * heads, [e] * heads, device)  # fmt: skip
    sq, sk, sv = rand(batch, e), rand(batch, n, e), rand(batch, n, e)
    mq, mk, mv = rand(batch, heads, 1, dk), rand(batch, heads, n, dk), rand(batch, heads, n, dk)
    cases.append({"kernel": "sdpa (original MHA)", "bytes": 2 * batch * heads * n * dk * size,
                  "run": lambda: sdpa(mq, mk, mv)})  # fmt: skip
    cases.append({"kernel": "slim decode (K only)", "bytes": batch * n * e * size,
                  "run": lambda: launch(sq, sk, sv, slim_cols, dk**-0.5)})  # fmt: skip

    # razor: 2 of 8 KV heads retrieval (full), the rest sink 4 + window min(n, max(512, n/5))
    kept = min(n, 4 + max(512, n // 5))
    r_heads, o_heads = max(1, kv_heads // 4), kv_heads - max(1, kv_heads // 4)
    fk, fv = rand(batch, r_heads, n, dk), rand(batch, r_heads, n, dk)
    shk, shv = rand(batch, o_heads, kept, dk), rand(batch, o_heads, kept, dk)
    ck, cv = rand(batch, o_heads, dk), rand(batch, o_heads, dk)
    kind = torch.tensor([0 if h // group < r_heads else 1 for h in range(heads)], device=device)
    slot = torch.tensor([h // group if h // group < r_heads else h // group - r_heads for h in range(heads)],
                        device=device)  # fmt: skip
    rq = rand(batch, heads, dk)
    fb, sb = torch.zeros(batch, n, device=device), torch.zeros(batch, kept, device=device)
    cl = torch.full((batch,), math.log(max(1, n - kept)), device=device)
    razor = kernels.razor_decode_triton if kernels.use_kernels(rq) else kernels.razor_decode_reference
    cases.append({"kernel": "razor head-wise", "bytes": 2 * batch * dk * (r_heads * n + o_heads * kept) * size,
                  "run": lambda: razor(rq, fk, fv, fb, shk, shv, sb, ck, cv, cl, kind, slot, dk**-0.5)})  # fmt: skip
    return cases


def launch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cols: Any, scale: float) -> torch.Tensor:
    impl = kernels.packed_decode_triton if kernels.use_kernels(query) else kernels.packed_decode_reference
    return impl(query, keys, values, None, cols, scale)


def end_to_end(contexts: list[int], batches: list[int], device: str, small: bool, new_tokens: int) -> list[dict]:
    """Decode tokens/s of a random MHA Llama and its conversions; prompts prefilled in 512-token chunks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvconvert
    from kvconvert.io.source import open_source
    from kvconvert.methods import (
        LorcConfig,
        LorcMethod,
        MiniCacheConfig,
        MiniCacheMethod,
        RazorConfig,
        RazorMethod,
        SlimConfig,
        SlimMethod,
    )
    from kvconvert.pipeline import convert

    size = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4) if small else dict(
        hidden_size=1024, num_hidden_layers=12, num_attention_heads=16)  # fmt: skip
    context = max(512, max(contexts) + new_tokens + 8)  # razor profiles 4 × 64 tokens
    config = LlamaConfig(vocab_size=32000, intermediate_size=4 * size["hidden_size"], max_position_embeddings=context,
                         num_key_value_heads=None, **size)  # fmt: skip
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        src = Path(tmp) / "src"
        LlamaForCausalLM(config).save_pretrained(src)
        methods = {"slim": SlimMethod(SlimConfig()),
                   "lorc 0.5": LorcMethod(LorcConfig(kv_budget=0.5, schedule="uniform")),
                   "razor": RazorMethod(RazorConfig(profile_tokens=64), progress=False),
                   "minicache": MiniCacheMethod(MiniCacheConfig(), progress=False)}  # fmt: skip
        paths = {"original": src}
        for name, method in methods.items():
            paths[name] = Path(tmp) / name.replace(" ", "-")
            convert(open_source(str(src)), method, paths[name], progress=False)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        for name, path in paths.items():
            model = LlamaForCausalLM.from_pretrained(path) if name == "original" else kvconvert.load(path)
            model = model.to(device=device, dtype=dtype).eval()
            for context in contexts:
                for batch in batches:
                    ids = torch.randint(3, 32000, (batch, context + new_tokens), device=device)
                    rows.append({"model": name, "context": context, "batch": batch,
                                 **decode_rate(model, ids, context, new_tokens)})  # fmt: skip
                    print(rows[-1], flush=True)
            del model
    return rows


@torch.no_grad()
def decode_rate(model: Any, ids: torch.Tensor, context: int, new_tokens: int) -> dict[str, float]:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    cache = None
    for start in range(0, context, 512):
        cache = model(ids[:, start : min(context, start + 512)], past_key_values=cache, use_cache=True).past_key_values
    sync()
    began = time.perf_counter()
    for step in range(new_tokens):
        cache = model(
            ids[:, context + step : context + step + 1], past_key_values=cache, use_cache=True
        ).past_key_values
    sync()
    seconds = time.perf_counter() - began
    return {"decode_tokens_per_s": ids.shape[0] * new_tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (checks the script only)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("bench-kernels needs a CUDA GPU (use --smoke to check the script on CPU)")
    contexts, batches = ([64, 128], [1, 2]) if args.smoke else ([1024, 8192, 32768], [1, 16])
    dtype = torch.float32 if args.smoke else torch.bfloat16
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in gpu), None)
    kernel_rows = []
    for n in contexts:
        for batch in batches:
            for case in kernel_cases(batch, n, device, dtype, small=args.smoke):
                seconds = timed(case["run"], repeats=3 if args.smoke else 50)
                bandwidth = case["bytes"] / seconds
                kernel_rows.append({"kernel": case["kernel"], "context": n, "batch": batch, "us": seconds * 1e6,
                                    "bytes": case["bytes"], "gb_per_s": bandwidth / 1e9,
                                    "roofline": None if peak is None else bandwidth / peak})  # fmt: skip
                print(kernel_rows[-1], flush=True)
    e2e = end_to_end(contexts, batches, device, args.smoke, new_tokens=4 if args.smoke else 32)
    payload = {"benchmark": "kernels", "device": gpu, "dtype": str(dtype), "kernels": kernel_rows,
               "end_to_end": e2e, "machine": machine(), "seconds": time.perf_counter() - started}  # fmt: skip
    table = markdown_table(
        ["kernel", "context", "batch", "µs", "MB read", "GB/s", "of peak"],
        [[r["kernel"], r["context"], r["batch"], f"{r['us']:.1f}", f"{r['bytes'] / 1e6:.1f}", f"{r['gb_per_s']:.0f}",
          "-" if r["roofline"] is None else f"{r['roofline']:.0%}"] for r in kernel_rows],
    ) + "\n\n" + markdown_table(
        ["model", "context", "batch", "decode tok/s"],
        [[r["model"], r["context"], r["batch"], f"{r['decode_tokens_per_s']:.1f}"] for r in e2e],
    )  # fmt: skip
    if args.smoke:
        print(table)
        return
    write_results("kernels", payload, f"Decode kernels on {gpu} ({dtype}).\n\n" + table)


if __name__ == "__main__":
    main()
