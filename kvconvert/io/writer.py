"""A streaming, sharded safetensors writer (output directories: ``kvconvert.io.outdir``).

The writer appends each tensor's bytes to disk as soon as it is produced, so conversion memory
stays at one layer's tensors regardless of model size. Output is byte-deterministic: the same
tensors added in the same order give identical files.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from kvconvert.errors import KVConvertError

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
# safetensors dtypes that --dtype converts (the floating ones the writer knows)
FLOAT_NAMES = frozenset(name for dtype, name in _DTYPE_NAMES.items() if dtype.is_floating_point)
# bytes per element of every safetensors dtype a source may hold (copied as bytes, never interpreted):
# the writer's own, and those torch does not write here
_ITEMSIZE = {**{name: dtype.itemsize for dtype, name in _DTYPE_NAMES.items()},
             "U64": 8, "U32": 4, "U16": 2, "F8_E8M0": 1, "C64": 8}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype ("F32", "I8", …), or torch's own for one it cannot store."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def copy_range(src: BinaryIO, dst: BinaryIO, start: int, nbytes: int) -> None:
    """Append ``nbytes`` of ``src`` from ``start`` to ``dst``, in the kernel where it can
    (``copy_file_range``: no round trip through Python buffers, 4–6× faster than a read/write loop
    here), else by 16 MiB blocks. A short source is an error, never a silently short output."""
    dst.flush()
    copied = 0
    if hasattr(os, "copy_file_range"):
        try:
            while copied < nbytes:
                step = os.copy_file_range(src.fileno(), dst.fileno(), nbytes - copied, start + copied)
                if step == 0:
                    break
                copied += step
        except OSError:  # another filesystem or kernel that refuses it: copy the rest by hand
            pass
        dst.seek(0, os.SEEK_END)  # copy_file_range moved the descriptor's offset, not Python's view of it
    src.seek(start + copied)
    while copied < nbytes:
        block = src.read(min(1 << 24, nbytes - copied))
        if not block:
            raise KVConvertError(f"{src.name} ends {nbytes - copied} bytes before the data it declares")
        dst.write(block)
        copied += len(block)


class ShardedSafetensorsWriter:
    """Write tensors one by one into ``model.safetensors`` or ``model-0000i-of-0000N.safetensors``.

    safetensors puts a JSON header, known only when a shard is complete, before the data. With
    ``header_bytes`` reserved, each shard's data streams straight into the shard file behind that
    many bytes and the header is written into them at the end, padded with spaces (the format allows
    trailing whitespace): every byte is written once. Without a reservation, or when the header
    outgrows it, the data moves behind the header when the shard closes (a kernel copy); the file is
    then the minimal one (header padded to 8 bytes only).
    """

    def __init__(
        self,
        directory: Path,
        max_shard_bytes: int = 5 * 1024**3,
        metadata: dict[str, str] | None = None,
        header_bytes: int = 0,
    ):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.header_bytes = header_bytes + (-header_bytes % 8)  # data stays 8-byte aligned
        self._shards: list[Path] = []
        self._weight_map: dict[str, int] = {}
        self._header: dict[str, dict] = {}
        self._payload: Path | None = None
        self._payload_file: BinaryIO | None = None
        self._offset = 0
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        payload = self._payload_for(name, nbytes)
        if nbytes:
            payload.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        self._record(name, _DTYPE_NAMES[tensor.dtype], list(tensor.shape), nbytes)

    def add_file_range(self, name: str, dtype: str, shape: list[int], path: Path, start: int, nbytes: int) -> None:
        """Add a tensor whose bytes lie, already in safetensors' layout, in ``path`` from ``start``
        (a source tensor passed through unchanged): copied by the kernel, never loaded."""
        if dtype not in _ITEMSIZE:
            raise KVConvertError(f"{path.name}: tensor {name!r} has dtype {dtype!r}, which safetensors does not define")
        if nbytes != math.prod(shape) * _ITEMSIZE[dtype]:
            raise KVConvertError(f"{path.name}: tensor {name!r} declares {nbytes} bytes for {dtype}{shape}")
        payload = self._payload_for(name, nbytes)
        with open(path, "rb") as source:
            copy_range(source, payload, start, nbytes)
        self._record(name, dtype, shape, nbytes)

    def _payload_for(self, name: str, nbytes: int) -> BinaryIO:
        """The open shard ``nbytes`` more go into (a new one when they would overflow this one)."""
        if name in self._weight_map:
            raise ValueError(f"tensor {name!r} written twice")
        if self._payload_file is not None and self._offset and self._offset + nbytes > self.max_shard_bytes:
            self._close_shard()
        return self._payload_file or self._open_payload()

    def _record(self, name: str, dtype: str, shape: list[int], nbytes: int) -> None:
        offsets = [self._offset, self._offset + nbytes]
        self._header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": offsets}
        self._offset += nbytes
        self.total_bytes += nbytes
        self._weight_map[name] = len(self._shards)

    def _open_payload(self) -> BinaryIO:
        self._payload = self.directory / f".shard-{len(self._shards):05d}.safetensors"
        self._payload_file = open(self._payload, "wb")  # noqa: SIM115 - closed in _close_shard
        self._payload_file.seek(8 + self.header_bytes)  # the header goes before, when it is known
        return self._payload_file

    def _close_shard(self) -> None:
        assert self._payload_file is not None and self._payload is not None
        header = json.dumps({"__metadata__": self.metadata, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # data starts 8-byte aligned
        shard = self._payload
        if len(header) <= self.header_bytes:  # the reservation holds it: write it in place
            header += b" " * (self.header_bytes - len(header))
            self._payload_file.seek(0)
            self._payload_file.write(struct.pack("<Q", len(header)) + header)
            self._payload_file.close()
        else:  # move the data behind the header
            self._payload_file.close()
            shard = self.directory / f".shard-{len(self._shards):05d}.moved.safetensors"
            with open(shard, "wb") as out, open(self._payload, "rb") as payload:
                out.write(struct.pack("<Q", len(header)))
                out.write(header)
                copy_range(payload, out, 8 + self.header_bytes, self._offset)
            self._payload.unlink()
        self._shards.append(shard)
        self._payload_file, self._payload, self._header, self._offset = None, None, {}, 0

    def close(self) -> list[str]:
        """Finish the last shard, name the shards, write the index if sharded; return file names."""
        if self._payload_file is not None or not self._shards:
            if self._payload_file is None:
                self._open_payload()  # a model with no tensors still gets a valid (empty) file
            self._close_shard()
        count = len(self._shards)
        names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        for shard, name in zip(self._shards, names, strict=True):
            shard.rename(self.directory / name)
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {k: names[v] for k, v in sorted(self._weight_map.items())},
            }
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names
