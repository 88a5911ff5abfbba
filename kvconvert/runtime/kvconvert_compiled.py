"""When kvconvert's CPU readers are compiled by ``torch.compile`` (``compiled_call``: the readers of
kvconvert_folded.py, LoRC's and slim's scores with RoPE on the query side) and when their callers' eager ops run.
Copied verbatim into every output directory; imports only torch.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .kvconvert_kernels import env_choice

# A compiled reader saves 9-20 % of a decode step on a CPU (kvconvert_folded.py: where and by how much), but building
# it costs more than a short run saves: SmolLM2's 3-bit KIVI, a process's first generate 60 s longer than eager with
# a cold Inductor cache and 27 s with a warm one, its first batch of 8 rows 31 and 10 s more (2 AMD EPYC cores,
# bench/results/compile-warmup-*). So ``auto`` reads eagerly until a process has decoded ``COMPILE_AFTER_S`` through
# a reader (about a build's cost over what it saves a step), then builds it: a process that stops sooner never pays,
# one that goes on loses at most about a build's cost (ski rental). ``on`` builds at first use (servers that warm up,
# speed measurements: ``eval.speed.readers_built``), ``off`` never; where Inductor cannot build (no C++ compiler) the
# eager ops stay, said once.
COMPILE_CHOICES = ("auto", "on", "off")
COMPILE_AFTER_S, IDLE_S = 300.0, 1.0
_FUSED: dict[str, Any] = {}  # reader name → its compiled function, or False once it failed to build
_DECODED: dict[str, list[float]] = {}  # reader name → [seconds decoded through it eagerly, its last call's clock]


def compile_requested() -> str:
    """``KVCONVERT_COMPILE``, checked: ``auto`` (unset), ``on`` or ``off``; a misspelt one is a one-line error."""
    return env_choice("KVCONVERT_COMPILE", COMPILE_CHOICES)


def compiled_call(name: str, fn: Callable[..., Any], *args: Any, dynamic: bool | None = True) -> Any:
    """``fn(*args)`` compiled by Inductor (once per process; ``dynamic``: every size symbolic, or None: only those
    that change between calls, such as a cache's length, which compiles tighter loops); or None where it cannot run:
    the caller's eager ops then (``KVCONVERT_COMPILE=off``; ``auto`` before ``COMPILE_AFTER_S`` of decoding through
    it; or Inductor failed to build it here: said once)."""
    compiled, requested = _FUSED.get(name), compile_requested()
    if compiled is False or requested == "off":
        return None
    if compiled is None:
        if requested == "auto" and not _decoded_long(name):
            return None
        # shapes symbolic: rows, blocks and tokens change every step without recompiling
        compiled = _FUSED[name] = torch.compile(fn, dynamic=dynamic)
    # sizes that happen to be equal (3 query rows and 3 blocks) are not assumed to stay so; each bit width and
    # batch-of-one is a graph of its own, a process converting and scoring many candidates makes more than dynamo's
    # default 8, and one past the limit fails here instead of running the broadcast products eagerly. Set and put back
    # by hand around each call: ``config.patch`` cost 28 µs a call (a call itself is ~55 µs at 1 × 1K), this 10.
    shapes, dynamo = torch.fx.experimental._config, torch._dynamo.config
    saved = shapes.use_duck_shape, dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit
    try:
        shapes.use_duck_shape, dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit = False, 64, True
        return compiled(*args)
    except Exception as exc:  # noqa: BLE001 - Inductor could not build it here (no C++ compiler, …): eager from now on
        _FUSED[name] = False
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(f"kvconvert: torch.compile could not build the CPU reader {name!r} ({reason}); decoding with "
                      "torch's eager ops (KVCONVERT_COMPILE=off skips the attempt)", stacklevel=3)  # fmt: skip
        return None
    finally:
        shapes.use_duck_shape, dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit = saved


def _decoded_long(name: str) -> bool:
    """Whether this process has now decoded ``COMPILE_AFTER_S`` through reader ``name``: the time between its calls
    (a layer's step apart) summed, a gap over ``IDLE_S`` (a pause between generations) counted as ``IDLE_S``."""
    now = time.perf_counter()
    clock = _DECODED.setdefault(name, [0.0, now])
    clock[0] += min(now - clock[1], IDLE_S)
    clock[1] = now
    return clock[0] >= COMPILE_AFTER_S
