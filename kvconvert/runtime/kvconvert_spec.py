"""The typed, versioned contract between the writer (``kvconvert.pipeline``) and this runtime:
``config.json["kvconvert"]``. Copied verbatim into every output directory; imports nothing but the
standard library, so the writer and every copy of the runtime read the same definition.

``spec_version`` changes when a runtime could misread a newer writer's spec; a runtime refuses a
spec it does not understand with one line naming the kvconvert version that wrote it, instead of
failing later with a ``KeyError`` or silently building the wrong model.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any

SPEC_VERSION = 4  # checkpoints written before the field existed are version 1 too
# version 2: ``kv_quant`` may name a ``layout`` ("token") that a version-1 runtime would read as KIVI's
# version 3: ``kv_quant`` may name a ``format`` ("fp8") that older runtimes would read as 8-bit integers
# version 4: ``nope_layers`` (SmolLM3's layers without RoPE) that older runtimes' own attention would rotate, and
# ``interleaved_rope`` (GLM, Cohere: RoPE on interleaved pairs) that they would rotate the rotate-half way


def minimum_spec_version(kv_quant: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> int:
    """The oldest spec version that describes this checkpoint (its storage, and the method's entries ``extra``):
    older runtimes keep loading every checkpoint they can read correctly, and refuse (one line) the ones they
    would misread."""
    kv_quant = kv_quant or {}
    if (extra or {}).get("nope_layers") or (extra or {}).get("interleaved_rope"):
        return 4
    if kv_quant.get("format", "int") != "int":
        return 3
    return 2 if kv_quant.get("layout", "kivi") != "kivi" else 1


class SpecError(ValueError):
    """A ``config.json`` this runtime cannot load; the message is one actionable line."""


@dataclass(frozen=True)
class RuntimeSpec:
    """Fields every method's runtime reads; method-specific entries (``lorc_layers``, ``razor``…)
    travel in ``extra`` and are written at the same level of the JSON object."""

    method: str
    version: str  # the kvconvert version that wrote it
    base_model_type: str
    base_architecture: str
    attention_modules: list[str]
    rotary_module: str | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    scaling: list[float]
    kv_quant: dict[str, int] | None = None  # storage (kvconvert_codec.QuantSpec); absent: 16 bits
    # sliding-window layers interleaved with global ones (Gemma 2/3): kept stock, cache bounded by the window
    local_layers: list[int] | None = None
    sliding_window: int | None = None
    spec_version: int = SPEC_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        for optional in ("kv_quant", "local_layers", "sliding_window"):
            if out[optional] is None:
                del out[optional]  # checkpoints without them read exactly as they did before these fields existed
        clash = set(out) & set(self.extra)
        if clash:
            raise SpecError(f"method entries {sorted(clash)} clash with the runtime spec's own fields")
        return {**out, **self.extra}

    @classmethod
    def from_dict(cls, section: Any, methods: Collection[str]) -> RuntimeSpec:
        """Validate ``config.json["kvconvert"]`` for a runtime that builds ``methods``; ``SpecError``
        (one line) when it cannot load it."""
        if not isinstance(section, dict):
            raise SpecError(
                "config.json has no 'kvconvert' section: this is not a kvconvert checkpoint "
                "(load it with transformers directly)"
            )
        writer = section.get("version", "an unknown version")
        spec_version = section.get("spec_version", 1)
        if not isinstance(spec_version, int) or spec_version > SPEC_VERSION:
            raise SpecError(
                f"this checkpoint's kvconvert spec (version {spec_version}, written by kvconvert {writer}) is newer "
                f"than this runtime understands (version {SPEC_VERSION}); upgrade kvconvert"
            )
        method = section.get("method")
        if method not in methods:
            raise SpecError(
                f"this runtime cannot run method {method!r} (written by kvconvert {writer}); it knows "
                f"{', '.join(methods)}: upgrade kvconvert"
            )
        own = {f.name for f in fields(cls)} - {"extra"}
        required = own - {"kv_quant", "local_layers", "sliding_window", "spec_version"}
        missing = sorted(required - set(section))
        if missing:
            raise SpecError(
                f"config.json's kvconvert section (written by kvconvert {writer}) lacks {', '.join(missing)}; "
                "was it edited by hand? Convert the model again"
            )
        values = {k: section[k] for k in own if k in section}
        return cls(**values, extra={k: v for k, v in section.items() if k not in own})
