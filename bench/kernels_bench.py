"""Decode kernels on a GPU (``make bench-kernels``): attention-kernel time against SDPA on the original
shapes, achieved bandwidth against the bytes each kernel must read, and end-to-end decode tokens/s
of converted models against the original at 1K / 8K / 32K context, batch 1 and 16.

Kernel shapes are Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128; slim: the MHA
Llama-2-7B shape, 32 × 128); widths are what each method keeps at KV budget ≈ 0.5–0.75. The end-to-end
model is a random-weight MHA Llama (12 layers, hidden 1024, 16 heads) converted by slim, LoRC (0.5,
uniform), razor, minicache, ZACK 0.5 and quant (4-bit, both layouts; fp8), so no download is needed; each runs its
torch path (the default), slim/LoRC/razor also with ``KVCONVERT_KERNELS=triton``, all with SDPA's
cuDNN backend excluded (see ``sdpa_backends``). Every kernel's output is checked against its float32
reference first. Then the serving figure (``--serving``, default 8192:16): the original's cache for 16 rows of
8K tokens is the memory budget, each model decodes the most rows its cache fits there, tokens/s of all rows against
the original's. ``--graphs``: each static cache decoded eagerly and as replayed CUDA graphs against the original's
``StaticCache`` (``graph_rows``), and whether each step traces whole under ``torch.compile`` (``compile_probe``);
``--shapes C:B,…`` picks (context, batch) pairs for the end-to-end rows. ``--smoke`` runs tiny sizes on the CPU
through the torch references (checks the script, measures nothing meaningful). Writes
bench/results/kernels-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, save_calib_tokenizer, write_results  # noqa: E402
from kvconvert.runtime import kvconvert_kernels as kernels  # noqa: E402
from kvconvert.runtime import kvconvert_kivi_kernel as kivi_kernel  # noqa: E402
from kvconvert.runtime import kvconvert_token_kernel as token_kernel  # noqa: E402
from kvconvert.runtime.kvconvert_folded import merge_partials  # noqa: E402

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # HBM bytes/s (SXM datasheets)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn``: CUDA events through ``triton.testing.do_bench`` on a GPU (it warms up
    and flushes the L2 between runs), the host clock on the CPU (``--smoke``)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ over float64 copies (NaN stays NaN, so it can never pass)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def kernel_cases(batch: int, n: int, device: str, dtype: torch.dtype, small: bool) -> list[dict[str, Any]]:
    """Per kernel at one (batch, context): its name, the bytes it must read, ``run`` (what is timed) and
    ``ref`` (the float32 torch reference its output is checked against)."""
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
                  "run": lambda: sdpa(q, k, v, enable_gqa=True),
                  "ref": lambda: sdpa(q.float(), k.float(), v.float(), enable_gqa=True)})  # fmt: skip

    # ZACK: per-KV-head widths between 40 % and 90 % of dk (budget ≈ 0.65), packed side by side
    wk_g = [int(dk * (0.4 + 0.5 * i / max(1, kv_heads - 1))) for i in range(kv_heads)]
    wv_g = list(reversed(wk_g))
    wk = [wk_g[h // group] for h in range(heads)]
    wv = [wv_g[h // group] for h in range(heads)]
    zack_cols = kernels.HeadColumns.build([sum(wk_g[: h // group]) for h in range(heads)], wk,
                                          [sum(wv_g[: h // group]) for h in range(heads)], wv, device)  # fmt: skip
    zq, zk, zv = rand(batch, sum(wk)), rand(batch, n, sum(wk_g)), rand(batch, n, sum(wv_g))
    cases.append({"kernel": "zack packed (budget 0.65)", "bytes": batch * n * (sum(wk_g) + sum(wv_g)) * size,
                  "run": lambda: launch(zq, zk, zv, zack_cols, dk**-0.5),
                  "ref": lambda: kernels.packed_decode_reference(zq, zk, zv, None, zack_cols, dk**-0.5)})  # fmt: skip

    # LoRC: full RoPE'd keys per KV group, values as one latent of rank e/2 shared by all heads
    rank = kv_heads * dk // 2
    lorc_cols = kernels.HeadColumns.build([(h // group) * dk for h in range(heads)],
                                          [dk] * heads, [0] * heads, [rank] * heads, device)  # fmt: skip
    lq, lk, lv = rand(batch, heads * dk), rand(batch, n, kv_heads * dk), rand(batch, n, rank)
    cases.append({"kernel": "lorc latent V (r_v = e/2)", "bytes": batch * n * (kv_heads * dk + rank) * size,
                  "run": lambda: launch(lq, lk, lv, lorc_cols, dk**-0.5),
                  "ref": lambda: kernels.packed_decode_reference(lq, lk, lv, None, lorc_cols, dk**-0.5)})  # fmt: skip

    # slim (MHA): scores on RoPE'd keys, weights on whole pre-RoPE key rows; W_KV applied afterwards
    e = heads * dk
    slim_cols = kernels.HeadColumns.build([h * dk for h in range(heads)],
                                          [dk] * heads, [0] * heads, [e] * heads, device)  # fmt: skip
    sq, sk, sv = rand(batch, e), rand(batch, n, e), rand(batch, n, e)
    mq, mk, mv = rand(batch, heads, 1, dk), rand(batch, heads, n, dk), rand(batch, heads, n, dk)
    cases.append({"kernel": "sdpa (original MHA)", "bytes": 2 * batch * heads * n * dk * size,
                  "run": lambda: sdpa(mq, mk, mv),
                  "ref": lambda: sdpa(mq.float(), mk.float(), mv.float())})  # fmt: skip
    cases.append({"kernel": "slim decode (K only)", "bytes": batch * n * e * size,
                  "run": lambda: launch(sq, sk, sv, slim_cols, dk**-0.5),
                  "ref": lambda: kernels.packed_decode_reference(sq, sk, sv, None, slim_cols, dk**-0.5)})  # fmt: skip

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
    razor = kernels.razor_decode_triton if rq.is_cuda else kernels.razor_decode_reference
    cases.append({"kernel": "razor head-wise", "bytes": 2 * batch * dk * (r_heads * n + o_heads * kept) * size,
                  "run": lambda: razor(rq, fk, fv, fb, shk, shv, sb, ck, cv, cl, kind, slot, dk**-0.5),
                  "ref": lambda: kernels.razor_decode_reference(rq, fk, fv, fb, shk, shv, sb, ck, cv, cl, kind, slot,
                                                                dk**-0.5)})  # fmt: skip

    # quant 4-bit in KIVI's layout (groups of 64 tokens / channels): codes as stored, read by the kernel directly
    from kvconvert.runtime.kvconvert_codec import quantize_tokens

    block, width = 64, max(dk, 32)  # the kernel's smallest head is 32 wide (``kivi_kernel_fits``)
    tokens = n // block * block
    if tokens:
        kq = quantize_tokens(rand(batch, kv_heads, tokens, width).float(), 4, block, True)
        vq = quantize_tokens(rand(batch, kv_heads, tokens, width).float(), 4, block, False)
        store = (kq.codes, kq.scale, kq.zero, vq.codes, vq.scale, vq.zero)
        qq = rand(batch, kv_heads, group, width)
        kivi = kivi_kernel.kivi_decode_triton if qq.is_cuda else kivi_kernel.kivi_decode_reference
        merge, reference = merge_partials, kivi_kernel.kivi_decode_reference
        cases.append({"kernel": "quant 4-bit KIVI (codes)", "bytes": sum(t.numel() * t.element_size() for t in store),
                      "run": lambda: merge([kivi(qq, *store, None, width**-0.5)]),
                      "ref": lambda: merge([reference(qq.float(), *store, None, width**-0.5)])})  # fmt: skip
    return cases


def launch(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cols: Any, scale: float) -> torch.Tensor:
    """The Triton kernel on a GPU whatever KVCONVERT_KERNELS says (it is what is measured); on the CPU
    (``--smoke``) the reference."""
    impl = kernels.packed_decode_triton if query.is_cuda else kernels.packed_decode_reference
    return impl(query, keys, values, None, cols, scale)


# (label, recipe) of the conversions decoded against the original end to end
CONVERSIONS: list[tuple[str, dict[str, Any]]] = [
    ("slim", {"method": "slim"}),
    ("lorc 0.5", {"method": "lorc", "kv_budget": 0.5, "schedule": "uniform"}),
    ("razor", {"method": "razor", "profile_tokens": 64}),
    # razor's windows quantized in KIVI's layout: a static cache since the twenty-second session (window >= group)
    ("razor + 4-bit KIVI", {"method": "razor", "profile_tokens": 64, "kv_bits": 4, "kv_residual": 0, "kv_sink": 4,
                            "kv_rotate": True}),
    ("minicache", {"method": "minicache"}),
    # one latent per pair, token and side: a static cache since the twenty-third session (SLERP's has none)
    ("minicache subspace 0.5", {"method": "minicache", "merge": "subspace", "kv_budget": 0.5}),
    ("quant 4-bit KIVI", {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    ("quant 4-bit token", {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # the token layout's keys beside 2-bit values (the 8K needle recipe at 0.25 on SmolLM2) and razor's token layout:
    # the token layout's GPU kernel reads both (since the thirty-fourth session); razor's has a static cache since the
    # forty-second (its retrieval heads read by that kernel, its windows' ring dequantized on a GPU)
    ("quant token keys 4-bit + values 2-bit", {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4,
                                               "kv_layout": "token", "kv_value_bits": 2}),
    ("razor + 4-bit token", {"method": "razor", "profile_tokens": 64, "kv_bits": 4, "kv_residual": 0, "kv_sink": 4,
                             "kv_layout": "token"}),
    ("razor + token keys 4-bit + values 2-bit", {"method": "razor", "profile_tokens": 64, "kv_bits": 4,
                                                 "kv_residual": 0, "kv_sink": 4, "kv_layout": "token",
                                                 "kv_value_bits": 2}),
    ("zack 0.5", {"method": "zack", "kv_budget": 0.5}),
    ("quant fp8", {"method": "quant", "kv_format": "fp8"}),
]  # fmt: skip


KERNEL_USERS = {"slim", "lorc 0.5", "razor", "quant fp8"}  # also timed with KVCONVERT_KERNELS=triton


def end_to_end(shapes: list[tuple[int, int]], device: str, small: bool, new_tokens: int,
               serving: tuple[int, int] | None = None, graphs: bool = False, growing: bool = True,
               only: set[str] | None = None, probe: bool = True,
               compiled: set[str] | None = None,
               kernel_paths_only: bool = False) -> tuple[list[dict], list[dict], list[dict], list[dict]]:  # fmt: skip
    """Decode tokens/s of a random MHA Llama and its conversions at each (context, batch) of ``shapes``; prompts
    prefilled in 512-token chunks. With ``serving`` (context, rows) also the serving figure (``serving_rows``); with
    ``graphs`` also each static cache's decode through CUDA graphs (``graph_rows``) and whether its step traces whole
    (``compile_probe``); ``growing=False`` skips the default (growing) caches' rows; ``only``: these conversions'
    labels alone (None: all); ``compiled``: these runs' labels (and the original) also decode through
    ``torch.compile`` (``graph_rows``). Returns (rows, serving rows,
    graph rows, probe rows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvconvert
    from kvconvert.devices import computing_on
    from kvconvert.eval.memory import cache_nbytes
    from kvconvert.io.source import open_source
    from kvconvert.methods import build_method
    from kvconvert.pipeline import convert
    from kvconvert.recipe import parse_recipe

    size = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=2) if small else dict(
        hidden_size=1024, num_hidden_layers=12, num_attention_heads=16)  # fmt: skip
    # positions for the longest run (graph_rows: 9 rounds of steps after the context); razor profiles 4 × 64 tokens
    context = max(512, max(c for c, _ in shapes) + 16 * new_tokens + 8)
    config = LlamaConfig(vocab_size=32000, intermediate_size=4 * size["hidden_size"], max_position_embeddings=context,
                         num_key_value_heads=None, **size)  # fmt: skip
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        src = Path(tmp) / "src"
        LlamaForCausalLM(config).save_pretrained(src)
        save_calib_tokenizer(src, 2000)  # zack and fp8 calibrate on text
        paths = {"original": src}
        for label, recipe in [c for c in CONVERSIONS if only is None or c[0] in only]:
            name, method_config, storage = parse_recipe(recipe, label)
            paths[label] = Path(tmp) / f"m{len(paths)}"
            with computing_on(torch.device(device)):  # calibration and profiling on the GPU too
                convert(open_source(str(src)), build_method(name, method_config, storage), paths[label],
                        progress=False)  # fmt: skip
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        models = {name: (LlamaForCausalLM.from_pretrained(path) if name == "original" else kvconvert.load(path))
                  .to(device=device, dtype=dtype).eval() for name, path in paths.items()}  # fmt: skip
        # (label, model, KVCONVERT_KERNELS): the torch paths (the default), kernel users also with kernels
        token = (
            "quant 4-bit token",
            "quant token keys 4-bit + values 2-bit",
            "razor + 4-bit token",
            "razor + token keys 4-bit + values 2-bit",
        )
        users = (*KERNEL_USERS, "quant 4-bit KIVI", *token) if device == "cuda" else ()
        # (``kernel_paths_only``: a model with a kernel timed with it alone)
        runs = [(name, model, "torch") for name, model in models.items() if not (kernel_paths_only and name in users)]
        # (a quant checkpoint's attention is routed to its codes' readers at load)
        runs += [(f"{name} [Triton kernels]", models[name], "triton") for name in models if name in users]
        for context, batch in shapes if growing else []:  # every model at one shape before the next
            ids = torch.randint(3, 32000, (batch, context + new_tokens + 1), device=device)
            original = float("nan")
            for label, model, choice in runs:
                os.environ["KVCONVERT_KERNELS"] = choice
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                with sdpa_backends():
                    rate, cache = decode_rate(model, ids, context, new_tokens)
                original = rate if label == "original" else original  # measured first
                peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
                rows.append({"model": label, "context": context, "batch": batch, "decode_tokens_per_s": rate,
                             "ratio_to_original": rate / original, "cache_bytes": cache_nbytes(cache),
                             "peak_gpu_bytes": peak})  # fmt: skip
                del cache
                print(rows[-1], flush=True)
        graphed = graph_rows(runs, shapes, device, new_tokens, compiled=compiled or set()) if graphs else []
        probed = compile_probe(runs, device) if graphs and probe else []
        served = [] if serving is None else serving_rows(runs, *serving, device, new_tokens)
    os.environ.pop("KVCONVERT_KERNELS", None)
    return rows, served, graphed, probed


def graph_rows(runs: list[tuple[str, Any, str]], shapes: list[tuple[int, int]], device: str,
               steps: int, rounds: int = 3, compiled: Collection[str] = ()) -> list[dict[str, Any]]:  # fmt: skip
    """Each model's decode from its static cache (what ``generate(cache_implementation="static")`` makes), rows of
    equal length: eagerly, and as one captured CUDA graph per step replayed (``captured_decode``; on the CPU,
    ``--smoke``, the same loop uncaptured). The original (transformers' ``StaticCache``) is timed first and last,
    its best counts; a model whose cache is not static, or whose step cannot be captured, gets its reason instead of
    a figure. Runs named in ``compiled`` (and the original's first run) also decode with the step compiled by
    Inductor (``torch.compile``, default mode: its glue fused) and captured as a CUDA graph: what ``generate``'s
    ``mode="reduce-overhead"`` does."""
    from kvconvert.eval.memory import cache_nbytes
    from kvconvert.eval.speed import _decode, _prefill

    out: list[dict[str, Any]] = []
    for context, batch in shapes:
        ids = torch.randint(3, 32000, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)
        first: dict[str, Any] = {}
        for label, model, choice in [*runs, runs[0]]:
            os.environ["KVCONVERT_KERNELS"] = choice
            if device == "cuda":
                torch.cuda.empty_cache()
            row: dict[str, Any] = {"model": label, "context": context, "batch": batch}
            try:
                with sdpa_backends(), torch.no_grad():
                    length = context + (3 * rounds + 6) * steps + 2
                    probe = _prefill(model, ids[:1, :1], None, None, length)["cache"]  # one token: is it static?
                    if not probe.is_compileable:
                        raise RuntimeError(f"{type(probe.layers[0]).__name__}: no static cache")
                    del probe
                    state = _prefill(model, ids, 512, None, length)
                    row["cache_bytes"] = cache_nbytes(state["cache"])
                    _decode(model, state, 1)
                    row["eager_tokens_per_s"] = batch * steps / min(_decode(model, state, steps)
                                                                    for _ in range(rounds))  # fmt: skip
                    replay = captured_decode(model, state["cache"], state["token"])[0]
                    row["graph_tokens_per_s"] = batch * steps / min(replay(steps) for _ in range(rounds))
                    if (label in compiled or label == "original") and not (label == "original" and first):
                        row["compile_s"], replay = compiled_decode(model, state["cache"], state["token"])
                        row["compiled_tokens_per_s"] = batch * steps / min(replay(steps) for _ in range(rounds))
                del state
            except Exception as error:  # noqa: BLE001 - the reason is the row's result
                row["error"] = f"{type(error).__name__}: {str(error)[:1500]}"
            print(row, flush=True)
            if label == "original" and first:  # its second run: the best of both counts, one row
                for key in ("eager_tokens_per_s", "graph_tokens_per_s", "compiled_tokens_per_s"):
                    if key in row:
                        first[key] = max(first.get(key, 0.0), row[key])
                continue
            if label == "original":
                first = row
            out.append(row)
        for row in out[-len(runs) :]:  # ratios to the original's best at this shape
            for key in ("eager", "graph", "compiled"):
                rate, base = row.get(f"{key}_tokens_per_s"), first.get(f"{key}_tokens_per_s")
                row[f"{key}_ratio"] = None if rate is None or not base else rate / base
    return out


def serving_rows(runs: list[tuple[str, Any, str]], context: int, rows: int, device: str,
                 new_tokens: int) -> list[dict[str, Any]]:  # fmt: skip
    """What a fixed memory serves: the original's cache for ``rows`` rows of ``context`` tokens is the budget; each
    model decodes the most rows whose cache fits it (bytes per row measured on one row), tokens/s of all rows
    against the original's at ``rows``."""
    from kvconvert.eval.memory import cache_nbytes

    ids = torch.randint(3, 32000, (1, context + new_tokens + 1), device=device)
    per_row = {}
    for label, model, choice in runs:
        os.environ["KVCONVERT_KERNELS"] = choice
        with sdpa_backends():
            per_row[label] = cache_nbytes(decode_rate(model, ids, context, 1)[1])
    budget = per_row["original"] * rows
    out: list[dict[str, Any]] = []
    for label, model, choice in runs:
        fits = max(1, int(budget // per_row[label]))
        os.environ["KVCONVERT_KERNELS"] = choice
        if device == "cuda":
            torch.cuda.empty_cache()
        batch = torch.randint(3, 32000, (fits, context + new_tokens + 1), device=device)
        with sdpa_backends():
            rate = decode_rate(model, batch, context, new_tokens)[0]
        out.append({"model": label, "context": context, "rows": fits, "cache_bytes_per_row": per_row[label],
                    "decode_tokens_per_s": rate, "ratio_to_original": rate / out[0]["decode_tokens_per_s"]
                    if out else 1.0})  # fmt: skip
        print(out[-1], flush=True)
    return out


def compiled_decode(model: Any, cache: Any, token: torch.Tensor) -> tuple[float, Callable[[int], float]]:
    """``captured_decode`` with the step compiled by Inductor first (positions passed as tensors the graph advances,
    so each step has the same guards and one compile serves all). Returns (seconds to compile and capture, run)."""
    torch._dynamo.reset()  # (each model's forward shares its code object with the others': compiled afresh)
    position = torch.tensor([int(cache.get_seq_length())], device=token.device)
    rows = token.shape[0]
    compiled = torch.compile(model.forward, dynamic=False)

    def forward(ids: torch.Tensor, **kwargs: Any) -> Any:
        out = compiled(ids, cache_position=position, position_ids=position.view(1, 1).expand(rows, 1), **kwargs)
        position.add_(1)
        return out

    began = time.perf_counter()
    run = captured_decode(model, cache, token, forward)[0]
    return time.perf_counter() - began, run


def captured_decode(
    model: Any, cache: Any, token: torch.Tensor, forward: Callable[..., Any] | None = None
) -> tuple[Callable[[int], float], dict[str, Any]]:  # fmt: skip
    """Greedy decode from ``cache`` (static, after ``token``'s prefix) with each step one replayed CUDA graph, as
    serving engines decode: the step's input token lives in a fixed tensor, the positions in the cache's own counters
    (tensors, advanced inside the graph); two warm-up steps run on a side stream, then one step is captured. Returns
    ``run(steps)`` -> seconds for that many steps, and a dict holding the last step's ``logits`` and the ``token``
    decoded from them. On the CPU the same loop calls the model uncaptured (checks the loop). ``forward``: what each
    step calls (default: the model)."""
    ids = token.clone()
    last: dict[str, Any] = {"token": ids}

    def step() -> torch.Tensor:
        return (forward or model)(ids, past_key_values=cache, use_cache=True).logits

    def advance(logits: torch.Tensor) -> None:
        last["logits"] = logits
        ids.copy_(logits[:, -1:].argmax(-1))

    graph = None
    side = torch.cuda.Stream() if token.is_cuda else None  # a capture's warm-up runs off the default stream
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
        for _ in range(2):
            advance(step())
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()  # recorded, not run: the cache advances at each replay

    def run(steps: int) -> float:
        sync = torch.cuda.synchronize if token.is_cuda else (lambda: None)
        sync()
        began = time.perf_counter()
        for _ in range(steps):
            if graph is None:
                advance(step())
            else:
                graph.replay()
                advance(logits)
        sync()
        return time.perf_counter() - began

    return run, last


def compile_probe(runs: list[tuple[str, Any, str]], device: str) -> list[dict[str, Any]]:
    """Whether each model's decode step from its static cache traces whole (``torch.compile(fullgraph=True)``,
    dynamo's ``eager`` backend: the trace only) on ``device``, one row of 64 tokens; the error in full where not."""
    from kvconvert.eval.speed import _decode, _prefill

    ids = torch.randint(3, 32000, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    out = []
    for label, model, choice in runs:
        os.environ["KVCONVERT_KERNELS"] = choice
        torch._dynamo.reset()  # each model traced afresh (no recompile limit shared across models)
        row: dict[str, Any] = {"model": label}
        try:
            with sdpa_backends(), torch.no_grad():
                state = _prefill(model, ids, None, None, 80)
                if not state["cache"].is_compileable:
                    continue
                state["forward"] = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="eager")
                _decode(model, state, 2)
            row["traced"] = True
        except Exception as error:  # noqa: BLE001 - the reason is the row's result
            row["traced"], row["error"] = False, f"{type(error).__name__}: {str(error)[:3000]}"
        out.append(row)
        print(row, flush=True)
    return out


def sdpa_backends() -> Any:
    """SDPA without its cuDNN backend: with torch 2.11 on an H100 it rebuilt a cuDNN graph at every
    decode step (3.6 ms of CPU per call, profiled), which made the stock model 4× slower than with
    eager attention and would flatter every conversion that does not call SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@torch.no_grad()
def decode_rate(model: Any, ids: torch.Tensor, context: int, new_tokens: int) -> tuple[float, Any]:
    """Prefill ``context`` tokens in 512-token chunks, one untimed decode step (compiles the kernels),
    then ``new_tokens`` timed steps. Returns (tokens/s over the batch, the cache)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    cache = None
    for start in range(0, context, 512):
        cache = model(ids[:, start : min(context, start + 512)], past_key_values=cache, use_cache=True).past_key_values
    cache = model(ids[:, context : context + 1], past_key_values=cache, use_cache=True).past_key_values
    sync()
    began = time.perf_counter()
    for step in range(1, new_tokens + 1):
        cache = model(
            ids[:, context + step : context + step + 1], past_key_values=cache, use_cache=True
        ).past_key_values
    sync()
    return ids.shape[0] * new_tokens / (time.perf_counter() - began), cache


def apply_launch(launch: dict[str, dict[str, int]]) -> None:
    """Set the kernels' launch shapes from a launch file (``bench/kernel_sweep.py``'s best-launch.json)."""
    from kvconvert.runtime import kvconvert_fp8_kernel as fp8

    if "fp8 kernel" in launch:
        f = launch["fp8 kernel"]
        fp8.FP8_TILE, fp8.FP8_WARPS, fp8.FP8_STAGES = f["tile"], f["warps"], f["stages"]
        fp8.FP8_PROGRAMS_PER_SM = f["programs_per_sm"]
    if "quant 4-bit KIVI kernel" in launch:
        k = launch["quant 4-bit KIVI kernel"]
        kivi_kernel.KIVI_WARPS, kivi_kernel.KIVI_STAGES = k["warps"], k["stages"]
        kivi_kernel.KIVI_PROGRAMS_PER_SM = k["programs_per_sm"]
        kivi_kernel.KIVI_TILE = k.get("tile", kivi_kernel.KIVI_TILE)  # (launch files before the tile kernel)
        kivi_kernel.KIVI_SPLIT = k.get("split", kivi_kernel.KIVI_SPLIT)
        kivi_kernel.KIVI_MAGIC = k.get("magic", kivi_kernel.KIVI_MAGIC)
    if "quant 4-bit token kernel" in launch:
        t = launch["quant 4-bit token kernel"]
        token_kernel.TOKEN_TILE, token_kernel.TOKEN_WARPS = t["tile"], t["warps"]
        token_kernel.TOKEN_STAGES, token_kernel.TOKEN_PROGRAMS_PER_SM = t["stages"], t["programs_per_sm"]
    print("launch:", launch_now(), flush=True)


def launch_now() -> dict[str, Any]:
    from kvconvert.runtime import kvconvert_fp8_kernel as fp8

    return {"fp8": [fp8.FP8_TILE, fp8.FP8_WARPS, fp8.FP8_STAGES, fp8.FP8_PROGRAMS_PER_SM],
            "kivi": [kivi_kernel.KIVI_TILE, kivi_kernel.KIVI_SPLIT, kivi_kernel.KIVI_MAGIC, kivi_kernel.KIVI_WARPS,
                     kivi_kernel.KIVI_STAGES, kivi_kernel.KIVI_PROGRAMS_PER_SM],
            "token": [token_kernel.TOKEN_TILE, token_kernel.TOKEN_WARPS, token_kernel.TOKEN_STAGES,
                      token_kernel.TOKEN_PROGRAMS_PER_SM]}  # fmt: skip


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (checks the script only)")
    parser.add_argument("--contexts", default=None, help="comma-separated (default 1024,8192,32768)")
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,16)")
    parser.add_argument("--shapes", default=None,
                        help="end-to-end CONTEXT:BATCH pairs (default: each of --contexts × --batches)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32; --smoke 4)")
    parser.add_argument("--no-growing", action="store_true", help="skip the default (growing) caches' decode rows")
    parser.add_argument("--graphs", action="store_true",
                        help="also decode each static cache eagerly and as replayed CUDA graphs")  # fmt: skip
    parser.add_argument("--kernels-only", action="store_true", help="skip the end-to-end decode")
    parser.add_argument(
        "--kernel-paths-only",
        action="store_true",
        help="time a conversion that has a GPU kernel with the kernel alone, not also its torch path",
    )
    parser.add_argument("--copy-to", default=None, help="also write the results into this folder")
    parser.add_argument("--only", default=None, help="comma-separated conversion labels (default: all)")
    parser.add_argument("--no-probe", action="store_true", help="skip the torch.compile trace probe (--graphs)")
    parser.add_argument(
        "--compiled", default=None, help="run labels (comma-separated) also decoded compiled and captured (--graphs)"
    )
    parser.add_argument("--launch", default=None,
                        help="kernel_sweep.py's best-launch.json or results JSON: launch shapes")  # fmt: skip
    parser.add_argument("--serving", default=None,
                        help="CONTEXT:ROWS (default 8192:16; --smoke 64:2; 'none': skip): tokens/s of each model at "
                             "the most rows its cache fits into the original's cache for ROWS rows")  # fmt: skip
    args = parser.parse_args()
    if args.launch:  # best-launch.json, or the sweep's results file (its "launch")
        data = json.loads(Path(args.launch).read_text())
        apply_launch(data.get("launch", data))
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("bench-kernels needs a CUDA GPU (use --smoke to check the script on CPU)")
    contexts, batches = ([64, 128], [1, 2]) if args.smoke else ([1024, 8192, 32768], [1, 16])
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else contexts
    batches = [int(c) for c in args.batches.split(",")] if args.batches else batches
    dtype = torch.float32 if args.smoke else torch.bfloat16
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in gpu), None)
    kernel_rows = []
    for n in contexts:
        for batch in batches:
            for case in kernel_cases(batch, n, device, dtype, small=args.smoke):
                error = relative_error(case["run"](), case["ref"]())
                seconds = timed(case["run"], repeats=3 if args.smoke else 50)
                bandwidth = case["bytes"] / seconds
                kernel_rows.append({"kernel": case["kernel"], "context": n, "batch": batch, "us": seconds * 1e6,
                                    "relative_error": error, "bytes": case["bytes"], "gb_per_s": bandwidth / 1e9,
                                    "roofline": None if peak is None else bandwidth / peak})  # fmt: skip
                print(kernel_rows[-1], flush=True)
    shapes = [(c, b) for c in contexts for b in batches]
    if args.shapes:
        shapes = [(int(c), int(b)) for c, b in (pair.split(":") for pair in args.shapes.split(","))]
    serving = args.serving or ("64:2" if args.smoke else "8192:16")
    context, rows = (0, 0) if serving == "none" else (int(x) for x in serving.split(":"))
    e2e, served, graphed, probed = ([], [], [], []) if args.kernels_only else end_to_end(
        shapes, device, args.smoke, new_tokens=args.steps or (4 if args.smoke else 32),
        serving=None if serving == "none" else (context, rows), graphs=args.graphs,
        growing=not args.no_growing, only=None if args.only is None else set(args.only.split(",")),
        probe=not args.no_probe, compiled=set(args.compiled.split(",")) if args.compiled else None,
        kernel_paths_only=args.kernel_paths_only)  # fmt: skip
    payload = {"benchmark": "kernels", "device": gpu, "launch": launch_now(), "dtype": str(dtype),
               "kernels": kernel_rows,
               "end_to_end": e2e, "serving": served, "graphs": graphed, "compile_probe": probed,
               "machine": machine(),
               "seconds": time.perf_counter() - started}  # fmt: skip
    table = markdown_table(
        ["kernel", "context", "batch", "µs", "‖err‖/‖ref‖", "MB read", "GB/s", "of peak"],
        [[r["kernel"], r["context"], r["batch"], f"{r['us']:.1f}", f"{r['relative_error']:.1e}",
          f"{r['bytes'] / 1e6:.1f}", f"{r['gb_per_s']:.0f}", "-" if r["roofline"] is None else f"{r['roofline']:.0%}"]
         for r in kernel_rows],
    ) + "\n\n" + markdown_table(
        ["model", "context", "batch", "decode tok/s", "× original", "cache MB", "peak GPU GB"],
        [[r["model"], r["context"], r["batch"], f"{r['decode_tokens_per_s']:.1f}", f"{r['ratio_to_original']:.2f}",
          f"{r['cache_bytes'] / 1e6:.1f}", "-" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / 1e9:.2f}"]
         for r in e2e],
    ) + "\n\nServing within the original's cache memory:\n\n" + markdown_table(
        ["model", "context", "rows", "cache MB per row", "decode tok/s (all rows)", "× original"],
        [[r["model"], r["context"], r["rows"], f"{r['cache_bytes_per_row'] / 1e6:.2f}",
          f"{r['decode_tokens_per_s']:.1f}", f"{r['ratio_to_original']:.2f}"] for r in served],
    )  # fmt: skip
    if graphed:
        table += "\n\nFrom static caches, eager and through CUDA graphs (rows of equal length):\n\n" + markdown_table(
            ["model", "context", "batch", "eager tok/s", "× original", "CUDA graphs tok/s", "× original",
             "compiled + graphs tok/s", "× original", "cache MB", "why no figure"],
            [[r["model"], r["context"], r["batch"], _num(r.get("eager_tokens_per_s")), _num(r.get("eager_ratio"), 2),
              _num(r.get("graph_tokens_per_s")), _num(r.get("graph_ratio"), 2),
              _num(r.get("compiled_tokens_per_s")), _num(r.get("compiled_ratio"), 2),
              _num(r["cache_bytes"] / 1e6 if "cache_bytes" in r else None), r.get("error", "").split("\n")[0]]
             for r in graphed],
        ) + "\n\nDecode step traced whole by torch.compile (fullgraph, 1 × 64 tokens):\n\n" + markdown_table(
            ["model", "traced", "error (first line; JSON: in full)"],
            [[r["model"], r["traced"], r.get("error", "").split("\n")[0]] for r in probed],
        )  # fmt: skip
    if args.smoke:
        print(table)
        return
    paths = write_results("kernels", payload, f"Decode kernels on {gpu} ({dtype}).\n\n" + table)
    if args.copy_to:
        for path in paths:
            shutil.copy(path, Path(args.copy_to) / path.name)


if __name__ == "__main__":
    main()
