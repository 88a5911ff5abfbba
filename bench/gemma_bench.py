"""Gemma 3 270M (``make bench-gemma``): every method on a model with QK-norm, MQA (4 query heads, 1 KV
head of 256), and five sliding-window layers (window 512) per global one.

For each candidate: convert (or record the method's refusal and its reason), load with
``trust_remote_code=True``, generate greedily, measure the cache's bytes per token of the global and
the local layers separately (from the live cache objects, after prefills of two lengths beyond the
window: local layers must not grow), and score the context-compression protocol (each window's
first 1536 tokens into the cache in one forward, the next 512 scored through it) on wikitext-2 test.
Writes bench/results/gemma-<date>.{json,md}.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import eval_texts, prepare_models  # noqa: E402
from kvconvert.errors import KVConvertError  # noqa: E402
from kvconvert.eval.memory import cache_nbytes  # noqa: E402
from kvconvert.eval.runner import EvalConfig, run_eval  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods import build_method  # noqa: E402
from kvconvert.pipeline import convert  # noqa: E402
from kvconvert.recipe import parse_recipe  # noqa: E402

CONTEXT, CONTINUATION, WINDOWS = 1536, 512, 2
SHORT, LONG = 1024, 2048  # prefill lengths for bytes per token: both beyond the 512-token window
EXT = {"kv_residual": 0, "kv_sink": 4, "kv_rotate": True}
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    ("quant 4-bit, residual 0", {"method": "quant", "kv_bits": 4, "kv_residual": 0}),
    (
        "quant 4-bit, residual 0, local layers too",
        {"method": "quant", "kv_bits": 4, "kv_residual": 0, "kv_include_local": True},
    ),  # fmt: skip
    (
        "quant 4-bit, sink 4 + rotated values (ext.), local layers too",
        {"method": "quant", "kv_bits": 4, **EXT, "kv_include_local": True},
    ),  # fmt: skip
    ("quant 3-bit, sink 4 + rotated values (ext.)", {"method": "quant", "kv_bits": 3, **EXT}),
    ("razor (paper defaults)", {"method": "razor", "profile_tokens": 256}),
    ("razor 0.5", {"method": "razor", "kv_budget": 0.5, "profile_tokens": 256}),
    ("minicache (paper defaults)", {"method": "minicache"}),
    ("lorc k 0.75", {"method": "lorc", "kv_budget": 0.75, "compress": "k"}),
    ("zack 0.5", {"method": "zack", "kv_budget": 0.5}),
    ("zack 0.5, widths by measured loss (ext.)", {"method": "zack", "kv_budget": 0.5, "schedule": "auto"}),
    ("zack 0.5 + 4-bit, sink 4 + rotated values (ext.)", {"method": "zack", "kv_budget": 0.5, "kv_bits": 4, **EXT}),
    ("slim", {"method": "slim"}),
]


@torch.no_grad()
def bytes_per_token_by_kind(model: Any, ids: torch.Tensor) -> dict[str, float]:
    """Growth of cache bytes per token between SHORT and LONG tokens (a prefill and one decode step), for
    the global and the sliding-window layers separately."""
    sizes: dict[str, list[int]] = {"global": [], "local": []}
    for length in (SHORT, LONG):
        # logits of the last position only: 262k-token vocabulary × 2048 positions would be 2 GB
        cache = model(ids[:, : length - 1], use_cache=True, logits_to_keep=1).past_key_values
        # one decode step: transformers' sliding layer keeps a view of the whole prefill until the next update
        cache = model(ids[:, length - 1 : length], past_key_values=cache, use_cache=True).past_key_values
        for kind, sliding in (("global", False), ("local", True)):
            layers = [layer for layer in cache.layers if bool(getattr(layer, "is_sliding", False)) == sliding]
            sizes[kind].append(sum(cache_nbytes(layer) for layer in layers))
        del cache
    return {kind: (b - a) / (LONG - SHORT) for kind, (a, b) in sizes.items()}


def main() -> None:
    import argparse

    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="the candidates whose label contains this text")
    parser.add_argument("--name", default="gemma", help="bench/results/NAME-<date>.{json,md}")
    args = parser.parse_args()
    started = time.perf_counter()
    src = prepare_models(include_smollm=False, include_gemma=True)["gemma3-270m"]
    reference = transformers.Gemma3ForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        text = eval_texts(Path(tmp))["wikitext2"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
        ids = tokenizer(text.read_text()[:40000], return_tensors="pt").input_ids[:, :LONG]
        stock = bytes_per_token_by_kind(reference, ids)
        eval_config = EvalConfig(data=str(text), max_tokens=WINDOWS * (CONTEXT + CONTINUATION), context=CONTEXT,
                                 continuation=CONTINUATION, retrieval=False, speed=False, progress=False)  # fmt: skip
        rows: list[dict[str, Any]] = []
        for label, recipe in CANDIDATES:
            if args.only is not None and args.only not in label:
                continue
            name, config, storage = parse_recipe(recipe, label)
            dst = Path(tmp) / "candidate"
            row: dict[str, Any] = {"candidate": label, "recipe": recipe}
            t0 = time.perf_counter()
            try:
                convert(open_source(str(src)), build_method(name, config, storage), dst, replace=True,
                        progress=False)  # fmt: skip
            except KVConvertError as exc:
                row["refused"] = str(exc)
                print(f"{label:<40} refused: {exc}", flush=True)
                rows.append(row)
                continue
            row["convert_seconds"] = time.perf_counter() - t0
            model = transformers.AutoModelForCausalLM.from_pretrained(str(dst), trust_remote_code=True).eval()
            prompt = tokenizer("The capital of France is", return_tensors="pt")
            out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
            row["generated"] = tokenizer.decode(out[0, prompt.input_ids.shape[1] :])
            row["bytes_per_token"] = bytes_per_token_by_kind(model, ids)
            del model
            result = run_eval(str(dst), str(src), eval_config)
            row.update({k: result[k] for k in ("ppl", "reference_ppl", "kl_mean", "top1_agreement",
                                               "kv_budget_vs_16bit", "seconds")})  # fmt: skip
            row["dppl_pct"] = 100 * (row["ppl"] / row["reference_ppl"] - 1)
            print(f"{label:<40} budget {row['kv_budget_vs_16bit']:.3f}  Δppl {row['dppl_pct']:+.2f} %  "
                  f"global {row['bytes_per_token']['global']:.0f} B/token", flush=True)  # fmt: skip
            rows.append(row)
    table = markdown_table(
        ["candidate", "KV budget vs 16-bit (ctx 1536)", "Δppl", "KL", "top-1", "global B/token", "local B/token",
         "greedy continuation of 'The capital of France is'"],
        [[r["candidate"], "refused", "", "", "", "", "", r["refused"]] if "refused" in r else
         [r["candidate"], f"{r['kv_budget_vs_16bit']:.3f}", f"{r['dppl_pct']:+.2f} %", f"{r['kl_mean']:.4f}",
          f"{r['top1_agreement']:.3f}", f"{r['bytes_per_token']['global']:.0f}",
          f"{r['bytes_per_token']['local']:.0f}", repr(r["generated"])] for r in rows],
    )  # fmt: skip
    table += (
        f"\n\nGemma 3 270M (gemma3_text, Q4_K_M GGUF dequantised to fp32), wikitext-2 test, {WINDOWS} windows of "
        f"{CONTEXT} context + {CONTINUATION} scored tokens. Bytes per token: growth of the live cache between "
        f"prefills of {SHORT} and {LONG} tokens (fp32 run); stock: global {stock['global']:.0f}, local "
        f"{stock['local']:.0f}. Local layers hold at most their 512-token window, so they do not grow."
    )
    payload = {"benchmark": "gemma", "machine": machine(), "stock_bytes_per_token": stock, "rows": rows,
               "seconds": time.perf_counter() - started}  # fmt: skip
    write_results(args.name, payload, table)


if __name__ == "__main__":
    main()
