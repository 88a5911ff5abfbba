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
Expected KV-cache size: **{budget:.1%}** of {of} per token{where}.

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


def is_eval_result(data: Any) -> bool:
    """Is ``data`` (parsed JSON) what ``eval --json`` writes? (``--json`` replaces only such a file, and the
    card reads only such a file.)"""
    return isinstance(data, dict) and (
        {"ppl", "kv_bytes_per_token", "tokens", "ctx"} <= set(data) or {"tasks", "lengths", "accuracy"} <= set(data)
    )


def _details(report: dict[str, Any]) -> str:
    """The method's own paragraph (``Method.describe``), then the cache storage when quantized."""
    from kvconvert.methods import METHODS

    text = METHODS[report["method"]].method.describe(report)
    storage = report.get("kv_storage")
    if storage and storage.get("format") == "fp8":
        per = "KV head" if storage["scale_strategy"] == "head" else "layer"
        text += (
            f"\n\nThe cache is stored as float8 e4m3 with static scales (one per {per}, calibrated on text), "
            "written as compressed-tensors' `kv_cache_scheme` with `self_attn.k_scale` / `v_scale` tensors: vLLM "
            "and SGLang serve this directory as it is (`vllm serve DIR` picks the fp8 cache by itself), and "
            "stock transformers 5.23 loads it without remote code when `compressed-tensors` is installed (5.24 and "
            "later load it too, but with compressed-tensors 0.20.1 leave the cache unquantized)."
        )
    elif storage and storage.get("layout") == "token":
        text += (
            f"\n\nThe cache is stored as 4-bit integers in kvconvert's token layout: keys minus each "
            f"{storage['group']}-token block's per-channel mean, and values, rotated (randomized Hadamard) and "
            "quantized per token in torch's int4 matrix layout, so CPU decoding reads the codes without "
            f"dequantizing; the newest {storage['residual']} tokens stay unquantized. On an NVIDIA GPU with Triton "
            "the runtime's own kernel reads the codes; without Triton every decode step dequantizes the whole cache."
        )
    elif storage:
        widths = f"{storage['bits']}-bit integers"
        if "value_bits" in storage:
            widths = f"integers, keys at {storage['bits']} bits and values at {storage['value_bits']}"
        text += (
            f"\n\nThe cache is stored as {widths} (keys per channel over blocks of "
            f"{storage['group']} tokens, values per token in groups of up to {storage['group']} channels, fp16 "
            f"scale and zero per group); the newest {storage['residual']} tokens stay unquantized."
        )
    return text


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
    """Write README.md into ``directory``; ``name`` is what users load it by (output dir or Hub repo id)."""
    (directory / "README.md").write_text(model_card(report, name, evaluation))


def _at_lengths(report: dict[str, Any]) -> str:
    """A model with sliding-window layers: its budget at given lengths (the windows' share shrinks with it)."""
    at = report.get("kv_budget_at_tokens")
    if not at:
        return ""
    lengths = ", ".join(f"{b:.1%} at {n} tokens" for n, b in at.items())
    return f" (sliding-window layers counted as held: {lengths})"


def model_card(report: dict[str, Any], name: str, evaluation: dict[str, Any] | None = None) -> str:
    """The model card's text. Hub metadata names ``base_model`` only for Hub sources (a local path is
    not a model id)."""
    base_model = report["source"]["model"]
    is_hub = not base_model.startswith("/")
    return _CARD.format(
        base_model_line=f"base_model: {base_model}\n" if is_hub else "",
        source=f"[{base_model}](https://huggingface.co/{base_model})" if is_hub else f"`{Path(base_model).name}`",
        measured=_measured(evaluation),
        title=f"{Path(base_model).name}-{report['method']}",
        method=report["method"],
        version=report["tool_version"],
        budget=report.get("kv_budget_expected_vs_16bit", report["kv_budget_expected"]),
        of="a 16-bit cache" if "kv_budget_expected_vs_16bit" in report else "the original",
        where=(" at long context" if "kv_budget_expected_vs_16bit" in report else "") + _at_lengths(report),
        details=_details(report),
        repo=name,
    )
