"""kvconvert's engine exports inside vLLM's CPU build (``make bench-vllm``).

For SmolLM2-135M (float32) and its fp8 exports (``quant --kv-format fp8``, scales per tensor and per KV
head), each loaded by vLLM as it is (``bench/vllm_engine.py``, in its own virtualenv): (a) what vLLM
built: the cache dtype, its capacity in tokens, and every layer's k/v scale as loaded, checked against the
export's; (b) perplexity on the context protocol (wikitext-2 test, windows of CONTEXT + SCORED tokens, the
last SCORED scored) from vLLM's prompt logprobs, beside kvconvert's own runtime on the same token windows;
(c) greedy generations, vLLM against kvconvert's runtime (tokens until the first difference); (d) decode
throughput at batch 1 and 16 and vLLM's KV capacity, export against source. A fifth row is the source with
vLLM's runtime flag ``--kv-cache-dtype fp8`` alone (no scales: 1.0), what serving fp8 costs without
calibration. Then the MLA export (``lorc --latent mla``, DeepSeek-V3 layout): as written (vLLM's CPU MLA
kernel takes only ``kv_lora_rank + qk_rope_head_dim = 576``, so it is refused there: the row records how), and
written at vLLM's sizes (``--mla-sizes vllm``: the latent zero-padded to 512 and the RoPE key to 64, the same
model), which vLLM runs, against kvconvert's own evaluation of that checkpoint and of the budget-sized one; the
same export refined (``--refine-steps``, ``--mla-refine-steps``), and refined with a 48-wide RoPE key (the best
width measured at 0.5, docs/lorc.md) padded to 64, both at vLLM's sizes. ``--only REGEX`` runs (and converts) the
rows it matches (and the source). Writes bench/results/vllm-cpu-<date>.{json,md} (``--name``).

    python bench/vllm_bench.py --engine-python bench/.cache/venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import CACHE, SHARED, prepare_models  # noqa: E402

ENGINE = Path(__file__).with_name("vllm_engine.py")
CONTEXT, SCORED = 1536, 512  # the context protocol every quality figure of kvconvert uses


def token_windows(tokenizer_dir: Path, windows: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(scored windows of CONTEXT + SCORED tokens, greedy prompts, the throughput prompt) from wikitext-2."""
    from transformers import AutoTokenizer

    text = (SHARED / "data" / "wikitext2" / "wikitext2_raw_test.txt").read_text()
    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(text[: 12_000 * (windows + 2)])["input_ids"]
    length = CONTEXT + SCORED
    if len(ids) < (windows + 1) * length:
        raise SystemExit(f"wikitext-2 gave {len(ids)} tokens, fewer than {windows + 1} windows of {length}")
    scored = [ids[i * length : (i + 1) * length] for i in range(windows)]
    rest = ids[windows * length :]
    prompts = [rest[i * 200 : i * 200 + 64 + 16 * i] for i in range(4)]
    return scored, prompts, rest[1000:1512]


def truncating_fp8_store(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU build writes fp8 KV by dropping mantissa bits (``float_to_fp8e4m3_scalar`` in its
    ``csrc/cpu/cpu_attn_fp8.hpp``: round toward zero) where CUDA, compressed-tensors and kvconvert round to
    nearest. This is that rounding, for a kvconvert row that shows how much of vLLM's gap it explains."""
    scaled = (x.float() / scale.float().view(1, -1, 1, 1)).clamp(-448.0, 448.0).contiguous()
    kept = scaled.view(torch.int32) & ~((1 << 20) - 1)  # float32's 23 mantissa bits -> e4m3's 3
    return kept.view(torch.float32).to(torch.float8_e4m3fn)


@torch.no_grad()
def kvconvert_side(
    model_dir: Path,
    scored: list[list[int]],
    prompts: list[list[int]],
    new_tokens: int,
    dtype: torch.dtype | None = None,
) -> dict:
    """The same measurements through kvconvert's runtime (the source: stock transformers): ``kvconvert eval``'s
    context protocol over the same windows (they are consecutive, so its windowing finds them again)."""
    from kvconvert.eval.quality import evaluate_quality
    from kvconvert.eval.runner import load_model

    model = load_model(str(model_dir), dtype=dtype)
    quality = evaluate_quality(model, torch.tensor([t for w in scored for t in w]), CONTEXT + SCORED, context=CONTEXT)
    greedy = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)  # fmt: skip
        greedy.append(out[0, len(prompt) :].tolist())
    return {"ppl": quality.ppl, "tokens": quality.tokens, "greedy": greedy}


def run_engine(
    python: str, model: Path, inputs: Path, out: Path, log: Path, kv_cache_dtype: str = "auto", extra: tuple = ()
) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    command = [python, str(ENGINE), "--model", str(model), "--inputs", str(inputs), "--out", str(out),
               "--kv-cache-dtype", kv_cache_dtype, *extra]  # fmt: skip
    with log.open("w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise SystemExit(f"vLLM failed on {model.name} (exit {done.returncode}; log {log}): {' | '.join(tail)}")
    return json.loads(out.read_text())


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt: how many generated tokens agree before the first difference."""
    pairs = zip(a, b, strict=True)
    return [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p)) for p, q in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-python", required=True, help="python of the virtualenv with vllm-cpu")
    parser.add_argument("--windows", type=int, default=8, help="scored windows (each SCORED tokens)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--speed-tokens", type=int, default=64)
    parser.add_argument("--reuse", action="store_true", help="read vLLM's results from an earlier run's cache")
    parser.add_argument("--only", default=None, help="regex: run only the rows whose label matches (and the source)")
    parser.add_argument(
        "--mla-refine-steps", type=int, default=100, help="the refined MLA export's --refine-steps (0: no such row)"
    )
    parser.add_argument("--name", default="vllm-cpu", help="results file stem (bench/results/NAME-<date>.*)")
    args = parser.parse_args()
    started = time.time()

    from kvconvert.io.source import open_source
    from kvconvert.methods import LorcConfig, build_method
    from kvconvert.pipeline import convert
    from kvconvert.recipe import storage_spec

    source = prepare_models()["smollm2-135m"]
    work = CACHE / "vllm"
    work.mkdir(parents=True, exist_ok=True)
    wanted = (lambda label: True) if args.only is None else (lambda label: re.search(args.only, label) is not None)

    def converted(name: str, method: Any) -> Path:
        out = work / name
        convert(open_source(str(source)), method, out, replace=True, progress=False)
        return out

    exports = {}
    for strategy in ("tensor", "head"):
        label = f"fp8 export, scales per {strategy}"
        if wanted(label):
            storage = storage_spec({"kv_format": "fp8", "kv_scale_strategy": strategy}, "bench")
            exports[label] = converted(f"smollm2-135m-fp8-{strategy}", build_method("quant", None, storage))
    # the MLA exports: as the budget sizes them (vLLM's CPU kernel refuses them) and at vLLM's sizes (--mla-sizes)
    written_label = "MLA export 0.5 (kv_lora_rank 128 + RoPE 64)"
    padded_label = "MLA export 0.5 at vLLM's sizes: latent 128 → 512, RoPE 64 (--mla-sizes vllm)"
    refined_label = f"MLA export 0.5 --refine-steps {args.mla_refine_steps}, --mla-sizes vllm (128 → 512 + 64)"
    narrow_label = (f"MLA export 0.5 --refine-steps {args.mla_refine_steps} --mla-rope-dim 48, --mla-sizes vllm "
                    "(144 → 512 + 48 → 64)")  # fmt: skip
    mla_runs = [(written_label, "smollm2-135m-mla-0.5", {}),
                (padded_label, "smollm2-135m-mla-0.5-vllm", {"mla_sizes": "vllm"})]  # fmt: skip
    if args.mla_refine_steps:  # each layer fitted on its attention output, kv_a_layernorm in the loop
        steps = {"refine_steps": args.mla_refine_steps, "mla_sizes": "vllm"}
        mla_runs += [(refined_label, f"smollm2-135m-mla-0.5-refine{args.mla_refine_steps}-vllm", steps),
                     (narrow_label, f"smollm2-135m-mla-0.5-refine{args.mla_refine_steps}-rope48-vllm",
                      {**steps, "mla_rope_dim": 48})]  # fmt: skip
    # the budget-sized export is also what the padded row's kvconvert side is compared with
    needed = {label for label, _, _ in mla_runs if wanted(label)} | ({written_label} if wanted(padded_label) else set())
    mla_exports = {label: converted(name, build_method("lorc", LorcConfig(kv_budget=0.5, latent="mla", **extra)))
                   for label, name, extra in mla_runs if label in needed}  # fmt: skip

    scored, prompts, speed_prompt = token_windows(source, args.windows)
    inputs = work / "inputs.json"
    inputs.write_text(json.dumps({"windows": scored, "context": CONTEXT, "prompts": prompts,
                                  "new_tokens": args.new_tokens,
                                  "speed": {"prompt": speed_prompt, "new_tokens": args.speed_tokens,
                                            "batches": [1, 16]}}))  # fmt: skip

    if args.reuse:
        print("--reuse: engine results already in bench/.cache/vllm are read, not measured again")
    runs: list[tuple[str, Path, str, tuple]] = [("source", source, "auto", ()),
                                                 ("source, --kv-cache-dtype fp8", source, "fp8", ())]  # fmt: skip
    runs += [(label, out, "auto", ()) for label, out in exports.items()]
    # vLLM's CPU MLA backends: the reference one (any dtype: float32, comparable with kvconvert's float32 run) and
    # the AMX one it picks by default (bfloat16 only)
    reference_mla = ("--attention-backend", "CPU_MLA")
    runs += [(label, out, "auto", reference_mla) for label, out in mla_exports.items()]
    if padded_label in mla_exports:
        runs.append(("MLA export 0.5 at vLLM's sizes, bfloat16 (vLLM's AMX MLA)", mla_exports[padded_label], "auto",
                     ("--dtype", "bfloat16")))  # fmt: skip
    runs = [run for run in runs if run[0] == "source" or wanted(run[0])]
    mla = mla_exports.get(written_label)
    results: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for label, model_dir, kv_dtype, extra in runs:
        slug = label.replace(" ", "-").replace(",", "").replace("--", "").replace("(", "").replace(")", "")
        print(f"{label}: vLLM …", flush=True)
        engine_out = work / f"{slug}.json"
        if args.reuse and engine_out.exists():
            engine = json.loads(engine_out.read_text())
        else:
            try:
                engine = run_engine(args.engine_python, model_dir, inputs, engine_out, work / f"{slug}.log", kv_dtype,
                                    extra)  # fmt: skip
            except SystemExit as exc:
                if model_dir != mla:
                    raise
                refused[label] = str(exc)  # the CPU MLA kernel's one head size: recorded, not fatal
                print(refused[label], flush=True)
                continue
        dtype = torch.bfloat16 if "bfloat16" in extra else None
        ours = kvconvert_side(model_dir, scored, prompts, args.new_tokens, dtype) if kv_dtype == "auto" else None
        results[label] = {"vllm": engine, "kvconvert": ours}
        if model_dir in exports.values():  # kvconvert with vLLM CPU's rounding: the gap left is everything else
            from kvconvert.runtime import kvconvert_storage

            rounding, kvconvert_storage.fp8_store = kvconvert_storage.fp8_store, truncating_fp8_store
            try:
                results[label]["kvconvert_truncating"] = kvconvert_side(model_dir, scored, prompts, args.new_tokens)
            finally:
                kvconvert_storage.fp8_store = rounding
        if model_dir in exports.values():
            spec = json.loads((model_dir / "config.json").read_text())["kvconvert"]["kv_quant"]["scales"]
            expected = [[max(k), max(v)] for k, v in spec]  # vLLM's CPU backend takes one scale per layer
            loaded = engine["cache"].get("kv_scales")
            results[label]["scales_loaded_as_written"] = loaded is not None and all(
                math.isclose(a, b, rel_tol=1e-6) for pair, want in zip(loaded, expected, strict=True)
                for a, b in zip(pair, want, strict=True)
            )  # fmt: skip

    base = results["source"]["vllm"]
    if padded_label in results and mla is not None:  # the padding changes nothing
        results[padded_label]["kvconvert_unpadded"] = kvconvert_side(mla, scored, prompts, args.new_tokens)
    rows = []
    for label, entry in results.items():
        engine, ours = entry["vllm"], entry["kvconvert"]
        ppl = engine["quality"]["ppl"]
        rows.append([
            label, engine["cache"]["kv_capacity_tokens"],
            f"{engine['cache']['kv_capacity_tokens'] / base['cache']['kv_capacity_tokens']:.2f}×",
            {True: "yes", False: "NO"}.get(entry.get("scales_loaded_as_written"), "-"),
            f"{ppl:.4f}", f"{100 * (ppl / base['quality']['ppl'] - 1):+.2f} %",
            "-" if ours is None else f"{ours['ppl']:.4f}",
            "-" if ours is None else f"{100 * (ppl / ours['ppl'] - 1):+.2f} %",
            "-" if ours is None else "/".join(map(str, agreement(engine["greedy"], ours["greedy"]))),
            "-" if "kvconvert_truncating" not in entry else (
                f"{entry['kvconvert_truncating']['ppl']:.4f} "
                f"({100 * (ppl / entry['kvconvert_truncating']['ppl'] - 1):+.2f} %; greedy "
                + "/".join(map(str, agreement(engine["greedy"], entry["kvconvert_truncating"]["greedy"]))) + ")"),
            f"{engine['tokens_per_s']['1']:.1f} ({engine['tokens_per_s']['1'] / base['tokens_per_s']['1']:.2f}×)",
            f"{engine['tokens_per_s']['16']:.1f} ({engine['tokens_per_s']['16'] / base['tokens_per_s']['16']:.2f}×)",
        ])  # fmt: skip
    headers = ["model", "vLLM KV capacity (tokens)", "× source", "scales loaded", "vLLM ppl", "Δ vs source",
               "kvconvert ppl", "vLLM vs kvconvert", f"greedy tokens agreeing (of {args.new_tokens})",
               "kvconvert with vLLM CPU's truncating fp8 writes (vLLM vs it)",
               "tok/s batch 1", "tok/s batch 16"]  # fmt: skip
    table = (
        f"vLLM {results['source']['vllm'].get('vllm_version', '')} CPU build, SmolLM2-135M float32, "
        f"{os.cpu_count()} cores, VLLM_CPU_KVCACHE_SPACE=2 GiB; context protocol: {args.windows} wikitext-2 "
        f"windows, {CONTEXT} tokens of context, {SCORED} scored; throughput: a {len(speed_prompt)}-token prompt, "
        f"{args.speed_tokens} new tokens, best of 2\n\n" + markdown_table(headers, rows)
    )
    for label, why in refused.items():
        table += f"\n\n{label}: refused by vLLM: {why}"
    payload = {"machine": machine(), "context": CONTEXT, "scored": SCORED, "windows": args.windows,
               "results": results, "refused": refused, "seconds": time.time() - started}  # fmt: skip
    write_results(args.name, payload, table)


if __name__ == "__main__":
    main()
