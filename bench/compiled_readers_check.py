"""The CPU readers ``torch.compile`` builds (``kvconvert_folded.fused_call``) against torch's eager ops in a whole
converted model: SmolLM2 converted by each recipe, 8 left-padded rows x 4096 tokens prefilled once (chunks of 2048),
then 4 greedy decode steps from copies of that cache with ``KVCONVERT_COMPILE=on`` and ``=off``; the largest logit
difference, the greedy tokens that agree, and the cache's bytes after the prefill. Writes JSON to ``--out``.

    python bench/compiled_readers_check.py --out bench/results/ab-kivi-rows-one-loop-exactness-2026-12-02.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.models import prepare_models  # noqa: E402
from bench.speed_bench import _converted  # noqa: E402
from kvconvert.eval.memory import cache_nbytes  # noqa: E402
from kvconvert.eval.speed import _prefill, ragged_batch  # noqa: E402
from kvconvert.runtime import kvconvert_compiled  # noqa: E402

RECIPES = {
    "kivi3": {"method": "quant", "kv_bits": 3, "kv_residual": 0, "kv_sink": 4},
    "kivi2": {"method": "quant", "kv_bits": 2, "kv_residual": 0, "kv_sink": 4},
    "razor-k3v2": {"method": "razor", "kv_budget": 0.5, "profile_tokens": 64, "kv_bits": 3, "kv_value_bits": 2,
                   "kv_residual": 0, "kv_sink": 4, "kv_rotate": True},
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    source = prepare_models()["smollm2-135m"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe in RECIPES.items():
            model = _converted(source, recipe, name, Path(tmp) / name)
            results[name] = _compare(model, args.context, args.rows, args.steps)
            print(name, results[name], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


@torch.inference_mode()
def _compare(model, context: int, rows: int, steps: int) -> dict:
    ids, mask = ragged_batch(model.config.vocab_size, context, rows, 0)
    state = _prefill(model, ids, 2048, mask, None)
    logits = {}
    for setting in ("on", "off"):
        os.environ["KVCONVERT_COMPILE"] = setting
        cache, token, seen, position = copy.deepcopy(state["cache"]), state["token"], state["mask"], state["next"]
        logits[setting] = []
        for _ in range(steps):
            seen = torch.cat([seen, seen.new_ones(seen.shape[0], 1)], dim=1)
            out = model(token, past_key_values=cache, use_cache=True, attention_mask=seen, position_ids=position)
            position = position + 1
            logits[setting].append(out.logits[:, -1].float())
            token = logits[setting][-1].argmax(-1, keepdim=True)
    os.environ.pop("KVCONVERT_COMPILE")
    compiled, eager = torch.stack(logits["on"]), torch.stack(logits["off"])
    return {"max_abs_logit_diff": (compiled - eager).abs().max().item(), "logit_scale": compiled.abs().max().item(),
            "greedy_tokens_equal": int((compiled.argmax(-1) == eager.argmax(-1)).sum()),
            "tokens": compiled.shape[:2].numel(),
            "fused_readers_built": sorted(k for k, v in kvconvert_compiled._FUSED.items() if v is not False),
            "cache_bytes_after_prefill": cache_nbytes(state["cache"])}  # fmt: skip


if __name__ == "__main__":
    main()
