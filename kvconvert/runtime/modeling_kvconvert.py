"""kvconvert runtime entry point, named in ``config.json``'s ``auto_map``.

A converted checkpoint keeps its source architecture (``LlamaForCausalLM``, ``GPT2LMHeadModel``…)
for everything but attention. ``KVConvertForCausalLM`` builds, on first use, a subclass of that
transformers class whose attention modules are the method's (``config.kvconvert["method"]``) and
whose cache is the method's compressed cache. Copied verbatim into every output directory;
imports only torch and transformers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import transformers
from transformers import PretrainedConfig
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .kvconvert_common import static_refusal
from .kvconvert_kernels import check_requested_kernels
from .kvconvert_lorc import configure as configure_lorc
from .kvconvert_lorc import make_attention as make_lorc_attention
from .kvconvert_lorc import make_cache as make_lorc_cache
from .kvconvert_minicache import configure as configure_minicache
from .kvconvert_minicache import make_attention as make_minicache_attention
from .kvconvert_minicache import make_cache as make_minicache_cache
from .kvconvert_quant import configure as configure_quant
from .kvconvert_quant import make_attention as make_quant_attention
from .kvconvert_quant import make_cache as make_quant_cache
from .kvconvert_razor import configure as configure_razor
from .kvconvert_razor import make_attention as make_razor_attention
from .kvconvert_razor import make_cache as make_razor_cache
from .kvconvert_slim import SlimAttention
from .kvconvert_slim import make_cache as make_slim_cache
from .kvconvert_spec import RuntimeSpec
from .kvconvert_zack import make_attention as make_zack_attention
from .kvconvert_zack import make_cache as make_zack_cache

# method name -> (attention factory: (spec, layer, rotary) -> module, or None to keep the stock one;
#                 cache factory: spec -> Cache; configure: model -> None, run once after construction)
METHOD_RUNTIMES: dict[str, tuple[Any, Any, Any]] = {
    "slim": (SlimAttention, make_slim_cache, None),
    "lorc": (make_lorc_attention, make_lorc_cache, configure_lorc),
    "razor": (make_razor_attention, make_razor_cache, configure_razor),
    "zack": (make_zack_attention, make_zack_cache, None),
    "minicache": (make_minicache_attention, make_minicache_cache, configure_minicache),
    "quant": (make_quant_attention, make_quant_cache, configure_quant),
}

_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
MODEL_TYPE = "kvconvert"  # config.json's model_type: stock transformers refuses it without remote code


class KVConvertConfig:
    """Dispatcher named in ``auto_map["AutoConfig"]``: returns the source architecture's config.

    ``config.json`` says ``model_type: "kvconvert"`` so that loading without
    ``trust_remote_code=True`` fails loudly instead of building the stock model with missing
    weights; ``kvconvert.base_model_type`` names the real config class.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> PretrainedConfig:
        kwargs.pop("trust_remote_code", None)
        config_dict, unused = PretrainedConfig.get_config_dict(pretrained_model_name_or_path, **kwargs)
        base_type = RuntimeSpec.from_dict(config_dict.get("kvconvert"), METHOD_RUNTIMES).base_model_type
        config_dict["model_type"] = base_type
        # an engine export's quantization_config (fp8 KV scales) is for engines and stock transformers: this
        # runtime implements it itself (``kv_quant``), and transformers must not apply it a second time
        config_dict.pop("quantization_config", None)
        return CONFIG_MAPPING[base_type].from_dict(config_dict, **unused)

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoConfig") -> None:
        """Called by transformers after loading remote code; nothing to record for a dispatcher."""


class KVConvertMixin:
    """Mixed in front of the source architecture's ``*ForCausalLM`` class."""

    config: Any
    _kvconvert_cache_argument: str  # the stock forward's name for its cache (``cache_argument``)

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]
        spec = config.kvconvert
        RuntimeSpec.from_dict(spec, METHOD_RUNTIMES)  # one clear line for a spec this runtime cannot run
        attention_class, _, configure = METHOD_RUNTIMES[spec["method"]]
        rotary = self.get_submodule(spec["rotary_module"]) if spec.get("rotary_module") else None  # type: ignore[attr-defined]
        nope = set(spec.get("nope_layers") or ())  # layers without RoPE, for methods whose own attention rotates keys
        for layer_idx, path in enumerate(spec["attention_modules"]):
            module = attention_class(spec, layer_idx, None if layer_idx in nope else rotary)
            if module is None:
                continue  # the method leaves this layer's stock attention (and weights) as they are
            parent_path, _, name = path.rpartition(".")
            setattr(self.get_submodule(parent_path), name, module)  # type: ignore[attr-defined]
        if configure is not None:
            configure(self)

    def kvconvert_cache(self, past_key_values: Cache | None) -> Cache:
        """The method's cache, replacing an empty stock cache that generate() or a caller made."""
        _, make_cache, _ = METHOD_RUNTIMES[self.config.kvconvert["method"]]
        if past_key_values is not None and getattr(past_key_values, "is_kvconvert_cache", False):
            return past_key_values
        if past_key_values is None or past_key_values.get_seq_length() == 0:
            static_length = _static_length(past_key_values)
            cache = make_cache(self.config.kvconvert, max_cache_len=static_length)
            if static_length is not None and not cache.is_compileable:  # say so: fixed shapes were asked for
                spec = self.config.kvconvert
                reason = static_refusal(spec) or "no static cache is built for this method yet"
                warnings.warn(f"kvconvert: this {spec['method']} checkpoint decodes from a cache that grows with the "
                              f"sequence ({reason}); the static cache asked for is not used",
                              stacklevel=3)  # fmt: skip
            return cache
        raise ValueError(
            f"this kvconvert checkpoint needs its own cache; got a filled {type(past_key_values).__name__}. "
            "Pass past_key_values=None and reuse the cache returned in the outputs."
        )

    def forward(self, *args: Any, past_key_values: Cache | None = None, cache: Cache | None = None,
                use_cache: bool | None = None, **kwargs: Any):  # fmt: skip
        check_requested_kernels(self)
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
        cache = cache if cache is not None else past_key_values
        if use_cache if use_cache is not None else self.config.use_cache:
            cache = self.kvconvert_cache(cache)
        try:
            with self._cache_attached(cache):
                kwargs[self._kvconvert_cache_argument] = cache
                return super().forward(*args, use_cache=use_cache, **kwargs)  # type: ignore[misc]
        finally:
            end_step = getattr(cache, "end_step", None)
            if end_step is not None:
                end_step()  # drop per-step scratch so only the cache state remains

    @contextlib.contextmanager
    def _cache_attached(self, cache: Cache | None) -> Iterator[None]:
        """Give attention modules (and attention functions, which only see the module) this forward's
        cache; always detached afterwards so no module keeps a cache alive."""
        modules = [self.get_submodule(path) for path in self.config.kvconvert["attention_modules"]]  # type: ignore[attr-defined]
        for module in modules:
            module.__dict__["_kvconvert_cache"] = cache
        try:
            yield
        finally:
            for module in modules:  # assigned, not popped: torch 2.11's dynamo cannot trace __dict__.pop (an H200 run)
                module.__dict__["_kvconvert_cache"] = None

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any):
        requested = getattr(generation_config, "cache_implementation", None)
        if requested not in (None, "dynamic", "static"):  # say so ("static": kvconvert_cache does)
            warnings.warn(
                f"kvconvert: this checkpoint decodes from its {self.config.kvconvert['method']} cache, which grows "
                f"with the sequence; cache_implementation={requested!r} is not supported yet and is ignored",
                stacklevel=3,
            )
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)  # type: ignore[misc]
        for name in CACHE_ARGUMENTS:  # whichever name this transformers' generate keeps its cache under
            if model_kwargs.get(name) is not None:
                model_kwargs[name] = self.kvconvert_cache(model_kwargs[name])
        return result


# What a model's forward calls its cache: ``past_key_values`` up to transformers 5.23, ``cache`` from 5.24 on (the old
# name deprecated, to go in 5.40). Passed a kvconvert cache under the old name, 5.24's generate also passes the stock
# cache it made under the new one, and the stock model takes that one: every method then decoded from a plain
# DynamicCache in silence (or crashed where the attention functions found the kvconvert cache on their modules).
CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(base: type) -> str:
    """The name the transformers class ``base``'s forward takes its cache by (``CACHE_ARGUMENTS``)."""
    parameters = inspect.signature(base.forward).parameters  # type: ignore[attr-defined]
    return next((name for name in CACHE_ARGUMENTS if name in parameters), "past_key_values")


def _static_length(cache: Cache | None) -> int | None:
    """The length an empty stock static cache was made for (``generate(cache_implementation="static")`` makes
    one before the model sees it), or None for any other cache."""
    if cache is None or not cache.is_compileable:
        return None
    length = cache.get_max_length()
    return length if length > 0 else None


_CONCRETE_CLASSES: dict[type, type] = {}


def _forward_with_signature_of(base: type) -> Any:
    """KVConvertMixin.forward, advertising ``base.forward``'s signature.

    generate() inspects ``forward``'s parameters to decide what to pass (``position_ids`` for
    left padding, among others); a bare ``**kwargs`` signature would silently drop them.
    """

    @functools.wraps(base.forward)  # type: ignore[attr-defined]
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return KVConvertMixin.forward(self, *args, **kwargs)

    return forward


def stock_class(config: Any) -> type:
    """The transformers class for this config, looked up in transformers' static name table.

    (Loading remote code registers our dispatcher for e.g. LlamaConfig in the auto mapping, so the
    mutable mapping cannot be trusted to give back the stock class.)
    """
    name = (getattr(config, "kvconvert", None) or {}).get("base_architecture") or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[
        config.model_type
    ]
    return getattr(transformers, name)


def model_class_for(config: Any) -> type:
    base = stock_class(config)
    if getattr(config, "kvconvert", None) is None:
        return base  # a plain checkpoint reached us through the polluted auto mapping
    if base not in _CONCRETE_CLASSES:
        concrete = type(
            f"KVConvert{base.__name__}",
            (KVConvertMixin, base),
            {
                "__module__": __name__,
                "forward": _forward_with_signature_of(base),
                # read once here: a compiled step then sees a constant, not a signature to inspect
                "_kvconvert_cache_argument": cache_argument(base),
                # fp8 exports' k_scale / v_scale tensors are for engines; the runtime reads kv_quant's copy
                "_keys_to_ignore_on_load_unexpected": [
                    *(getattr(base, "_keys_to_ignore_on_load_unexpected", None) or []),
                    r"\.[kv]_scale$",
                ],
            },  # fmt: skip
        )
        # transformers skips its checkpoint renamings (e.g. GPT-NeoX's embed_out -> lm_head) for
        # custom-code classes unless registered under their own name; inherit the stock ones.
        renamings = get_checkpoint_conversion_mapping(base.__name__) or get_checkpoint_conversion_mapping(
            config.kvconvert["base_model_type"]
        )
        if renamings:
            register_checkpoint_conversion_mapping(concrete.__name__, renamings, overwrite=True)
        _CONCRETE_CLASSES[base] = concrete
    return _CONCRETE_CLASSES[base]


class KVConvertForCausalLM:
    """Dispatcher named in ``auto_map``: ``from_pretrained`` returns the concrete model class.

    Deliberately not a ``PreTrainedModel``: transformers registers the auto_map class for the
    source's config class, and the concrete class differs per architecture.
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, config: Any = None, **kwargs: Any):
        if config is None:
            hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            config = KVConvertConfig.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        model_class: Any = model_class_for(config)
        return model_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any):
        model_class: Any = model_class_for(config)
        return model_class._from_config(config, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class: Any = "AutoModelForCausalLM") -> None:
        """Called by transformers after loading remote code; nothing to record for a dispatcher."""
