"""A runtime change measured side by side: one converted checkpoint decoded through the runtime of another commit
(``--base``, its files copied into a second output directory and loaded with ``trust_remote_code=True``) and through
the working tree's (``kvconvert.load``), beside the source, all in one process (``eval.speed.side_by_side``: the
models take turns, the best round counts). On these noisy machines only such same-process ratios say whether a
change helped. ``--model mha`` is the random-weight MHA Llama the speed bench times slim on; ``llama8b-shape``
four random layers of Llama-3.1-8B's shapes (``bench.models.llama8b_shaped``); ``smollm2`` the default. Beside the
source as users run it, the source with its decode steps' query heads packed per KV head (``speed_bench.PACKED``), and
the ratios also against the faster of the two ("× fastest source").
``--quality N``: instead of speed, what a runtime change does to the output: both runtimes' KL to the source and
perplexity through the cache (the context protocol: the first ``--quality-context`` tokens of each window prefilled
in chunks of 512, the rest scored through the cache) on N tokens of the shipped wikitext-2 test. Writes
bench/results/NAME-<date>.{json,md}.

    python bench/runtime_ab.py --recipe '{"method": "slim"}' --model mha --contexts 4096,16384 --name ab-slim-pairs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import SHARED, llama8b_shaped, prepare_models  # noqa: E402
from bench.slim_bench import build_source  # noqa: E402
from bench.speed_bench import PACKED, _converted, fastest_source, timed_at  # noqa: E402
from kvconvert.eval.quality import FixedReference, evaluate_quality  # noqa: E402
from kvconvert.eval.speed import packed_decode, side_by_side  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="the conversion, as a JSON recipe")
    parser.add_argument("--model", choices=["smollm2", "mha", "llama8b-shape"], default="smollm2",
                        help="llama8b-shape: bench.models.llama8b_shaped, 4 layers (bfloat16 weights)")  # fmt: skip
    parser.add_argument("--base", default="HEAD", help="the commit whose runtime is the 'before'")
    parser.add_argument("--contexts", default="4096")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="runtime-ab")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the three models cast to it after loading (a bfloat16 checkpoint)")  # fmt: skip
    parser.add_argument("--static", action="store_true", help="decode from static caches, eagerly (batch 1)")
    parser.add_argument("--capacity", type=float, default=None, help="static caches hold this many times the context")
    parser.add_argument("--compiled", action="store_true",
                        help="static caches through torch.compile (batch 1), the source compiled too")  # fmt: skip
    parser.add_argument("--quality", type=int, default=0, metavar="TOKENS",
                        help="KL and perplexity through the cache on this many wikitext-2 tokens instead")  # fmt: skip
    parser.add_argument("--quality-context", type=int, default=1536, help="tokens of each 2048-token window prefilled")
    args = parser.parse_args()
    if 0 < args.quality < 2048:
        parser.error("--quality counts wikitext-2 tokens in windows of 2048: at least 2048")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    import kvconvert

    started = time.perf_counter()
    contexts = [int(c) for c in args.contexts.split(",")]
    base = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "mha":
            source = Path(tmp) / "mha"
            build_source(source, layers=8, max_positions=max(contexts) + args.steps + 8)
        elif args.model == "llama8b-shape":
            source = llama8b_shaped()
        else:
            source = prepare_models(include_smollm=True)["smollm2-135m"]
        new = _converted(source, json.loads(args.recipe), "converted", Path(tmp) / "new").eval()
        before = Path(tmp) / "before"
        subprocess.run(["cp", "-r", str(Path(tmp) / "new"), str(before)], check=True)
        for file in before.glob("*.py"):  # the base commit's runtime, loaded as remote code from its own directory
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{base}:kvconvert/runtime/{file.name}"],
                                   capture_output=True, text=True)  # fmt: skip
            if shown.returncode == 0:
                file.write_text(shown.stdout)
            else:  # a runtime file the base commit did not have
                file.unlink()
        models = {"source": AutoModelForCausalLM.from_pretrained(source).eval(),
                  f"runtime of {base}": AutoModelForCausalLM.from_pretrained(before, trust_remote_code=True).eval(),
                  "working tree": new}  # fmt: skip
        if args.model != "mha" and not args.quality:  # GQA: the source's heads packed too (MHA has none to pack)
            models[PACKED] = packed_decode(AutoModelForCausalLM.from_pretrained(source).eval())
        assert type(new).__module__.startswith(kvconvert.__name__)
        _taught_on(models[f"runtime of {base}"])
        models = {label: model.to(getattr(torch, args.dtype)) for label, model in models.items()}
        if args.quality:
            rows = _quality(models, args.quality, args.quality_context)
            contexts = []
        for context in contexts:
            for batch in (int(b) for b in args.batches.split(",")):
                measured = side_by_side(timed_at(models, batch), context, args.steps, args.rounds, batch=batch,
                                        static=args.static, capacity=args.capacity,
                                        compiled=args.compiled)  # fmt: skip
                speed, fastest = measured["source"]["decode_tokens_per_s"], fastest_source(measured)
                for label, row in measured.items():
                    rows.append({"context": context, "batch": batch, "model": label,
                                 "decode_tokens_per_s": row["decode_tokens_per_s"],
                                 "ratio_to_source": row["decode_tokens_per_s"] / speed,
                                 "ratio_to_fastest_source": row["decode_tokens_per_s"] / fastest})  # fmt: skip
                    print(rows[-1], flush=True)
    if args.quality:
        table = markdown_table(["model", "tokens scored", "ppl", "source ppl", "Δppl", "KL to the source", "top-1"],
                               [[r["model"], r["tokens"], f"{r['ppl']:.4f}", f"{r['reference_ppl']:.4f}",
                                 f"{100 * (r['ppl'] / r['reference_ppl'] - 1):+.2f} %", f"{r['kl_mean']:.5f}",
                                 f"{r['top1_agreement']:.4f}"] for r in rows])  # fmt: skip
    else:
        table = markdown_table(["context", "batch", "model", "decode tok/s", "× source", "× fastest source"],
                               [[r["context"], r["batch"], r["model"], f"{r['decode_tokens_per_s']:.2f}",
                                 f"{r['ratio_to_source']:.2f}", f"{r['ratio_to_fastest_source']:.2f}"]
                                for r in rows])  # fmt: skip
    payload = {"machine": machine(), "recipe": json.loads(args.recipe), "model": args.model, "base": base,
               "steps": args.steps, "rounds": args.rounds, "static": args.static, "capacity": args.capacity,
               "compiled": args.compiled, "quality_tokens": args.quality, "quality_context": args.quality_context,
               "dtype": args.dtype, "rows": rows,
               "seconds": time.perf_counter() - started}  # fmt: skip
    write_results(args.name, payload, table)


def _taught_on(model: Any) -> None:
    """A base runtime from before ``KVCONVERT_COMPILE=on`` (2026-12-07) knew ``auto`` (its readers built at first use:
    what ``on`` is now) and ``off``, and refuses ``on``, which the speed measurements set (``eval.speed.readers_built``)
    so that the working tree's readers are built too: taught ``on`` as a spelling of its ``auto``."""
    package = type(model).__module__.rpartition(".")[0]
    module = sys.modules.get(f"{package}.kvconvert_folded")
    choices = getattr(module, "COMPILE_CHOICES", None)
    if choices is not None and "on" not in choices:
        module.COMPILE_CHOICES = (*choices, "on")  # type: ignore[union-attr]


def _quality(models: dict[str, Any], tokens: int, context: int) -> list[dict[str, Any]]:
    """Both runtimes' quality through the cache against the source's on the same windows (2048 tokens each, the
    first ``context`` prefilled in chunks of 512)."""
    from transformers import AutoTokenizer

    source = models["source"]
    text = (SHARED / "data" / "wikitext2" / "wikitext2_raw_test.txt").read_text()
    tokenizer = AutoTokenizer.from_pretrained(source.config._name_or_path)
    ids = torch.tensor(tokenizer(text[: 8 * tokens])["input_ids"][:tokens])
    reference = FixedReference(source, ids, 2048, context)
    rows = []
    for label, model in models.items():
        if label == "source":
            continue
        result = evaluate_quality(model, ids, 2048, reference, chunk=512, context=context)
        rows.append({"model": label, "tokens": result.tokens, "ppl": result.ppl, "reference_ppl": result.reference_ppl,
                     "kl_mean": result.kl_mean, "top1_agreement": result.top1_agreement})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
