"""RazorAttention on SmolLM2-135M (``make bench-razor``).

KV bytes per token at 2K / 4K / 8K tokens (prompts fed in 1024-token chunks, so non-retrieval heads
drop tokens as the context grows), perplexity of one 4096-token wikitext-2 sequence fed in 512-token
chunks through the cache (single-forward perplexity would never exercise the dropping), and passkey
retrieval at 2048 tokens; original vs razor with the paper's settings. Writes
bench/results/razor-<date>.{json,md}.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import SHARED, prepare_models  # noqa: E402
from kvconvert.eval.memory import cache_nbytes  # noqa: E402
from kvconvert.eval.retrieval import passkey_accuracy  # noqa: E402
from kvconvert.eval.runner import load_for_eval  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods.razor.method import RazorConfig, RazorMethod  # noqa: E402
from kvconvert.pipeline import convert  # noqa: E402


@torch.no_grad()
def chunked(model: Any, ids: torch.Tensor, chunk: int) -> tuple[Any, float]:
    """Feed ``ids [1, n]`` chunk by chunk through the cache; return (cache, NLL sum of tokens 1..n-1)."""
    cache, nll = None, 0.0
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        out = model(piece, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logp = torch.log_softmax(out.logits[0].double(), -1)
        targets = ids[0, start + 1 : start + chunk + 1]
        nll -= logp[: targets.numel()].gather(-1, targets[:, None]).sum().item()
    return cache, nll


def main() -> None:
    started = time.perf_counter()
    src = prepare_models()["smollm2-135m"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "razor"
        method = RazorMethod(RazorConfig())
        result = convert(open_source(str(src)), method, dst, progress=False)
        spec = {k: result.report["params"][k] for k in ("induction_frac", "echo_frac", "sink", "window_frac")}
        share = method.report["retrieval_share"]
        models = {"original": load_for_eval(str(src)), "razor": load_for_eval(str(dst))}
        text = (SHARED / "data" / "wikitext2" / "wikitext2_raw_test.txt").read_text().replace("\r\n", "\n")
        tokenizer = models["original"][1]
        ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids[:8192])[None]
        for name, (model, tok) in models.items():
            row: dict[str, Any] = {"model": name}
            for length in (2048, 4096, 8192):
                cache, _ = chunked(model, ids[:, :length], 1024)
                row[f"kv_bytes_per_token@{length}"] = cache_nbytes(cache) / length
                print(name, length, row[f"kv_bytes_per_token@{length}"], flush=True)
            _, nll = chunked(model, ids[:, :4096], 512)
            row["ppl_chunked_4096"] = math.exp(nll / 4095)
            row["passkey@2048"] = passkey_accuracy(model, tok, 2048)
            print(row, flush=True)
            rows.append(row)
    original = rows[0]
    table_rows = []
    for row in rows:
        cells = [row["model"]]
        for length in (2048, 4096, 8192):
            key = f"kv_bytes_per_token@{length}"
            cells.append(f"{row[key]:.0f} ({row[key] / original[key]:.3f})")
        cells += [f"{row['ppl_chunked_4096']:.3f}", f"{row['passkey@2048']:.2f}"]
        table_rows.append(cells)
    table = markdown_table(
        ["model", "KV B/token @2K (ratio)", "@4K", "@8K", "ppl, 4096 tokens in 512-token chunks", "passkey @2K"],
        table_rows,
    )
    table += (
        f"\n\nRazor settings: {spec}, window {method.report['window']}, "
        f"{share:.1%} of KV heads kept whole (retrieval), profiled on {method.report['profile_tokens']}×4 tokens."
    )
    payload = {"benchmark": "razor", "machine": machine(), "settings": spec, "retrieval_share": share, "rows": rows,
               "seconds": time.perf_counter() - started}  # fmt: skip
    write_results("razor", payload, table)


if __name__ == "__main__":
    main()
