"""KV-cache bytes measured from the live cache objects, never from a formula.

Works for any transformers ``Cache`` (stock or kvconvert's): every tensor reachable from the
cache or its layers is counted once (shared storage is de-duplicated).
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from typing import Any

import torch

# never followed: code, classes and modules (their attributes are not cache state)
_OPAQUE = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _tensors(obj: Any, visited: set[int], fixed: bool = False) -> list[tuple[torch.Tensor, bool]]:
    """Tensors held by ``obj``'s attributes, followed through lists, tuples, dicts and plain objects (a cache layer
    may keep its state in helper objects, or share it with another layer), each with whether its owner keeps it in
    float32 whatever the model's dtype (the attribute is named in its class's ``_keep_in_fp32``, as transformers'
    models name modules in ``_keep_in_fp32_modules``)."""
    if torch.is_tensor(obj):
        return [(obj, fixed)]
    if id(obj) in visited or isinstance(obj, _OPAQUE):
        return []
    visited.add(id(obj))
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item, visited, fixed)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item, visited, fixed)]
    if not hasattr(obj, "__dict__"):
        return []
    kept = getattr(type(obj), "_keep_in_fp32", ())
    return [t for name, item in vars(obj).items() for t in _tensors(item, visited, fixed or name in kept)]


def cache_nbytes(cache: Any, as_dtype: torch.dtype | None = None, run_dtype: torch.dtype = torch.float32) -> int:
    """Bytes held by every tensor reachable from ``cache`` (its layers included). ``as_dtype``: the bytes the same
    cache would hold from the model loaded in that dtype, measured on this run of it in ``run_dtype``: every tensor
    in ``run_dtype`` counts at ``as_dtype``'s width but those its owner keeps in float32 whatever the model's dtype
    (``_tensors``); integer codes and float16 scales count as they are. Equal to the bytes measured with the model
    loaded in ``as_dtype`` (``tests/test_method_contract.py``) where what a cache holds does not depend on the
    values (it does for MiniCache's retained tokens: this run's count), without a second model or a second pass
    over the text."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t, fixed in _tensors(cache, set()):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() == 0 or key in seen:
            continue
        seen.add(key)
        size = t.untyped_storage().nbytes()
        if as_dtype is not None and t.dtype == run_dtype and not fixed:
            size = size * as_dtype.itemsize // run_dtype.itemsize
        total += size
    return total


def deployed_nbytes(cache: Any, model: Any) -> int:
    """``cache_nbytes`` of ``model``'s cache as deployed in 16 bits: a 16-bit model's as it is; a wider one's with
    its tensors in the model's dtype counted at bfloat16's width (``cache_nbytes(as_dtype=)``: all of a stock
    cache, a kvconvert cache's but what it keeps in float32 in any dtype). Quantized storage is quoted against a
    16-bit cache: an fp32 reference would flatter it 2×."""
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    return cache_nbytes(cache) if dtype.itemsize == 2 else cache_nbytes(cache, torch.bfloat16, dtype)


def kv_bytes_per_token(model: Any, input_ids: torch.Tensor, short: int, long: int) -> float:
    """Growth of cache bytes per token (per sequence) between prefixes of ``short`` and ``long`` tokens.

    Measuring growth cancels fixed overheads, so the number is what each extra token costs.
    ``input_ids``: ``[b, >= long]``.
    """
    return kv_bytes_growth(model, input_ids, short, long)[0]


@torch.no_grad()
def kv_bytes_growth(model: Any, input_ids: torch.Tensor, short: int, long: int) -> tuple[float, float]:
    """``kv_bytes_per_token``, and the same as deployed in 16 bits (``deployed_nbytes``), from the same caches."""
    if not 0 < short < long <= input_ids.shape[1]:
        raise ValueError(f"need 0 < short < long <= {input_ids.shape[1]}, got {short}, {long}")
    sizes = []
    for length in (short, long):
        cache = model(input_ids[:, :length], use_cache=True).past_key_values
        sizes.append((cache_nbytes(cache), deployed_nbytes(cache, model)))
    tokens = (long - short) * input_ids.shape[0]
    return (sizes[1][0] - sizes[0][0]) / tokens, (sizes[1][1] - sizes[0][1]) / tokens


class PeakMemory:
    """Peak memory a block of work adds above what was held when it started, in bytes (``None`` where the
    platform cannot say). ``with PeakMemory(device) as peak: …`` then ``peak.bytes``.

    On a GPU: torch's allocator statistics (reset at entry). On a CPU: the process's resident set, whose
    high-water mark Linux resets on request (``/proc/self/clear_refs``), so the figure is this block's own peak
    and not the process's lifetime maximum; it counts whatever the block allocates (activations, logits, the
    cache), measured, as a user's ``top`` would see it. Elsewhere: ``None``.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self._start: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif _reset_rss_peak():
            self._start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self.bytes = max(0, _status_kib("VmHWM") * 1024 - self._start)


@torch.no_grad()
def page_in(model: torch.nn.Module) -> None:
    """Read every weight once. transformers maps safetensors files into memory, so a CPU model's weights
    become resident only as a forward first touches them; before a ``PeakMemory`` reading that would count
    the weights as the work's own memory."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "cpu" and tensor.numel():
            tensor.detach().reshape(-1)[:: max(1, 4096 // tensor.element_size())].sum()  # one read per page


def _reset_rss_peak() -> bool:
    _release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
        return True
    except OSError:
        return False


def _release_free_heap() -> None:
    """Hand memory the C allocator holds but nobody uses back to the system, so that the resident set at the
    start of a measurement is what is alive (else one model's freed activations would count in the next's
    start and hide its peak). glibc only; elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")
