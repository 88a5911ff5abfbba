"""Decode speed at long context (``make bench-speed``): converted models against their source, side by side.

For each context length: every model prefills the same random tokens once (its own cache), then
the models take turns decoding ``--steps`` greedy tokens from where they are, ``--rounds`` times
(interleaved, so a slow spell of the machine hits every model alike); the best round counts.
Reported: decode tokens/s, the ratio to the source measured in the same process, and the bytes the
cache holds after the prefill. ``--batches 1,8``: each context at each batch size, the rows left-padded to
different lengths (``eval.speed.ragged_batch``: from the context down to a little over half of it).
``--serving C:B``: the serving figure: the memory the source's cache takes for B rows of C tokens is the budget;
each model decodes the most rows of C tokens whose cache fits it, and its tokens/s (all rows) is compared with the
source's at B rows (``--contexts ""``: that figure alone, no grid). The source runs as users run it: transformers'
default dynamic cache in the checkpoint's dtype (float32 for the GGUF-imported SmolLM2). At batch 1 beside it the same
source with each decode step's query heads packed per KV head (``eval.speed.packed_decode``: without a padding mask
transformers reads the cache through torch's GQA kernel, 5-6× slower in bfloat16; padded rows get the packing from
transformers itself), and every row is also given against the faster of the two ("× fastest source"). SmolLM2 shares
each KV head by 3 query heads, which slim cannot use; slim is timed against its own source, a random-weight MHA Llama
(8 layers × 1024, 16 heads; random weights time the same as trained ones). Writes
bench/results/speed-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import llama8b_shaped, prepare_models  # noqa: E402
from bench.slim_bench import build_source  # noqa: E402
from kvconvert.eval.speed import packed_decode, side_by_side  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods import build_method  # noqa: E402
from kvconvert.pipeline import convert  # noqa: E402
from kvconvert.recipe import parse_recipe  # noqa: E402

PACKED = "source, decode heads packed"  # the source through ``packed_decode``
# (label, recipe): the conversions timed against the source
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("quant 4-bit KIVI layout, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    ("quant fp8 (vLLM/SGLang format)", {"method": "quant", "kv_format": "fp8"}),
    ("quant 3-bit KIVI layout, sink 4 (ext.)", {"method": "quant", "kv_bits": 3, "kv_residual": 0, "kv_sink": 4}),
    ("quant 2-bit KIVI layout, sink 4 (ext.)", {"method": "quant", "kv_bits": 2, "kv_residual": 0, "kv_sink": 4}),
    # the int8 cache users reach for first (0.53 of a 16-bit cache)
    ("quant 8-bit KIVI layout", {"method": "quant", "kv_bits": 8, "kv_residual": 0}),
    ("quant 4-bit token layout, sink 4 (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # the token layout's keys beside 2-bit values per token (the 8K needle tasks' best recipe at 0.227 of the cache)
    ("quant token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_value_bits": 2, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # the projection and eviction runtimes: decode speed depends on the ranks / head counts, not on how
    # they were chosen, so the uncalibrated conversions stand in for the calibrated ones (same layout)
    ("lorc 0.5 uniform", {"method": "lorc", "kv_budget": 0.5, "schedule": "uniform"}),
    # one latent for K and V: its ranks come only from the calibrated allocation (minutes of probes)
    ("lorc 0.5 joint latent (ext.)", {"method": "lorc", "kv_budget": 0.5, "schedule": "auto", "latent": "joint"}),
    # the DeepSeek-V3 export, loaded as every candidate is (kvconvert's runtime: decode steps in the latent space)
    ("lorc 0.5 as DeepSeek-V3 MLA (ext.)", {"method": "lorc", "kv_budget": 0.5, "latent": "mla"}),
    ("zack 0.5", {"method": "zack", "kv_budget": 0.5}),
    ("zack 0.5 + 4-bit", {"method": "zack", "kv_budget": 0.5, "kv_bits": 4, "kv_residual": 0}),
    # razor: which heads keep everything changes nothing here; a short profile keeps the bench fast
    ("razor 0.5", {"method": "razor", "kv_budget": 0.5, "profile_tokens": 64}),
    ("minicache + 4-bit", {"method": "minicache", "kv_bits": 4, "kv_residual": 0}),
    ("minicache subspace 0.5 (ext.)", {"method": "minicache", "merge": "subspace", "kv_budget": 0.5}),
    ("minicache subspace 0.5 + 4-bit (ext.)",
     {"method": "minicache", "merge": "subspace", "kv_budget": 0.5, "kv_bits": 4, "kv_residual": 0}),
    ("razor 0.5 + 4-bit KIVI layout, sink 4 + rotated values (ext.)",
     {"method": "razor", "kv_budget": 0.5, "profile_tokens": 64, "kv_bits": 4, "kv_residual": 32, "kv_sink": 4,
      "kv_rotate": True}),
    ("razor 0.5 + 4-bit token layout, sink 4 (ext.)",
     {"method": "razor", "kv_budget": 0.5, "profile_tokens": 64, "kv_bits": 4, "kv_residual": 0, "kv_sink": 4,
      "kv_layout": "token"}),
    # half the heads whole in the token layout's keys beside 2-bit values: the 8K needle tasks' recipe below 0.15
    ("razor 0.5 + token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
     {"method": "razor", "kv_budget": 0.5, "profile_tokens": 64, "kv_bits": 4, "kv_value_bits": 2, "kv_residual": 0,
      "kv_sink": 4, "kv_layout": "token"}),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,16384", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1", help="comma-separated batch sizes (rows of different lengths)")
    parser.add_argument("--serving", default=None, type=_context_rows,
                        help="CONTEXT:ROWS: tokens/s within the source's cache memory")  # fmt: skip
    parser.add_argument("--only", default=None, help="candidates whose label contains this text ('|': any of several; "
                                                     "'=LABEL': that label exactly)")  # fmt: skip
    parser.add_argument("--name", default="speed", help="results file stem (bench/results/NAME-<date>.*)")
    parser.add_argument("--source", choices=["smollm2", "llama8b-shape"], default="smollm2",
                        help="llama8b-shape: four random layers of Llama-3.1-8B's shapes in bfloat16 "
                             "(bench.models.llama8b_shaped; give --dtype bfloat16), no slim row")  # fmt: skip
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="every model, the source too, cast to it after loading")  # fmt: skip
    parser.add_argument("--static", action="store_true",
                        help="batch 1 also from static caches decoded eagerly, sized for as many new tokens as the "
                             "context (generate(cache_implementation='static') without a compile)")  # fmt: skip
    parser.add_argument("--compiled", action="store_true",
                        help="batch 1 also from static caches through torch.compile (fullgraph), against the compiled "
                             "source; methods without a static cache get no compiled row")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    contexts = [int(c) for c in args.contexts.split(",") if c]  # "": no grid (--serving alone)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.source == "smollm2":
            name, source_dir = "smollm2-135m", prepare_models(include_smollm=True)["smollm2-135m"]
        else:
            name, source_dir = "llama-3.1-8b-shaped, 4 random layers", llama8b_shaped()
        models: dict[str, Any] = {
            "source": AutoModelForCausalLM.from_pretrained(source_dir).eval(),
            PACKED: packed_decode(AutoModelForCausalLM.from_pretrained(source_dir).eval()),
        }
        recipes: dict[str, Any] = {}
        for label, recipe in CANDIDATES:
            if args.only is None or any(label == part[1:] if part.startswith("=") else part in label
                                        for part in args.only.split("|")):  # fmt: skip
                models[label] = _converted(source_dir, recipe, label, Path(tmp) / f"m{len(models)}")
                recipes[label] = recipe
        batches = [int(b) for b in args.batches.split(",")]
        dtype, short = getattr(torch, args.dtype), {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
        models = {label: model.to(dtype) for label, model in models.items()}
        rows += _measure(f"{name} ({short})", models, recipes, contexts, args.steps, args.rounds, batches,
                         args.compiled, args.static)  # fmt: skip
        if args.serving:
            context, rows_ = args.serving
            # with padding masks transformers packs the source's heads itself: no second source to time
            as_run = {label: model for label, model in models.items() if label != PACKED}
            serving = _serving(as_run, context, rows_, args.steps, args.rounds)
        if args.source == "smollm2" and (args.only is None or "slim" in args.only.split("|")):
            mha = Path(tmp) / "mha"
            build_source(mha, layers=8, max_positions=max(contexts) + args.steps + 8)
            slim = {"method": "slim"}
            models = {"source": AutoModelForCausalLM.from_pretrained(mha).eval(),  # MHA: nothing to pack
                      "slim": _converted(mha, slim, "slim", Path(tmp) / "slim")}  # fmt: skip
            models = {label: model.to(dtype) for label, model in models.items()}
            rows += _measure(f"random MHA Llama 8×1024 ({short})", models, {"slim": slim}, contexts, args.steps,
                             args.rounds, batches, args.compiled, args.static)  # fmt: skip
    table = "" if not rows else markdown_table(
        ["source", "context", "batch", "decode", "model", "decode tok/s", "× source", "× fastest source",
         "cache MiB", f"cache ÷ source ({short})"],
        [[r["source"], r["context"], r["batch"],
          "compiled, static cache" if r["compiled"] else "static cache, eager" if r.get("static") else "eager",
          r["model"], f"{r['decode_tokens_per_s']:.2f}",
          f"{r['ratio_to_source']:.2f}", f"{r['ratio_to_fastest_source']:.2f}",
          f"{r['cache_bytes_after_prefill'] / 2**20:.1f}",
          f"{r['cache_ratio_to_source']:.3f}"] for r in rows],
    )  # fmt: skip
    payload: dict[str, Any] = {"machine": machine(), "steps": args.steps, "rounds": args.rounds, "dtype": args.dtype,
                               "rows": rows}  # fmt: skip
    if args.serving:
        payload["serving"] = serving
        within = f"{args.serving[0]} tokens × {args.serving[1]}"
        table += ("\n\n" if table else "") + f"Serving within the source's cache memory at {within} rows:\n\n"
        table += markdown_table(
            ["model", "rows that fit", "decode tok/s (all rows)", "× source"],
            [[r["model"], r["rows"], f"{r['decode_tokens_per_s']:.2f}", f"{r['ratio_to_source']:.2f}"]
             for r in serving],
        )  # fmt: skip
    payload["seconds"] = time.perf_counter() - started
    write_results(args.name, payload, table)


def _converted(source_dir: Path, recipe: dict[str, Any], label: str, out: Path) -> Any:
    """Convert ``source_dir`` by ``recipe`` into ``out`` and load the result."""
    import kvconvert

    name, config, storage = parse_recipe(recipe, label)
    convert(open_source(str(source_dir)), build_method(name, config, storage), out, progress=False)
    return kvconvert.load(out).eval()


def _serving(models: dict[str, Any], context: int, rows: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    """Tokens/s of every model at the most rows of ``context`` tokens whose cache fits the memory the
    source's cache takes for ``rows`` rows (cache bytes per row measured on one row), against the source
    at ``rows`` rows: what a fixed memory budget serves."""
    from kvconvert.eval.memory import cache_nbytes
    from kvconvert.eval.speed import _prefill

    ids = torch.randint(3, models["source"].config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    per_row = {name: cache_nbytes(_prefill(model, ids, 2048)["cache"]) for name, model in models.items()}
    budget = per_row["source"] * rows
    fits = {name: max(1, int(budget // per_row[name])) for name in models}
    print({"serving budget bytes": budget, "rows": fits}, flush=True)
    # each model at its own batch: timed one after another, the source first and last (its best counts)
    # prefill chunks of at most ~16K row-tokens: a chunk's scores are [rows, H, chunk, context] wherever a runtime
    # materializes them (28 GB for 95 rows of 2048 against 4K tokens in float32)
    speed = {}
    for name, model in models.items():
        measured = side_by_side({name: model}, context, steps, rounds, chunk=_chunk(fits[name]), batch=fits[name])
        speed[name] = measured[name]["decode_tokens_per_s"]
        print({"model": name, "rows": fits[name], "decode_tokens_per_s": speed[name]}, flush=True)
    again = side_by_side({"source": models["source"]}, context, steps, rounds, chunk=_chunk(rows), batch=rows)
    speed["source"] = max(speed["source"], again["source"]["decode_tokens_per_s"])
    return [{"model": name, "rows": fits[name], "cache_bytes_per_row": per_row[name],
             "decode_tokens_per_s": speed[name], "ratio_to_source": speed[name] / speed["source"]}
            for name in models]  # fmt: skip


def _context_rows(text: str) -> tuple[int, int]:
    """``--serving``'s ``CONTEXT:ROWS``, both positive integers (else argparse's one-line error)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected CONTEXT:ROWS (e.g. 4096:4), got {text!r}")
    return int(parts[0]), int(parts[1])


def _chunk(rows: int) -> int:
    """Prefill chunk for ``rows`` rows: 2048 tokens up to 8 rows, fewer beyond (at least 128)."""
    return max(128, min(2048, 16384 // rows))


def timed_at(models: dict[str, Any], batch: int) -> dict[str, Any]:
    """The models timed at ``batch`` rows: ``PACKED`` at batch 1 only. More rows are left-padded, and under their mask
    transformers packs the source's heads itself: the same computation (timed anyway at 8 × 1K it came out 1.17× the
    source, the machine's noise)."""
    return {label: model for label, model in models.items() if batch == 1 or label != PACKED}


def fastest_source(measured: dict[str, dict[str, float]]) -> float:
    """Decode tokens/s of the faster of the source as run and ``PACKED`` in ``side_by_side``'s result."""
    return max(measured[name]["decode_tokens_per_s"] for name in ("source", PACKED) if name in measured)


def _measure(source: str, models: dict[str, Any], recipes: dict[str, Any], contexts: list[int], steps: int,
             rounds: int, batches: list[int], compiled: bool = False,
             static: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of one group of models timed side by side against ``models["source"]``; with ``compiled``, batch 1 also
    from static caches through ``torch.compile`` against the compiled source (``side_by_side(compiled=True)``); with
    ``static``, batch 1 also from static caches twice the context, eagerly, against the source's ``StaticCache``."""
    rows = []
    runs = [(c, b, "") for c in contexts for b in batches] + [(c, 1, "compiled") for c in contexts if compiled]
    runs += [(c, 1, "static") for c in contexts if static]
    for context, batch, mode in runs:
        # prefill in chunks of 2048 tokens
        measured = side_by_side(timed_at(models, batch), context, steps, rounds, batch=batch,
                                compiled=mode == "compiled", static=mode == "static",
                                capacity=2.0 if mode == "static" else None)  # fmt: skip
        source_speed, source_bytes = measured["source"]["decode_tokens_per_s"], measured["source"]["cache_bytes"]
        fastest = fastest_source(measured)
        for label, row in measured.items():
            rows.append({
                "source": source, "context": context, "batch": batch, "compiled": mode == "compiled",
                "static": mode == "static", "model": label,
                "recipe": recipes.get(label),
                "decode_tokens_per_s": row["decode_tokens_per_s"],
                "ratio_to_source": row["decode_tokens_per_s"] / source_speed,
                "ratio_to_fastest_source": row["decode_tokens_per_s"] / fastest,
                "cache_bytes_after_prefill": row["cache_bytes"],
                "cache_ratio_to_source": row["cache_bytes"] / source_bytes,
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
