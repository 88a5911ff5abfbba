"""One model inside vLLM (CPU build): what it loaded, perplexity from prompt logprobs, greedy generations,
throughput and KV capacity. Runs in ``make bench-vllm``'s own virtualenv (vLLM pins its own transformers),
so it imports nothing from kvconvert: token ids in, numbers out, as JSON.

    python bench/vllm_engine.py --model DIR --windows windows.json --context 1536 --out result.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any


def loaded_cache(llm: Any) -> dict[str, Any]:
    """The cache vLLM built: its dtype, capacity in tokens, and each attention layer's k/v scales as loaded
    (so an export whose scales were silently ignored shows 1.0 here)."""
    engine_config = llm.llm_engine.vllm_config
    cache = engine_config.cache_config
    info: dict[str, Any] = {
        "kv_cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "num_blocks": getattr(cache, "num_gpu_blocks", None) or getattr(cache, "num_cpu_blocks", None),
        "quantization": getattr(engine_config.model_config, "quantization", None),
    }
    if info["num_blocks"]:
        info["kv_capacity_tokens"] = int(info["num_blocks"]) * int(cache.block_size)

    def scales(model: Any) -> list[list[float]]:
        found = []
        for module in model.modules():
            if hasattr(module, "_k_scale_float") and hasattr(module, "_v_scale_float"):
                found.append([float(module._k_scale_float), float(module._v_scale_float)])
        return found

    try:  # the model lives in the engine core's process: ask it
        per_worker = llm.collective_rpc(lambda self: scales(self.model_runner.model))
        info["kv_scales"] = per_worker[0]
    except Exception as exc:  # noqa: BLE001 - a diagnostic only; the scales still show in the perplexity
        info["kv_scales_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return info


def perplexity(llm: Any, windows: list[list[int]], context: int) -> dict[str, Any]:
    """The context protocol from prompt logprobs: each window in one prefill (every token reads keys and
    values through vLLM's cache, its own included), the tokens after the first ``context`` scored."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, output in zip(windows, outputs, strict=True):
        for position in range(context, len(window)):
            entry = output.prompt_logprobs[position]
            nll -= entry[window[position]].logprob
            count += 1
    return {"ppl": math.exp(nll / count), "tokens": count}


def greedy(llm: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def throughput(llm: Any, prompt: list[int], batch: int, new_tokens: int, rounds: int = 2) -> float:
    """Generated tokens per second for ``batch`` copies of ``prompt`` (prefill included), best of ``rounds``."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)] * batch, params, use_tqdm=False)
        best = max(best, batch * new_tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--inputs", required=True, help="JSON: windows, context, prompts, new_tokens, speed")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--attention-backend", default=None, help="vLLM's attention backend (default: its choice)")
    args = parser.parse_args()

    import os

    # the k/v scales are read back from the engine core through collective_rpc, which pickles a function
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import vllm
    from vllm import LLM

    inputs = json.loads(Path(args.inputs).read_text())
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
              seed=0, enforce_eager=True, enable_prefix_caching=False, trust_remote_code=False,
              attention_config={"backend": args.attention_backend} if args.attention_backend else None)  # fmt: skip
    result: dict[str, Any] = {"model": args.model, "vllm_version": vllm.__version__,
                              "load_s": round(time.perf_counter() - start, 1)}  # fmt: skip
    result["cache"] = loaded_cache(llm)
    result["quality"] = perplexity(llm, inputs["windows"], inputs["context"])
    result["greedy"] = greedy(llm, inputs["prompts"], inputs["new_tokens"])
    speed = inputs.get("speed") or {}
    batches = speed.get("batches", ())
    result["tokens_per_s"] = {str(b): throughput(llm, speed["prompt"], b, speed["new_tokens"]) for b in batches}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":  # the engine core is a spawned process: guard the entry point
    main()
