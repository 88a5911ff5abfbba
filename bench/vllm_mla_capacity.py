"""Does a ``lorc --latent mla`` export hold more tokens inside vLLM? On SmolLM2 it cannot (its 384 cached values per
token and layer are fewer than the 512 + 64 that vLLM's CPU MLA kernel takes), so this runs a model shaped like
the ones it can: a Llama with 8 KV heads of 64 (1024 values per token and layer, Llama-3.2-1B's attention),
2 layers, random weights (fixed seed) and SmolLM2's tokenizer, exported at ``--kv-budget 0.5625`` (512 + 64).
vLLM reports its KV capacity for the source and the export in the same memory, and the export's perplexity on
wikitext-2 beside kvconvert's own evaluation of it (both numbers are of a random model: the point is that they
agree and that the capacity grows 1/budget). Part of ``make bench-vllm``; writes
bench/results/vllm-cpu-mla-capacity-<date>.{json,md}.

    python bench/vllm_mla_capacity.py --engine-python bench/.cache/venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import CACHE, prepare_models  # noqa: E402
from bench.vllm_bench import CONTEXT, SCORED, kvconvert_side, run_engine, token_windows  # noqa: E402

BUDGET = 0.5625  # (512 + 64) / (2 · 8 · 64): the cache size vLLM's CPU MLA kernel takes


def synthetic_source(out: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer Llama with Llama-3.2-1B's attention geometry (32 heads, 8 KV heads of 64), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=2048, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-python", required=True, help="python of the virtualenv with vllm-cpu")
    parser.add_argument("--windows", type=int, default=2)
    args = parser.parse_args()
    started = time.time()

    from kvconvert.io.source import open_source
    from kvconvert.methods import LorcConfig, build_method
    from kvconvert.pipeline import convert

    smollm = prepare_models()["smollm2-135m"]
    work = CACHE / "vllm-mla-capacity"
    work.mkdir(parents=True, exist_ok=True)
    source = synthetic_source(work / "llama-8kv-64", smollm)
    export = work / f"llama-8kv-64-mla-{BUDGET}"
    method = build_method("lorc", LorcConfig(kv_budget=BUDGET, latent="mla", calib_tokens=4096))
    convert(open_source(str(source)), method, export, replace=True, progress=False)
    scored, prompts, _ = token_windows(smollm, args.windows)
    inputs = work / "inputs.json"
    inputs.write_text(json.dumps({"windows": scored, "context": CONTEXT, "prompts": prompts[:2], "new_tokens": 16}))

    results = {}
    for label, model_dir, extra in (("source", source, ()),
                                    ("MLA export", export, ("--attention-backend", "CPU_MLA"))):  # fmt: skip
        print(f"{label}: vLLM …", flush=True)
        engine = run_engine(args.engine_python, model_dir, inputs, work / f"{label.replace(' ', '-')}.json",
                            work / f"{label.replace(' ', '-')}.log", extra=extra)  # fmt: skip
        results[label] = {"vllm": engine, "kvconvert": kvconvert_side(model_dir, scored, prompts[:2], 16)}
    base = results["source"]["vllm"]["cache"]["kv_capacity_tokens"]
    rows = []
    for label, entry in results.items():
        engine, ours = entry["vllm"], entry["kvconvert"]
        capacity = engine["cache"]["kv_capacity_tokens"]
        rows.append([label, capacity, f"{capacity / base:.2f}×", f"{engine['quality']['ppl']:.4f}",
                     f"{ours['ppl']:.4f}", f"{100 * (engine['quality']['ppl'] / ours['ppl'] - 1):+.3f} %"])  # fmt: skip
    table = (
        f"vLLM {results['source']['vllm'].get('vllm_version', '')} CPU build, float32, VLLM_CPU_KVCACHE_SPACE=2 GiB; "
        f"a 2-layer Llama with 32 heads and 8 KV heads of 64 (random weights, seed 0), `lorc --latent mla "
        f"--kv-budget {BUDGET}` (kv_lora_rank 512 + RoPE 64, vLLM's reference CPU MLA backend); perplexity of the "
        f"random model on {args.windows} wikitext-2 windows ({CONTEXT} + {SCORED} scored)\n\n"
        + markdown_table(
            ["model", "vLLM KV capacity (tokens)", "× source", "vLLM ppl", "kvconvert ppl", "vLLM vs kvconvert"], rows
        )  # fmt: skip
    )
    payload = {"machine": machine(), "budget": BUDGET, "results": results, "seconds": time.time() - started}
    write_results("vllm-cpu-mla-capacity", payload, table)


if __name__ == "__main__":
    main()
