"""Run a checkpoint over calibration chunks one decoder layer at a time.

Only the embeddings, the rotary module and one decoder layer are ever materialised; the rest of
the model lives on the ``meta`` device. The inputs of layer 0 are captured by a stand-in that
stops the forward pass (the GPTQ "catcher"), then each layer is loaded from the checkpoint, run on
every chunk's hidden states, and dropped again. Peak memory: embeddings + one layer (float32) +
the hidden states of all chunks — independent of depth, so models larger than RAM calibrate.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from kvconvert.arch import ArchAdapter
from kvconvert.errors import KVConvertError
from kvconvert.io.source import SourceCheckpoint


class _Captured(Exception):
    """Raised by the stand-in for layer 0 once it has recorded its inputs."""


class _Catcher(nn.Module):
    def __init__(self, inbox: list[tuple[tuple[Any, ...], dict[str, Any]]]):
        super().__init__()
        self.inbox = inbox

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.inbox.append((args, kwargs))
        raise _Captured


def _checkpoint_name(name: str, available: set[str], base_prefix: str) -> str:
    for candidate in (name, name.removeprefix(base_prefix + ".")):
        if candidate in available:
            return candidate
    raise KVConvertError(f"calibration: the checkpoint has no tensor for {name!r} (not a standard layout?)")


def _stored_as_built(model: nn.Module, source: SourceCheckpoint, base_prefix: str) -> bool:
    """Does every parameter of the first decoder layer and of everything around the layers have a
    checkpoint tensor of its own name? (False for checkpoints that transformers converts on load.)"""
    available = set(source.tensor_names())
    for name, _ in model.named_parameters():
        if ".layers." in name and ".layers.0." not in name:
            continue  # layer 0 stands for every layer
        if name.startswith("lm_head.") and name not in available:
            continue  # tied to the embedding
        if name not in available and name.removeprefix(base_prefix + ".") not in available:
            return False
    return True


def _materialize(
    module: nn.Module, prefix: str, source: SourceCheckpoint, base_prefix: str, init: Callable[[nn.Module], Any]
) -> None:
    """Replace ``module``'s meta parameters and persistent buffers by float32 checkpoint tensors.

    Non-persistent buffers (values computed from the config, e.g. Gemma's embedding scale) are not in
    a checkpoint: they are allocated and filled by the model's own ``_init_weights`` (``init``)
    before the parameters are loaded, so that initialiser's random draws on them never survive."""
    available = set(source.tensor_names())
    for path, owner in module.named_modules():
        full = f"{prefix}{path}." if path else prefix
        computed = [n for n in owner._non_persistent_buffers_set if getattr(owner._buffers.get(n), "is_meta", False)]
        if computed:
            for name in computed:
                meta = owner._buffers[name]
                assert meta is not None
                owner._buffers[name] = torch.zeros(meta.shape, dtype=meta.dtype)
            init(owner)
        slots = [(n, owner._parameters) for n in owner._parameters if owner._parameters[n] is not None]
        slots += [(n, owner._buffers) for n in owner._buffers if n not in owner._non_persistent_buffers_set]
        for leaf, store in slots:
            tensor = source.get(_checkpoint_name(full + leaf, available, base_prefix))
            tensor = tensor.float() if tensor.is_floating_point() else tensor
            store[leaf] = nn.Parameter(tensor, requires_grad=False) if store is owner._parameters else tensor
    leftover = next((n for n, t in chain(module.named_parameters(), module.named_buffers()) if t.is_meta), None)
    if leftover is not None:
        raise KVConvertError(f"calibration cannot build {prefix}{leftover}: it is not in the checkpoint")
    source.release()


@torch.no_grad()
def run_layer_by_layer(
    source: SourceCheckpoint,
    adapter: ArchAdapter,
    chunks: torch.Tensor,
    observe: Callable[[nn.Module], Any],
    progress: bool = True,
) -> None:
    """Feed ``chunks [n, T]`` through the model layer by layer.

    ``observe(model)`` returns a context manager that is active while the layers run (it sees
    the skeleton model, e.g. to route its attention through an observer).
    """
    import transformers

    cls = getattr(transformers, adapter.causal_lm_class_name())
    config = source.config
    with torch.device("meta"):
        model = cls(config).eval()
    layers = model.get_submodule(adapter.decoder_layers_path())
    layers_prefix = adapter.decoder_layers_path() + "."
    head = model.get_output_embeddings()
    base_prefix = model.base_model_prefix
    layout = adapter.layout()
    if not _stored_as_built(model, source, base_prefix):
        # transformers renames or fuses this checkpoint's tensors while loading (MoE experts stored one
        # by one, fused into one tensor per layer): only its own loader knows how, so load it whole
        warnings.warn(
            f"{type(model).__name__} checkpoints are stored under names transformers converts while loading "
            "(e.g. MoE experts): calibration loads the whole model in float32 instead of one layer at a time",
            stacklevel=2,
        )
        model = cls.from_pretrained(str(source.path), dtype=torch.float32).eval()
        with observe(model):
            for row in chunks:
                model(input_ids=row[None], use_cache=False)
        return

    # Everything but the decoder layers and the LM head: embeddings, final norm, rotary tables.
    for name, child in list(model.named_modules()):
        if not name or name == adapter.decoder_layers_path() or name.startswith(layers_prefix):
            continue
        if child is head or any(True for _ in child.children()):
            continue  # leaves only; the head is never run
        if layout.rotary_module and name == layout.rotary_module:
            parent, _, leaf = name.rpartition(".")
            fresh = type(child)(config=config)  # its tables are non-persistent buffers computed at init
            setattr(model.get_submodule(parent) if parent else model, leaf, fresh.float())
            continue
        _materialize(child, name + ".", source, base_prefix, model._init_weights)
    inbox: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    first = layers[0]
    layers[0] = _Catcher(inbox)
    with observe(model):
        for row in chunks:
            with contextlib.suppress(_Captured):
                model(input_ids=row[None], use_cache=False)
        layers[0] = first
        hidden = [args[0] if args else kwargs.pop("hidden_states") for args, kwargs in inbox]
        extra = [(args[1:], kwargs) for args, kwargs in inbox]
        bar = tqdm(range(len(layers)), desc="calibrating", unit="layer", disable=not progress)
        for index in bar:
            layer = layers[index]
            _materialize(layer, f"{layers_prefix}{index}.", source, base_prefix, model._init_weights)
            for c, (args, kwargs) in enumerate(extra):
                out = layer(hidden[c], *args, **kwargs)
                hidden[c] = out[0] if isinstance(out, tuple) else out
            layers[index] = layer.to("meta")  # frees this layer's weights
