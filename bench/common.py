"""Helpers shared by the benchmarks: results files, machine description, timing."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
CALIB_DATA = Path(__file__).resolve().parents[1] / "kvconvert" / "calib_data"


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # glibc's allocator settings move the source's speed most (its dynamic cache copies itself every step)
        "allocator_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"},
    }


def write_results(name: str, payload: dict[str, Any], table: str) -> tuple[Path, Path]:
    """Write ``results/<name>-<date>.json`` and ``.md``, print the table and where it went; return both paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{dt.date.today().isoformat()}"
    json_path, md_path = RESULTS / f"{stem}.json", RESULTS / f"{stem}.md"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(table + "\n")
    print(table)
    took = f" in {payload['seconds']:.0f} s" if "seconds" in payload else ""
    print(f"wrote {json_path} and {md_path}{took}")
    return json_path, md_path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save_calib_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-piece BPE tokenizer trained on kvconvert's calibration text (``kvconvert/calib_data``), saved into
    ``path``: what random-weight models need for the conversions that calibrate on text (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "\n".join(f.read_text() for f in sorted(CALIB_DATA.glob("*.txt")))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"], limit_alphabet=60,
                                  show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator([text], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(path)
