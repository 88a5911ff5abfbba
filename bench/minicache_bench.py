"""MiniCache on SmolLM2-135M (``make bench-minicache``).

Quality as the number of merged layers grows (paper fig. 4), SLERP vs plain averaging (table G),
with/without token retention (table 2), and kvconvert's shared-subspace merge (``--merge subspace``, an
extension after xKV) at several budgets, alone and with 4-bit storage of its latents, on wikitext-2 test
(first 2048 tokens, ctx 1024). Merging
only touches states that later tokens read from the cache, so the converted model is fed ONE token
at a time (``--chunk 1``, i.e. every token is a decode step); the reference runs one forward per
window. KV bytes per token are measured from the cache after a 512-token prefill, and compared
with the accounting of ``kvconvert.methods.minicache.kv_bytes_per_token`` at the retained shares
counted in a 1024-token prefill cache. Also records the adjacent-layer similarity measured on the
shipped calibration text. Writes bench/results/minicache-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, markdown_table, write_results  # noqa: E402
from bench.models import smollm2_wikitext  # noqa: E402
from kvconvert.arch import adapter_for  # noqa: E402
from kvconvert.eval.runner import load_for_eval, run_eval  # noqa: E402
from kvconvert.io.source import open_source  # noqa: E402
from kvconvert.methods.minicache.layer_similarity import measure_layer_similarity  # noqa: E402
from kvconvert.methods.minicache.method import (  # noqa: E402
    MiniCacheConfig,
    MiniCacheMethod,
    kv_bytes_per_token,
    subspace_bytes_per_token,
)
from kvconvert.pipeline import convert  # noqa: E402
from kvconvert.runtime.kvconvert_codec import QuantSpec  # noqa: E402


@torch.no_grad()
def retained_shares(model_dir: Path, ids: torch.Tensor) -> tuple[float, float]:
    """Share of (token, pair) entries kept unmerged for K and V after one prefill of ``ids [1, n]``."""
    model = load_for_eval(str(model_dir))[0]
    cache = model(ids, use_cache=True).past_key_values
    states = [layer for layer in cache.layers if getattr(layer, "pair", None) is layer]
    if not states or not hasattr(states[0], "keys_merged"):  # none merged, or a subspace merge (retains none)
        return 0.0, 0.0
    total = len(states) * ids.numel()
    return (sum(s.keys_merged.retained.shape[0] for s in states) / total,
            sum(s.values_merged.retained.shape[0] for s in states) / total)  # fmt: skip


def jobs(num_layers: int) -> list[tuple[str, MiniCacheConfig, int]]:
    """(study, config, storage bits) per row."""
    default = MiniCacheConfig()  # S = L/2, t = 0.6, γ = 0.05, SLERP
    out: list[tuple[str, MiniCacheConfig]] = [("paper default", default)]
    for pairs in (1, 2, 4, 7, 10, 15):  # the deepest 2, 4, 8, 14, 20, 30 layers
        out.append(("merged layers", replace(default, start_layer=num_layers - 2 * pairs)))
    out.append(("merge function", replace(default, merge="average", gamma=0.0)))  # the paper's mean baseline
    out.append(("merge function", replace(default, merge="average")))
    for gamma in (0.0, 0.2, 1.0):
        out.append(("retention", replace(default, gamma=gamma)))
    rows = [(study, config, 16) for study, config in out]
    for budget in (0.75, 0.5, 0.3):  # every pair merged, latent widths allocated by loss (extension)
        rows.append(("subspace (ext.)", MiniCacheConfig(merge="subspace", kv_budget=budget), 16))
    rows.append(("subspace (ext.) + 4-bit", MiniCacheConfig(merge="subspace", kv_budget=0.75), 4))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=1)
    parser.add_argument("--only", default=None, help="studies whose label contains this text")
    parser.add_argument("--name", default="minicache", help="results file stem (bench/results/NAME-<date>.*)")
    args = parser.parse_args()
    started = time.perf_counter()
    src, base_config, base = smollm2_wikitext(args.max_tokens)
    config = replace(base_config, chunk=args.chunk)
    source = open_source(str(src))
    layout = adapter_for(source.config).layout()
    similarity = measure_layer_similarity(source, progress=False)
    print({"similarity_pairs": len(similarity["pairs"])}, flush=True)
    model, tokenizer = load_for_eval(str(src))
    text = Path(config.data).read_text()
    prefill = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids[:1024])[None]
    del model
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (study, minicache, bits) in enumerate(jobs(layout.num_layers)):
            if args.only is not None and args.only not in study:
                continue
            dst = Path(tmp) / f"job{index}"
            method = MiniCacheMethod(minicache)
            method.storage = QuantSpec(bits=bits, residual=0) if bits < 16 else QuantSpec()
            result = convert(open_source(str(src)), method, dst, progress=False)
            plan = result.report["plan"]
            evaluation = run_eval(str(dst), str(src), config)
            share_k, share_v = retained_shares(dst, prefill)
            if minicache.merge == "subspace":  # quantized latents: the codes alone (scales not counted)
                predicted, original = subspace_bytes_per_token(layout, [tuple(r) for r in plan["ranks"]], 4)
                predicted = predicted * bits / 32 if bits < 16 else predicted
            else:
                predicted, original = kv_bytes_per_token(layout, len(plan["pairs"]), 4, share_k, share_v,
                                                         minicache.merge)  # fmt: skip
            row = {
                "study": study, "start_layer": plan["start_layer"], "merged_layers": 2 * len(plan["pairs"]),
                "merge": minicache.merge, "t": minicache.t, "gamma": minicache.gamma, "bits": bits,
                # unquantized rows: the cache in the model's own dtype (what a 16-bit model's would be in 16 bits)
                "kv_budget_vs_16bit": evaluation["kv_budget_measured"] if bits == 16
                else evaluation["kv_bytes_per_token"] / (2 * layout.num_layers * layout.kv_width * 2),
                **{k: evaluation[k] for k in ("ppl", "kl_mean", "top1_agreement", "kv_bytes_per_token",
                                              "kv_budget_measured")},
                "retained_k": share_k, "retained_v": share_v, "kv_budget_accounted": predicted / original,
            }  # fmt: skip
            rows.append(row)
            print(row, flush=True)
            del method, result
    payload = {
        "benchmark": "minicache",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)",
        "data": f"wikitext-2 test, first {args.max_tokens} tokens, ctx {config.ctx}, model fed {args.chunk} token(s) "
        "per forward through its cache",
        "reference": {k: base[k] for k in ("ppl", "tokens", "ctx")} | {"kv_bytes_per_token": 2 * 30 * 192 * 4},
        "layer_similarity": similarity,
        "rows": rows,
        "machine": machine(),
        "seconds": time.perf_counter() - started,
    }
    headers = ["study", "S", "merged layers", "merge", "γ", "bits", "ppl", "KL", "top-1", "KV bytes/token",
               "budget (measured)", "budget (accounting)", "budget vs 16-bit", "retained K/V"]  # fmt: skip
    table_rows = [["original", "-", 0, "-", "-", 16, f"{base['ppl']:.2f}", "0", "1", 46080, "1.000", "1.000", "1.000",
                   "-"]]  # fmt: skip
    for r in rows:
        table_rows.append([
            r["study"], r["start_layer"], r["merged_layers"], r["merge"], r["gamma"], r["bits"], f"{r['ppl']:.2f}",
            f"{r['kl_mean']:.3f}", f"{r['top1_agreement']:.3f}", f"{r['kv_bytes_per_token']:.0f}",
            f"{r['kv_budget_measured']:.3f}", f"{r['kv_budget_accounted']:.3f}", f"{r['kv_budget_vs_16bit']:.3f}",
            f"{r['retained_k']:.1%} / {r['retained_v']:.1%}",
        ])  # fmt: skip
    sim_rows = [[f"{p['layers'][0]}-{p['layers'][1]}", f"{p['cos_k']:.3f}", f"{p['cos_v']:.3f}",
                 f"{p['retained_k']:.1%}", f"{p['retained_v']:.1%}"] for p in similarity["pairs"]]  # fmt: skip
    table = (
        f"MiniCache on SmolLM2-135M, {payload['data']}.\n\n"
        + markdown_table(headers, table_rows)
        + f"\n\nAdjacent-layer similarity on {similarity['calib']} ({similarity['tokens']} tokens): mean per-token "
        "cosine of the layer's K (V) vectors over all KV heads, and the share eq. 4 keeps unmerged at γ = "
        f"{similarity['gamma']}.\n\n" + markdown_table(["pair", "cos K", "cos V", "kept K", "kept V"], sim_rows)
    )
    write_results(args.name, payload, table)


if __name__ == "__main__":
    main()
