"""Launch shapes of the codes-reading decode kernels on a GPU (``make bench-kernel-sweep``): the fp8 kernel and the
4-bit KIVI kernel over tiles, warps, pipeline stages and programs per multiprocessor, on Llama-3-8B's attention (32
query heads, 8 KV heads, head_dim 128, bfloat16) at each (batch, context), beside SDPA on the uncompressed cache and
beside what the runtime does without the kernel (fp8: read the cache back whole as bfloat16, then SDPA). Each launch
is checked against its float32 reference before it is timed; the fastest per shape is written as the launch file
``bench/kernels_bench.py --launch`` reads (``best-launch.json``). Writes bench/results/kernel-sweep-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.kernels_bench import PEAK_BANDWIDTH, relative_error, sdpa_backends, timed  # noqa: E402
from kvconvert.runtime import kvconvert_fp8_kernel as fp8  # noqa: E402
from kvconvert.runtime import kvconvert_kivi_kernel as kivi  # noqa: E402
from kvconvert.runtime import kvconvert_token_kernel as token_kernel  # noqa: E402
from kvconvert.runtime.kvconvert_codec import QuantSpec, fp8_read, quantize_tokens, rotation  # noqa: E402
from kvconvert.runtime.kvconvert_kernels import split_count  # noqa: E402
from kvconvert.runtime.kvconvert_tokenlayout import KERNEL_ROWS, TokenLayoutStore  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
LAUNCH_KEYS = ("tile", "split", "magic", "warps", "stages", "programs_per_sm", "splits")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sweep_shape(
    batch: int, n: int, device: torch.device, dtype: torch.dtype, quick: bool, kernels: set[str]
) -> list[dict[str, Any]]:  # fmt: skip
    g = torch.Generator().manual_seed(0)
    group = HEADS // KV_HEADS
    q = torch.randn(batch, KV_HEADS, group, DIM, generator=g).to(device, dtype)
    k, v = (torch.randn(batch, KV_HEADS, n, DIM, generator=g).to(device, dtype) for _ in range(2))
    rows: list[dict[str, Any]] = []

    def record(kernel: str, config: dict[str, Any], size: int, run: Any, ref: torch.Tensor) -> None:
        try:
            error = relative_error(run().float(), ref)
            seconds = timed(run, repeats=3)
        except Exception as failure:  # noqa: BLE001 - a launch shape that does not compile is a result
            rows.append({"kernel": kernel, "batch": batch, "context": n, **config, "error": str(failure)[:300]})
            print(rows[-1], flush=True)
            return
        rows.append({"kernel": kernel, "batch": batch, "context": n, **config, "us": seconds * 1e6, "bytes": size,
                     "gb_per_s": size / seconds / 1e9, "relative_error": error})  # fmt: skip
        if device.type == "cuda":  # the same call captured as one CUDA graph: no launch gaps (what a served step sees)
            try:
                from triton.testing import do_bench_cudagraph

                graph = float(do_bench_cudagraph(run, rep=50, return_mode="median")) / 1e3
                rows[-1].update(graph_us=graph * 1e6, graph_gb_per_s=size / graph / 1e9)
            except Exception as failure:  # noqa: BLE001 - a call that cannot be captured is a result too
                rows[-1]["graph_error"] = str(failure)[:300]
        print(rows[-1], flush=True)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    q4 = q.reshape(batch, HEADS, 1, DIM)
    with sdpa_backends():
        ref_sdpa = sdpa(q4.float(), k.float(), v.float(), enable_gqa=True)
        record("sdpa (16-bit cache)", {}, nbytes(k, v), lambda: sdpa(q4, k, v, enable_gqa=True), ref_sdpa)

    # fp8, scales per KV head
    ks, vs = k.float().abs().amax((0, 2, 3)) / 448, v.float().abs().amax((0, 2, 3)) / 448
    kc = (k.float() / ks[None, :, None, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    vc = (v.float() / vs[None, :, None, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    ref = fp8.fp8_decode_reference(q, kc, vc, ks, vs, None, DIM**-0.5)

    def read_back() -> torch.Tensor:  # the runtime's path without the kernel
        kk = fp8_read(kc.view(torch.float8_e4m3fn), ks, dtype)
        vv = fp8_read(vc.view(torch.float8_e4m3fn), vs, dtype)
        return sdpa(q4, kk, vv, enable_gqa=True)

    with sdpa_backends():
        record("fp8 read back + sdpa", {}, nbytes(kc, vc), read_back, ref.reshape(batch, HEADS, 1, DIM))
    tiles, warps, stages, per_sm = ([64], [4], [3], [4]) if quick else ([32, 64, 128], [4, 8], [2, 3, 4], [2, 4, 8, 16])
    if "fp8" not in kernels:  # its launch as the runtime takes it, for the record
        tiles, warps, stages, per_sm = [fp8.FP8_TILE], [fp8.FP8_WARPS], [fp8.FP8_STAGES], [fp8.FP8_PROGRAMS_PER_SM]
    for tile, warp, stage, pps in itertools.product(tiles, warps, stages, per_sm):
        split = split_count(batch * KV_HEADS, n // (4 * tile), device, pps)
        config = {"tile": tile, "warps": warp, "stages": stage, "programs_per_sm": pps, "splits": split}
        record("fp8 kernel", config, nbytes(kc, vc),
               lambda t=tile, w=warp, s=stage, sp=split: fp8.fp8_decode_triton(
                   q, kc, vc, ks, vs, None, DIM**-0.5, splits=sp, tile=t, num_warps=w, num_stages=s), ref)  # fmt: skip

    # 4-bit KIVI, blocks of 64 tokens, value groups of 64 channels
    kq, vq = quantize_tokens(k.float(), 4, 64, True), quantize_tokens(v.float(), 4, 64, False)
    store = (kq.codes, kq.scale, kq.zero, vq.codes, vq.scale, vq.zero)
    acc, ml = kivi.kivi_decode_reference(q.float(), *store, None, DIM**-0.5)
    ref = acc / ml[..., 1:]
    # tile 0: the per-block kernel; else the tile kernel, that many tokens an iteration, its nibbles rejoined into
    # one operand each or kept apart ("split"), its codes converted or widened by a bit trick ("magic")
    tiles = [128] if quick else [64, 128, 256]
    forms = [(0, False, False), *itertools.product(tiles, [False, True], [False, True])]
    warps, stages, per_sm = ([4], [2], [0]) if quick else ([4, 8], [2, 3], [8, 16])
    if "kivi" not in kernels:
        forms = [(kivi.KIVI_TILE, kivi.KIVI_SPLIT, kivi.KIVI_MAGIC)]
        warps, stages, per_sm = [kivi.KIVI_WARPS], [kivi.KIVI_STAGES], [kivi.KIVI_PROGRAMS_PER_SM]
    for (tile, apart, magic), warp, stage, pps in itertools.product(forms, warps, stages, per_sm):
        most = n // (4 * max(tile, 64))  # (blocks of 64 tokens)
        split = split_count(batch * KV_HEADS, most, device, pps) if pps else None  # 0: its rule
        config = {"tile": tile, "split": apart, "magic": magic, "warps": warp, "stages": stage,
                  "programs_per_sm": pps, "splits": split}  # fmt: skip

        def run(t: int = tile, f: bool = apart, g: bool = magic, w: int = warp, s: int = stage,
                sp: int | None = split) -> torch.Tensor:  # fmt: skip
            a, m = kivi.kivi_decode_triton(q, *store, None, DIM**-0.5, splits=sp, num_warps=w, num_stages=s, tile=t,
                                           split_tiles=f, magic=g)  # fmt: skip
            return a / m[..., 1:]

        record("quant 4-bit KIVI kernel", config, nbytes(*store), run, ref)
    if "token" in kernels:
        token_sweep(q, k, v, quick, record)
    return rows


def token_sweep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quick: bool, record: Any) -> None:
    """The 4-bit token layout (key blocks of 64 tokens, channel groups of 64, packed as the GPU kernel reads) through
    ``token_decode_triton``: tokens an iteration, warps, stages, programs per multiprocessor. Each launch's output
    (still rotated, as the kernel leaves it) is checked against SDPA over what the stores read back."""
    quant = QuantSpec(bits=4, group=64, residual=0)
    keys, values = TokenLayoutStore(quant, keys=True), TokenLayoutStore(quant, keys=False)
    keys.rows = values.rows = KERNEL_ROWS
    keys.append(k)
    values.append(v)
    kb, vb = keys.blocks, values.blocks
    assert kb is not None and kb.center is not None and vb is not None
    batch = q.shape[0]
    size = keys.group_size()
    rot = rotation(size, q.device)
    with sdpa_backends():
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(batch, HEADS, 1, DIM).float(), keys.read().float(), values.read().float(), enable_gqa=True
        ).reshape(q.shape)  # fmt: skip
    ref = (ref.unflatten(-1, (-1, size)) @ rot).flatten(-2)  # rotated, as the kernel's sums
    scaled = q.float() * DIM**-0.5
    q_rot = (scaled.unflatten(-1, (-1, size)) @ rot).flatten(-2).to(q.dtype)
    offsets = torch.einsum("bhgd,bhcd->bhgc", scaled, kb.center.float())
    layouts = {**token_kernel._key_layout(keys), **token_kernel._value_layout(values, DIM, q.device)[0]}
    store = (kb.codes, kb.scale, vb.codes, vb.scale, vb.zero)
    size_bytes = nbytes(*store, kb.center)
    tiles, warps, stages, per_sm = ([64, 128, 256], [4, 8], [2, 3], [4, 8, 16])
    if quick:  # the runtime's launch
        t = token_kernel
        tiles, warps, stages, per_sm = [t.TOKEN_TILE], [t.TOKEN_WARPS], [t.TOKEN_STAGES], [t.TOKEN_PROGRAMS_PER_SM]
    n = k.shape[-2]
    for tile, warp, stage, pps in itertools.product(tiles, warps, stages, per_sm):
        split = split_count(batch * KV_HEADS, n // (4 * tile), q.device, pps)
        config = {"tile": tile, "warps": warp, "stages": stage, "programs_per_sm": pps, "splits": split}

        def run(t: int = tile, w: int = warp, s: int = stage, sp: int = split) -> torch.Tensor:
            a, m = token_kernel.token_decode_triton(q_rot, offsets, *store, None, splits=sp, tile=t, num_warps=w,
                                                    num_stages=s, **layouts)  # fmt: skip
            return a / m[..., 1:]

        record("quant 4-bit token kernel", config, size_bytes, run, ref)


def best(rows: list[dict[str, Any]], kernel: str) -> dict[str, Any] | None:
    timed_rows = [r for r in rows if r["kernel"] == kernel and "us" in r and r["relative_error"] < 2e-2]
    return min(timed_rows, key=lambda r: r["us"]) if timed_rows else None


def sdpa_us(rows: list[dict[str, Any]], batch: int, n: int) -> float:
    """SDPA's time on the 16-bit cache at (batch, n): the yardstick."""
    return next(r["us"] for r in rows if r["kernel"].startswith("sdpa") and (r["batch"], r["context"]) == (batch, n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="16:8192,1:32768", help="BATCH:CONTEXT pairs")
    parser.add_argument("--quick", action="store_true", help="one launch shape per kernel (checks the script)")
    parser.add_argument("--copy-to", default=None, help="also write the results (and best-launch.json) here")
    parser.add_argument(
        "--kernels",
        default="fp8,kivi",
        help="the kernels whose launches are swept (the others run their current launch once)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(int(b), int(c)) for b, c in (pair.split(":") for pair in args.shapes.split(","))]
    swept = set(args.kernels.split(","))
    rows = [row for batch, n in shapes for row in sweep_shape(batch, n, device, dtype, args.quick, swept)]
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in gpu), None)
    # the launch the runtime should take: the fastest summed over the shapes (each shape's time as a share of SDPA's)
    launch: dict[str, Any] = {}
    kivi_keys = ("tile", "split", "magic", "warps", "stages", "programs_per_sm")
    for kernel, keys in (("fp8 kernel", ("tile", "warps", "stages", "programs_per_sm")),
                         ("quant 4-bit KIVI kernel", kivi_keys),
                         ("quant 4-bit token kernel", ("tile", "warps", "stages", "programs_per_sm"))):  # fmt: skip
        totals: dict[tuple, float] = {}
        for batch, n in shapes:
            base = sdpa_us(rows, batch, n)
            for r in rows:
                if r["kernel"] == kernel and "us" in r and (r["batch"], r["context"]) == (batch, n):
                    key = tuple(r[k] for k in keys)
                    totals[key] = totals.get(key, 0.0) + (r["us"] / base if r["relative_error"] < 2e-2 else 1e9)
        if totals:
            launch[kernel] = dict(zip(keys, min(totals, key=totals.__getitem__), strict=True))
    table = markdown_table(
        ["kernel", "batch", "context", "launch", "µs", "GB/s", "of peak", "graph µs", "graph of peak", "‖err‖/‖ref‖"],
        [[r["kernel"], r["batch"], r["context"],
          ", ".join(f"{k}={r[k]}" for k in LAUNCH_KEYS if k in r),
          f"{r['us']:.1f}" if "us" in r else "-", f"{r['gb_per_s']:.0f}" if "us" in r else "-",
          f"{r['gb_per_s'] * 1e9 / peak:.0%}" if "us" in r and peak else "-",
          f"{r['graph_us']:.1f}" if "graph_us" in r else "-",
          f"{r['graph_gb_per_s'] * 1e9 / peak:.0%}" if "graph_us" in r and peak else "-",
          f"{r['relative_error']:.1e}" if "us" in r else r.get("error", "")[:80]] for r in rows],
    )  # fmt: skip
    kernels = ("sdpa (16-bit cache)", "fp8 read back + sdpa", "fp8 kernel", "quant 4-bit KIVI kernel",
               "quant 4-bit token kernel")  # fmt: skip
    fastest = [best([r for r in rows if (r["batch"], r["context"]) == s], k) for s in shapes for k in kernels]
    summary = markdown_table(
        ["kernel", "batch", "context", "µs", "× SDPA's time", "of peak"],
        [[r["kernel"], r["batch"], r["context"], f"{r['us']:.1f}",
          f"{r['us'] / sdpa_us(rows, r['batch'], r['context']):.2f}",
          f"{r['gb_per_s'] * 1e9 / peak:.0%}" if peak else "-"] for r in fastest if r is not None],
    )  # fmt: skip
    text = (
        f"Decode-kernel launch shapes on {gpu} ({dtype}); Llama-3-8B attention.\n\n"
        f"Fastest per kernel and shape:\n\n{summary}\n\nLaunch chosen (summed over the shapes): "
        f"`{json.dumps(launch)}`\n\nEvery launch:\n\n{table}"
    )
    payload = {"benchmark": "kernel-sweep", "device": gpu, "dtype": str(dtype), "rows": rows, "launch": launch,
               "machine": machine()}  # fmt: skip
    print(summary)
    print(json.dumps(launch))
    if device.type != "cuda":
        return
    paths = write_results("kernel-sweep", payload, text)
    if args.copy_to:
        (Path(args.copy_to) / "best-launch.json").write_text(json.dumps(launch))
        for path in paths:
            shutil.copy(path, Path(args.copy_to) / path.name)


if __name__ == "__main__":
    main()
