"""What a method needs to know about an architecture, and nothing else.

Every adapter answers the same questions (where the attention weights are in a checkpoint, how
the heads are laid out, whether and where RoPE is applied) so that methods never look at
``config.model_type``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class AttentionLayout:
    """Head geometry of one model (all layers share it in the supported families)."""

    num_layers: int
    hidden_size: int  # d: width of the residual stream
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (== num_heads for MHA)
    head_dim: int
    scaling: tuple[float, ...]  # softmax scale per layer (GPT-2 can scale by 1/(layer+1))
    rotary: bool  # RoPE applied to q and k after projection
    rotary_module: str | None  # attribute path of the model's rotary-embedding module
    context: int  # longest sequence the model was trained for
    # attention features of post-2024 families (each method says which it supports: FEATURES)
    qk_norm: bool = False  # an RMSNorm on queries and keys between projection and RoPE
    qk_norm_eps: float | None = None  # its epsilon (with qk_norm)
    qk_norm_per_head: bool = True  # over each head's dk channels (Qwen3, Gemma 3), or over all heads (OLMo 2)
    qk_norm_offset: float = 0.0  # added to the stored weight before it scales (Gemma 3's norm: 1 + weight)
    local_layers: tuple[int, ...] = ()  # sliding-window layers interleaved with global ones
    sliding_window: int | None = None  # their window (tokens)
    softcap: float | None = None  # attention-logit soft-capping: scores = c·tanh(scores / c)
    layer_rope: bool = False  # RoPE tables differ between local and global layers
    nope_layers: tuple[int, ...] = ()  # layers whose attention applies no RoPE (SmolLM3: every fourth)
    interleaved_rope: bool = False  # RoPE rotates channels (2i, 2i + 1), not (i, i + d/2) as rotate-half does
    # serving engines (vLLM, SGLang) read static fp8 KV scales from ``k_scale`` / ``v_scale`` tensors inside
    # this model's attention blocks (llm-compressor's names); False where kvconvert knows no such place
    engine_kv_scales: bool = False

    @property
    def kv_width(self) -> int:
        """e: width of K (and V) per token per layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def features(self) -> tuple[str, ...]:
        """The names (keys of ``FEATURES``) of the features this model's attention has."""
        present = {"qk_norm": self.qk_norm, "local_layers": bool(self.local_layers),
                   "softcap": self.softcap is not None, "layer_rope": self.layer_rope,
                   "nope_layers": bool(self.nope_layers), "interleaved_rope": self.interleaved_rope}  # fmt: skip
        return tuple(name for name in FEATURES if present[name])

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers whose cache grows with the sequence: the ones worth compressing."""
        return tuple(i for i in range(self.num_layers) if i not in self.local_layers)


# feature -> what it is (the capability matrix's rows; methods name the ones they cannot handle)
FEATURES = {
    "qk_norm": "QK-norm: an RMSNorm on each query/key head before RoPE (Qwen3, Gemma 3, OLMo 2)",
    "local_layers": "sliding-window layers interleaved with global ones (Gemma 2/3, Qwen3 with max_window_layers)",
    "softcap": "attention-logit soft-capping (Gemma 2)",
    "layer_rope": "RoPE tables that differ between local and global layers (Gemma 3)",
    "nope_layers": "layers without RoPE between rotary ones (SmolLM3)",
    "interleaved_rope": "RoPE on interleaved channel pairs (Helium, Cohere, GLM, ERNIE 4.5)",
}


@dataclass
class AttentionWeights:
    """One layer's attention projections in ``nn.Linear`` convention (``y = x @ W.T + b``).

    Shapes: q ``[H·dk, d]``, k ``[Hkv·dk, d]``, v ``[Hkv·dk, d]``, o ``[d, H·dk]``; biases are
    the matching output widths, or None when the architecture has none. QK-norm weights (RMSNorm after
    the projection, before RoPE): ``[dk]`` per head (Qwen3) or ``[H·dk]``/``[Hkv·dk]`` over all heads
    (OLMo 2), or None.
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    v_weight: torch.Tensor
    o_weight: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionTensorName:
    """A checkpoint tensor that belongs to a layer's attention block."""

    layer: int
    prefix: str  # checkpoint prefix of the attention block, e.g. "model.layers.3.self_attn."
    local: str  # name inside the block, e.g. "q_proj.weight"


class ArchAdapter:
    """Base class: one subclass per architecture family, registered in ``kvconvert.arch``."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    # Regex over checkpoint names; groups: prefix (ending in "."), layer index, local name.
    attention_name_pattern: ClassVar[re.Pattern[str]]
    # Attribute path of layer i's attention module inside the transformers model.
    attention_module_template: ClassVar[str]
    # The decoder layer's argument that takes a KV cache (``update(key, value, layer_idx)``) up to transformers 5.23
    # (``layer_cache_argument`` asks the layer: from 5.24 on most call it ``cache``).
    layer_cache_name: ClassVar[str] = "past_key_values"
    # The output head's checkpoint name where transformers renames it while loading (else the module's own).
    stored_head: ClassVar[str | None] = None

    def __init__(self, config: Any):
        self.config = config

    def layer_cache_argument(self, layer: torch.nn.Module) -> str:
        """The argument ``layer`` (a decoder layer) takes its KV cache by: ``cache`` where its forward has one
        (transformers 5.24 renamed ``past_key_values`` so; GPT-NeoX kept ``layer_past``), else ``layer_cache_name``."""
        return "cache" if "cache" in inspect.signature(layer.forward).parameters else self.layer_cache_name

    # -- geometry -------------------------------------------------------------------------
    def layout(self) -> AttentionLayout:
        raise NotImplementedError

    def causal_lm_class_name(self) -> str:
        """Name of the transformers class this checkpoint loads with, e.g. ``LlamaForCausalLM``."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.config.model_type])

    def decoder_layers_path(self) -> str:
        """Attribute path of the ``nn.ModuleList`` of decoder layers, e.g. ``model.layers``."""
        layer_template = self.attention_module_template.rpartition(".")[0]  # "model.layers.{i}"
        return layer_template.removesuffix(".{i}")

    def attention_module_paths(self) -> list[str]:
        return [self.attention_module_template.format(i=i) for i in range(self.layout().num_layers)]

    # the value and output projections are separate tensors that ``value_output_tensors`` can name
    writes_values: ClassVar[bool] = False

    def value_output_tensors(self, weights: AttentionWeights) -> dict[str, torch.Tensor]:
        """``weights``' value and output projections (and value bias) under their local checkpoint names, for a
        method that rewrites only those (``quant --kv-rotate`` folding its rotation in) and keeps the stock module."""
        raise NotImplementedError(f"{self.family} cannot write its value projection alone")

    def key_norm(self, attention: Any) -> tuple[Any, torch.Tensor, float] | None:
        """A loaded attention module's QK-norm on keys as ``(key projection module, weight, eps)``: the
        keys are ``weight · k / √(mean(k²) + eps)`` of the projection's output ``k``, over each head's
        channels (``weight [dk]``) or all heads' (``[Hkv·dk]``), before RoPE. None without QK-norm."""
        return None

    # -- checkpoint -----------------------------------------------------------------------
    def match_attention_tensor(self, name: str) -> AttentionTensorName | None:
        m = self.attention_name_pattern.match(name)
        if m is None:
            return None
        return AttentionTensorName(layer=int(m.group("layer")), prefix=m.group("prefix"), local=m.group("local"))

    def attention_names_by_layer(self, names: list[str]) -> dict[int, dict[str, str]]:
        """Checkpoint names of each layer's attention tensors, keyed by local name."""
        by_layer: dict[int, dict[str, str]] = {}
        for name in names:
            match = self.match_attention_tensor(name)
            if match is not None:
                by_layer.setdefault(match.layer, {})[match.local] = name
        return by_layer

    def local_layers(self) -> tuple[tuple[int, ...], int | None]:
        """(sliding-window layers, their window) when the model interleaves them with global layers.

        A model whose every layer slides (Mistral 7B v0.1, Phi-3 mini: windows of half the context
        or more) has no global layer to prefer: all its layers count as global, and transformers'
        sliding masks still bound what each query sees."""
        c = self.config
        types = getattr(c, "layer_types", None)
        window = getattr(c, "sliding_window", None)
        if not types or window is None:
            return (), None
        local = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        return (local, window) if len(local) < len(types) else ((), None)

    def read_attention(self, tensors: dict[str, torch.Tensor]) -> AttentionWeights:
        """Build ``AttentionWeights`` from one layer's attention tensors keyed by local name.

        Tensors that are not weights (old checkpoints' mask buffers, rotary caches) are ignored;
        they are dropped from the output because transformers recomputes them.
        """
        raise NotImplementedError
