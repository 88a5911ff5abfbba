"""Resolve ``--model`` (Hub id or local directory) and read its tensors lazily, one at a time.

Input repositories are data only: no ``.py`` file is downloaded or imported, and pickled
weights are refused unless the user opts in, then read with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvconvert.errors import KVConvertError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
_SAFETENSORS_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
_PICKLE_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
_HUB_ID = re.compile(r"^[\w.\-]+(/[\w.\-]+)?$")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def read_json(path: Path, what: str) -> Any:
    """A JSON input file, or one ``KVConvertError`` line naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVConvertError(f"cannot read {what} {path}: {_first_line(exc)}") from None


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """Hex sha256 of a file, streamed in 16 MiB blocks (never the whole file in memory); a set
    ``stop`` abandons it after the current block (a conversion that failed no longer needs it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            if stop is not None and stop.is_set():
                raise KVConvertError(f"hashing {path} was stopped")
            digest.update(block)
    return digest.hexdigest()


class StoredTensor(NamedTuple):
    """A tensor's bytes in a safetensors file (``nbytes`` from ``start``)."""

    dtype: str  # safetensors' name: "F32", "BF16", …
    shape: list[int]
    path: Path
    start: int
    nbytes: int


@dataclass
class SourceCheckpoint:
    """A source model on local disk, with lazy per-tensor access.

    ``get(name)`` reads one tensor; the only thing held for a whole shard is its header index.
    """

    model_id: str
    path: Path
    revision: str | None
    config: Any
    weight_files: list[Path]
    pickled: bool
    _index: dict[str, Path] = field(default_factory=dict, repr=False)
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)
    _headers: dict[Path, tuple[int, dict[str, Any]]] = field(default_factory=dict, repr=False)
    _checked: bool = field(default=False, repr=False)

    def check(self) -> None:
        """Refuse weights that do not match the config, are not floats, or are not finite
        (``kvconvert.io.checks``); once per source, however many conversions read it."""
        if not self._checked:
            from kvconvert.io.checks import check_source

            check_source(self)
            self._checked = True

    def header(self, name: str) -> tuple[list[int], str]:
        """(shape, safetensors dtype name) of tensor ``name``, without reading its data (safetensors)."""
        stored = self.stored(name)
        if stored is not None:
            return stored.shape, stored.dtype
        from kvconvert.io.writer import dtype_name

        tensor = self.get(name)
        return list(tensor.shape), dtype_name(tensor.dtype)

    def tensor_names(self) -> list[str]:
        if not self._index:
            self._build_index()
        return sorted(self._index)

    def get(self, name: str) -> torch.Tensor:
        if not self._index:
            self._build_index()
        handle = self._handle(self._index[name])
        if self.pickled:
            return handle[name]
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # SafetensorError or a short read: the file is damaged
            raise KVConvertError(f"cannot read tensor {name!r} from {self._index[name]}: {_first_line(exc)}") from None

    def stored(self, name: str) -> StoredTensor | None:
        """Where ``name``'s bytes lie in its safetensors file, so
        a tensor passed through unchanged can be copied without loading it; None for pickled weights.
        The header is parsed as JSON (data only); safetensors itself checked it when the file opened."""
        if self.pickled:
            return None
        if not self._index:
            self._build_index()
        path = self._index[name]
        if path not in self._headers:
            with open(path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + length, json.loads(f.read(length)))
        base, header = self._headers[path]
        entry = header[name]
        begin, end = entry["data_offsets"]
        return StoredTensor(entry["dtype"], list(entry["shape"]), path, base + begin, end - begin)

    def release(self) -> None:
        """Close the open shard handles. safetensors maps files into memory, and every page read stays
        resident (and counted in RSS) while the mapping lives; the pipeline calls this after each
        tensor it finishes so resident memory stays at what is being converted."""
        self._handles.clear()

    def sha256(self, stop: threading.Event | None = None) -> dict[str, str]:
        """sha256 of every weight file (``stop``: see ``sha256_file``)."""
        return {path.name: sha256_file(path, stop) for path in self.weight_files}

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            if self.pickled:
                # weights_only=True refuses arbitrary objects; mmap keeps memory per tensor.
                try:
                    self._handles[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except Exception as exc:  # UnpicklingError, RuntimeError: anything but plain tensors
                    raise KVConvertError(
                        f"refusing {path.name}: it is not a plain tensor file ({type(exc).__name__}); "
                        "only weights_only pickles are read"
                    ) from None
            else:
                from safetensors import SafetensorError, safe_open

                try:
                    self._handles[path] = safe_open(str(path), framework="pt")
                except (SafetensorError, OSError) as exc:
                    raise KVConvertError(
                        f"cannot read {path}: {_first_line(exc)} (truncated or not safetensors?)"
                    ) from None
        return self._handles[path]

    def _build_index(self) -> None:
        for path in self.weight_files:
            handle = self._handle(path)
            for name in handle.keys():
                self._index[name] = path


def _download(model_id: str, revision: str | None, allow_pickle: bool) -> tuple[Path, str | None]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = ["config.json", *TOKENIZER_FILES, *_SAFETENSORS_PATTERNS] + (_PICKLE_PATTERNS if allow_pickle else [])
    try:
        local = snapshot_download(repo_id=model_id, revision=revision, allow_patterns=patterns)
    except RepositoryNotFoundError:
        raise KVConvertError(
            f"model not found: {model_id!r} is not a local directory and not a Hub repository you can access"
        ) from None
    except RevisionNotFoundError:
        raise KVConvertError(f"revision {revision!r} not found in {model_id!r}") from None
    except GatedRepoError:
        raise KVConvertError(
            f"{model_id!r} is gated: accept its licence on the Hub and log in (hf auth login)"
        ) from None
    except LocalEntryNotFoundError:
        raise KVConvertError(
            f"{model_id!r} is not in the local Hugging Face cache and the Hub is unreachable "
            "(offline or HF_HUB_OFFLINE=1); download it once online or pass a local directory"
        ) from None
    except (OSError, ValueError) as exc:
        raise KVConvertError(f"could not download {model_id!r}: {str(exc).splitlines()[0]}") from None
    path = Path(local)
    # snapshot paths end in the commit hash: record it so the conversion can be reproduced
    return path, path.name if re.fullmatch(r"[0-9a-f]{40}", path.name) else revision


def hub_snapshot(model_id: str, revision: str | None = None) -> Path:
    """Local directory of a Hub model's data files (config, safetensors, tokenizer; never code)."""
    if not _HUB_ID.match(model_id) or model_id.startswith((".", "/", "~")):
        raise KVConvertError(f"model not found: {model_id!r} is neither a local directory nor a Hub id")
    return _download(model_id, revision, allow_pickle=False)[0]


def _weight_files(path: Path, allow_pickle: bool) -> tuple[list[Path], bool]:
    safetensors = sorted(path.glob("*.safetensors"))
    if safetensors:
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index, "shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise KVConvertError(f"{index} has no 'weight_map'; is the checkpoint complete?")
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (path / n).exists()]
            if missing:
                raise KVConvertError(f"{index} names shards that are missing: {', '.join(missing)}")
            return [path / n for n in names], False
        return safetensors, False
    pickled = sorted(path.glob("pytorch_model*.bin"))
    if pickled and not allow_pickle:
        raise KVConvertError(
            f"{path} has only pickled .bin weights; pass --allow-pickle to read them with "
            "torch.load(weights_only=True), or convert them to safetensors first"
        )
    if pickled:
        return pickled, True
    raise KVConvertError(f"no weights found in {path} (expected *.safetensors)")


def open_source(model: str, revision: str | None = None, allow_pickle: bool = False) -> SourceCheckpoint:
    """Resolve ``model`` to a local directory and open its config and weights lazily."""
    from kvconvert.arch import supported_model_types

    local = Path(model).expanduser()
    if local.exists():
        if not local.is_dir():
            raise KVConvertError(f"--model {model!r} is a file; pass the model's directory or a Hub id")
        path, resolved_revision = local.resolve(), revision
    elif _HUB_ID.match(model) and not model.startswith((".", "/", "~")):
        path, resolved_revision = _download(model, revision, allow_pickle)
    else:
        raise KVConvertError(f"model not found: {model!r} is neither a local directory nor a Hub id")

    config_file = path / "config.json"
    if not config_file.exists():
        raise KVConvertError(f"{path} has no config.json; is it a Hugging Face model directory?")
    config_data = read_json(config_file, "model config")
    model_type = config_data.get("model_type") if isinstance(config_data, dict) else None
    if model_type not in supported_model_types():
        raise KVConvertError(
            f"unsupported architecture {model_type!r}; supported model types: {', '.join(supported_model_types())}"
        )
    from transformers import AutoConfig

    # trust_remote_code stays False: configs of supported types are transformers' own classes.
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise KVConvertError(f"cannot read {config_file}: {_first_line(exc)}") from None
    files, pickled = _weight_files(path, allow_pickle)
    return SourceCheckpoint(
        model_id=model if not local.exists() else str(path),
        path=path,
        revision=resolved_revision,
        config=config,
        weight_files=files,
        pickled=pickled,
    )


def hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
