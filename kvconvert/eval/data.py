"""Evaluation text: a local file, or a Hugging Face dataset spec ``name[:config]:split:column``."""

from __future__ import annotations

from pathlib import Path

from kvconvert.errors import KVConvertError


def load_text(spec: str, option: str = "--data") -> str:
    """Text of a local file (CRLF normalised), or the rows of a ``datasets`` split joined by newlines.

    ``option`` names the command-line option in error messages."""
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            raise KVConvertError(f"{option} {spec!r} is a directory; pass a text file or a dataset spec")
        return path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise KVConvertError(
            f"{option} {spec!r} is neither a file nor a dataset spec like wikitext:wikitext-2-raw-v1:test:text"
        )
    try:
        import datasets
    except ImportError:
        raise KVConvertError("dataset specs need the 'datasets' package: pip install 'kvconvert[datasets]'") from None
    name, config, split, column = parts if len(parts) == 4 else (parts[0], None, parts[1], parts[2])
    try:
        rows = datasets.load_dataset(name, config, split=split)[column]
    except Exception as exc:  # datasets raises many types; the user needs the first line only
        raise KVConvertError(f"could not load dataset {spec!r}: {str(exc).splitlines()[0]}") from None
    return "\n".join(rows)
