"""Architecture adapters. The only place in kvconvert that knows about ``model_type``."""

from __future__ import annotations

from typing import Any

from kvconvert.arch.base import FEATURES, ArchAdapter, AttentionLayout, AttentionTensorName, AttentionWeights
from kvconvert.arch.gpt2 import GPT2Adapter
from kvconvert.arch.gpt_neox import GPTNeoXAdapter
from kvconvert.arch.llama import (
    Cohere2Adapter,
    GemmaAdapter,
    GraniteAdapter,
    LlamaAdapter,
    Phi3Adapter,
    QKNormAdapter,
    SmolLM3Adapter,
)
from kvconvert.errors import KVConvertError

ADAPTERS: tuple[type[ArchAdapter], ...] = (LlamaAdapter, QKNormAdapter, GemmaAdapter, GraniteAdapter, SmolLM3Adapter,
                                           Cohere2Adapter, Phi3Adapter, GPTNeoXAdapter, GPT2Adapter)  # fmt: skip


def supported_model_types() -> list[str]:
    return sorted(t for adapter in ADAPTERS for t in adapter.model_types)


def adapter_for(config: Any) -> ArchAdapter:
    """The adapter for a transformers config, or a one-line error listing what is supported."""
    model_type = getattr(config, "model_type", None)
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter(config)
    raise KVConvertError(
        f"unsupported architecture {model_type!r}; supported model types: {', '.join(supported_model_types())}"
    )


__all__ = [
    "ADAPTERS",
    "FEATURES",
    "ArchAdapter",
    "AttentionLayout",
    "AttentionTensorName",
    "AttentionWeights",
    "adapter_for",
    "supported_model_types",
]
