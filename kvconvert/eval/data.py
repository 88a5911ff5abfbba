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
        return read_text_file(path, option)
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
    bad = next((row for row in rows if not isinstance(row, str)), None)
    if bad is not None:
        raise KVConvertError(f"{option} {spec!r}: column {column!r} holds {type(bad).__name__} values, not text; "
                             "name a text column")  # fmt: skip
    return "\n".join(rows)


def read_text_file(path: Path, option: str) -> str:
    """A UTF-8 text file (CRLF normalised). Binary data or another encoding is refused: scored as
    replacement characters it would give a perplexity of nothing the user meant."""
    data = path.read_bytes()
    if b"\0" in data[: 1 << 20]:
        raise KVConvertError(f"{option} {path} looks binary (NUL bytes); pass a UTF-8 text file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise KVConvertError(f"{option} {path} is not UTF-8 text (invalid byte at offset {exc.start}); convert "
                             "it first, e.g. iconv -t UTF-8") from None  # fmt: skip
    return text.replace("\r\n", "\n")
