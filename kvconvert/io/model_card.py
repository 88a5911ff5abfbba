"""README.md model card written into every output directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CARD = """---
base_model: {base_model}
library_name: transformers
tags:
- kvconvert
- {method}
---

# {title}

`{method}` conversion of [{base_model}]({base_link}) made with kvconvert {version}.
Expected KV-cache size: **{budget:.0%}** of the original per token.

{details}

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
    if report["method"] == "slim":
        worst = max(report["layers"], key=lambda r: r["v_rel_error"])
        return (
            "Slim attention caches only K and computes V = K·W_KV (exact up to rounding). "
            f"Largest κ(W_K): {max(r['kappa_k'] for r in report['layers']):.3g}; largest relative V error "
            f"on random inputs in {report['dtype']}: {worst['v_rel_error']:.2e} (layer {worst['layer']})."
        )
    return ""


def write_model_card(directory: Path, report: dict[str, Any], name: str) -> None:
    """Write README.md into ``directory``; ``name`` is the final output directory's name."""
    base_model = report["source"]["model"]
    is_hub = not base_model.startswith("/")
    text = _CARD.format(
        base_model=base_model if is_hub else Path(base_model).name,
        base_link=f"https://huggingface.co/{base_model}" if is_hub else base_model,
        title=f"{Path(base_model).name}-{report['method']}",
        method=report["method"],
        version=report["tool_version"],
        budget=report["kv_budget_expected"],
        details=_details(report),
        repo=name,
    )
    (directory / "README.md").write_text(text)
