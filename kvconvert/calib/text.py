"""Calibration text: where it comes from, and how it becomes fixed-length token chunks.

Sources: the articles shipped in ``calib_data/`` (default), a local text file or a directory of
``*.txt`` files, or a Hugging Face dataset spec ``name[:config]:split:column`` (via ``datasets``).
The text is tokenised once, cut into ``chunk_len``-token chunks, and a seeded shuffle picks enough
chunks for ``tokens``; the chunks left over are the held-out set that searches score on.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvconvert.errors import KVConvertError

# package data (pyproject's package-data), so an installed wheel has it too; a wheel installs as plain files
CALIB_DATA = Path(str(importlib.resources.files("kvconvert") / "calib_data"))


@dataclass(frozen=True)
class CalibrationSet:
    """``chunks [n, chunk_len]`` token ids to fit on; ``held_out [m, chunk_len]`` the rest."""

    chunks: torch.Tensor
    held_out: torch.Tensor
    source: str

    @property
    def tokens(self) -> int:
        return self.chunks.numel()


def read_calibration_text(spec: str | None) -> tuple[str, str]:
    """(text, description) of a calibration source; ``None`` means the shipped ``calib_data/``."""
    from kvconvert.eval.data import load_text, read_text_file

    if spec is None:
        if not CALIB_DATA.is_dir() or not list(CALIB_DATA.glob("*.txt")):
            raise KVConvertError(f"the default calibration text ({CALIB_DATA}) is missing; pass --calib FILE|DIR")
        spec = str(CALIB_DATA)
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise KVConvertError(f"--calib directory {spec!r} holds no *.txt files")
        return "\n\n".join(read_text_file(f, "--calib") for f in files), str(path)
    return load_text(spec, option="--calib"), spec


def load_tokenizer(model_path: Path) -> Any:
    """The source model's own tokenizer (calibration must see the tokens the model will see)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception as exc:  # transformers raises OSError/ValueError/… for a missing tokenizer
        raise KVConvertError(
            f"calibration needs the model's tokenizer, and none loads from {model_path}: {str(exc).splitlines()[0]}"
        ) from None


def tokenize_chunks(ids: list[int], tokens: int, chunk_len: int, seed: int, source: str, bos: int | None = None,
                    fewer: bool = False, asked: str = "--calib-tokens") -> CalibrationSet:  # fmt: skip
    """Cut ``ids`` into chunks of ``chunk_len`` (``bos`` first in each when the model expects it); ``asked``: the
    option a too short text is blamed on."""
    body = chunk_len - (1 if bos is not None else 0)
    count = len(ids) // body
    needed = -(-tokens // chunk_len)  # ceil
    if fewer:  # at least one chunk
        needed = min(needed, max(count, 1))
    if count < needed:
        raise KVConvertError(
            f"calibration text {source!r} gives {count * chunk_len} tokens in {chunk_len}-token chunks; "
            f"{asked} asks for {needed * chunk_len}: pass more text or lower {asked}"
        )
    rows = torch.tensor(ids[: count * body], dtype=torch.long).view(count, body)
    if bos is not None:
        rows = torch.cat([torch.full((count, 1), bos, dtype=torch.long), rows], dim=1)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return CalibrationSet(chunks=rows[order[:needed]], held_out=rows[order[needed:]], source=source)


def calibration_set(model_path: Path, spec: str | None, tokens: int, chunk_len: int, seed: int,
                    fewer: bool = False, asked: str = "--calib-tokens") -> CalibrationSet:  # fmt: skip
    """Token chunks of a calibration source for the model at ``model_path``; ``fewer``: as many as the text gives
    when that is fewer than ``tokens`` asks for (at least one)."""
    if tokens < 1 or chunk_len < 2:
        raise KVConvertError(f"--calib-tokens must be >= 1 and the chunk length >= 2 (got {tokens}, {chunk_len})")
    text, source = read_calibration_text(spec)
    tokenizer = load_tokenizer(model_path)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    return tokenize_chunks(ids, tokens, chunk_len, seed, source, bos if adds_bos else None, fewer, asked)
