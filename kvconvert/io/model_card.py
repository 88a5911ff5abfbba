"""README.md model card written into every output directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CARD = """---
{base_model_line}library_name: transformers
tags:
- kvconvert
- {method}
---

# {title}

`{method}` conversion of {source} made with kvconvert {version}.
Expected KV-cache size: **{budget:.1%}** of the original per token.

{details}
{measured}
## Load

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True)
```

or, without executing the code shipped in this repository (needs `pip install kvconvert`):

```python
import kvconvert
model = kvconvert.load("{repo}")
```

Conversion details (per-layer decisions and errors, source sha256) are in `kvconvert.json`.
"""


def _details(report: dict[str, Any]) -> str:
    if report["method"] == "lorc":
        ranks = [r["rank_k"] for r in report["layers"]]
        return (
            "LoRC caches rank-d_c latents of K and V (low-rank W_K, W_V by SVD; U_V folded into W_O). "
            f"Schedule {report['params']['schedule']}, factored {report['params']['compress']}; "
            f"K ranks per layer: {ranks}."
        )
    if report["method"] == "slim":
        worst = max(report["layers"], key=lambda r: r["v_rel_error"])
        return (
            "Slim attention caches only K and computes V = K·W_KV (exact up to rounding). "
            f"Largest κ(W_K): {max(r['kappa_k'] for r in report['layers']):.3g}; largest relative V error "
            f"on random inputs in {report['dtype']}: {worst['v_rel_error']:.2e} (layer {worst['layer']})."
        )
    if report["method"] == "razor":
        kept = sum(len(r["retrieval_kv_heads"]) for r in report["layers"])
        return (
            f"RazorAttention keeps the full cache for {kept} retrieval KV heads; the others keep "
            f"{report['params']['sink']} sink tokens, a recent window and one compensation token."
        )
    if report["method"] == "zack":
        widths = [sum(r["rank_k"]) + sum(r["rank_v"]) for r in report["layers"]]
        return (
            "ZACK caches K and V in calibrated per-head rotated bases, truncated to adaptive widths; attention "
            f"runs in the compressed space. Cached K+V width per layer: {widths}."
        )
    if report["method"] == "minicache":
        plan = report["plan"]
        pairs = ", ".join(f"{a}-{b}" for a, b in plan["pairs"]) or "none"
        return (
            f"MiniCache: adjacent layer pairs ({pairs}) share one K and one V direction tensor "
            f"(SLERP, t = {plan['t']}) plus per-token norms of each layer; tokens at the far end of the "
            f"distance range (γ = {plan['gamma']}) are kept unmerged. Only cached states are merged, so quality "
            "shows when text is decoded through the cache (`kvconvert eval --chunk 1`), not in a single forward."
        )
    return ""


def _measured(evaluation: dict[str, Any] | None) -> str:
    """Quality section from ``kvconvert eval --json`` results, when the directory has them."""
    if not evaluation or evaluation.get("reference_ppl") is None:
        return ""
    return (
        "## Measured quality\n\n"
        "| data | tokens | ctx | ppl | reference ppl | KL(ref‖model) | top-1 agreement | measured KV budget |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {Path(str(evaluation['data'])).name} | {evaluation['tokens']} | {evaluation['ctx']} | "
        f"{evaluation['ppl']:.3f} | {evaluation['reference_ppl']:.3f} | {evaluation['kl_mean']:.3g} | "
        f"{evaluation['top1_agreement']:.4f} | {evaluation['kv_budget_measured']:.3f} |\n\n"
        "Measured with `kvconvert eval` (KV bytes from the live cache objects).\n"
    )


def write_model_card(
    directory: Path, report: dict[str, Any], name: str, evaluation: dict[str, Any] | None = None
) -> None:
    """Write README.md into ``directory``; ``name`` is what users load it by (output dir or Hub repo id).

    Hub metadata names ``base_model`` only for Hub sources (a local path is not a model id).
    """
    base_model = report["source"]["model"]
    is_hub = not base_model.startswith("/")
    text = _CARD.format(
        base_model_line=f"base_model: {base_model}\n" if is_hub else "",
        source=f"[{base_model}](https://huggingface.co/{base_model})" if is_hub else f"`{Path(base_model).name}`",
        measured=_measured(evaluation),
        title=f"{Path(base_model).name}-{report['method']}",
        method=report["method"],
        version=report["tool_version"],
        budget=report["kv_budget_expected"],
        details=_details(report),
        repo=name,
    )
    (directory / "README.md").write_text(text)
