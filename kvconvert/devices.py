"""Where commands run the model: ``--device cpu | cuda | cuda:N | auto``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from kvconvert.errors import KVConvertError


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA GPU when there is one, else the CPU. A device that is not there is a
    one-line error, never a silent fall back to the CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise KVConvertError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise KVConvertError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    if not torch.cuda.is_available():
        raise KVConvertError(f"--device {name}: this torch sees no CUDA GPU (use --device cpu)")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise KVConvertError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device("cuda", index)


def check_kernel_setting(device: torch.device) -> None:
    """``KVCONVERT_KERNELS`` can be honoured where converted models will decode (``device``): a misspelt value,
    Triton missing, or Triton asked for on a CPU is a one-line error before any model loads, not a traceback
    from inside the first decode step; so is a misspelt ``KVCONVERT_REBUILD`` or ``KVCONVERT_COMPILE``."""
    from kvconvert.runtime.kvconvert_compiled import compile_requested
    from kvconvert.runtime.kvconvert_kernels import check_kernel_device, kernels_requested
    from kvconvert.runtime.kvconvert_products import rebuild_requested

    try:
        rebuild_requested()
        compile_requested()
        if kernels_requested() == "triton":
            check_kernel_device(device)
    except ValueError as exc:
        raise KVConvertError(str(exc)) from None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings on a GPU); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_COMPUTE: contextvars.ContextVar[torch.device | None] = contextvars.ContextVar("kvconvert_compute_device", default=None)


@contextlib.contextmanager
def computing_on(device: torch.device) -> Iterator[None]:
    """Inside the block, calibration and profiling (``calib.sequential.run_layer_by_layer``) run the
    source's layers on ``device``, one layer there at a time; the float64 statistics stay on the CPU."""
    token = _COMPUTE.set(device)
    try:
        yield
    finally:
        _COMPUTE.reset(token)


def compute_device() -> torch.device:
    """Where calibration runs the model now: the CPU unless a ``computing_on`` block says otherwise."""
    return _COMPUTE.get() or torch.device("cpu")


def model_device(model: object) -> torch.device:
    """Where ``model`` runs: transformers models say (``.device``); anything else is taken to be on the CPU."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def return_large_frees_to_the_os() -> None:
    """Serve allocations of 1 MiB and more by mmap from now on (glibc's ``M_MMAP_THRESHOLD``), so that their
    frees go back to the OS. glibc raises that threshold to the size of each mmap'ed block freed (up to 32 MiB),
    after which a loop of many transient tensors of a few MiB (the recall probes' question-sized forwards over
    an 8K prompt, each concatenating the prompt's keys) fragments the heap: 3 prompts of 8K tokens held 10.5 GB
    of RSS on SmolLM2-135M instead of 0.8. Process-wide and kept; a no-op where the C library is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return
    if mallopt is not None:
        mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
