"""Run a checkpoint over calibration chunks one decoder layer at a time.

Only the embeddings, the rotary module and one decoder layer are ever materialised; the rest of
the model lives on the ``meta`` device. The inputs of layer 0 are captured by a stand-in that
stops the forward pass (the GPTQ "catcher"), then each layer is loaded from the checkpoint, run on
every chunk's hidden states, and dropped again. Peak memory: embeddings + one layer (float32) +
the hidden states of all chunks — independent of depth, so models larger than RAM calibrate.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
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
    """Raised by the stand-in for the last layer once every layer's inputs are recorded."""


class _Feeder(nn.Module):
    """Stands in for every decoder layer once all have run: returns the last layer's output for the
    current chunk, so the model's own forward applies its final norm, head and soft-capping."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.value


class _Catcher(nn.Module):
    """Stands in for one decoder layer: records what the model passes it (each layer gets its own
    mask and rotary tables where layer types differ, e.g. Gemma's sliding-window layers) and passes
    the hidden states through; the last one stops the forward pass."""

    def __init__(self, inbox: list[tuple[tuple[Any, ...], dict[str, Any]]], last: bool):
        super().__init__()
        self.inbox, self.last = inbox, last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.inbox.append((args, dict(kwargs)))
        if self.last:
            raise _Captured
        return args[0] if args else kwargs["hidden_states"]


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


# Which branch of a ``run_layer_by_layer(branches=…)`` call the running layer computes (None: the
# unmodified stream); observers read it to apply each branch's own change.
_BRANCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvconvert_branch", default=None)


def active_branch() -> int | None:
    return _BRANCH.get()


# Which chunk the running layer computes: observers that keep something per chunk across branches read it.
_CHUNK: contextvars.ContextVar[int] = contextvars.ContextVar("kvconvert_chunk", default=0)


def active_chunk() -> int:
    return _CHUNK.get()


@torch.no_grad()
def run_layer_by_layer(
    source: SourceCheckpoint,
    adapter: ArchAdapter,
    chunks: torch.Tensor,
    observe: Callable[[nn.Module], Any],
    progress: bool = True,
    logits: Callable[[int, torch.Tensor], Any] | None = None,
    branches: list[int] | None = None,
    branch_logits: Callable[[int, int, torch.Tensor], Any] | None = None,
    repeat: Callable[[int], bool] | None = None,
    tail: int = 0,
) -> None:
    """Feed ``chunks [n, T]`` through the model layer by layer.

    ``observe(model)`` returns a context manager that is active while the layers run (it sees
    the skeleton model, e.g. to route its attention through an observer). ``logits(c, [T, vocab])``,
    when given, receives each chunk's output logits (the model's own norm and head run at the end;
    memory: one chunk's logits at a time), on the CPU.

    The layers run on ``devices.compute_device()`` (the CPU unless the caller is inside a
    ``computing_on`` block): one decoder layer there at a time, plus the embeddings, final norm and
    rotary tables; observers and ``logits`` get CPU tensors.

    ``branches[b] = l``: branch b forks from the unmodified stream at layer l's input and runs layers
    l.. with ``active_branch() == b`` (observers change what they like there); ``branch_logits(b, c,
    [T, vocab])`` receives its logits. Many single-layer probes thus share every layer before their
    own and each layer is loaded once: Σ (L − l) layer passes instead of L per probe. Memory: one
    hidden-state copy per branch. Models that transformers must load whole do not branch.

    ``repeat(l)``, asked after layer l has run every chunk of every stream: True runs the layer again
    on the same inputs and passes that run's outputs on (an observer that fitted something to the first
    run applies it in the second, so later layers see the changed stream; GPTQ's sequential order).

    ``tail`` > 0 (with ``branches``): a branch forks only the last ``tail`` positions of each chunk, and they
    attend to the unmodified stream's keys and values of every position before them, as a decode step reads
    the cache a prefill wrote (an observer sees those keys and values with the tail's own behind them). The
    prefix never changes, so probing what a cache costs the question at the end of a long prompt costs a
    tail's forward per branch, not the prompt's. ``logits`` and ``branch_logits`` then get ``[tail, vocab]``.
    """
    import transformers

    from kvconvert.devices import compute_device

    device = compute_device()

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
        if branches or repeat or tail:
            raise KVConvertError(f"{type(model).__name__}: layer-by-layer fitting needs a checkpoint stored as built")
        model = cls.from_pretrained(str(source.path), dtype=torch.float32).eval().to(device)
        with observe(model):
            for c, row in enumerate(chunks):
                out = model(input_ids=row[None].to(device), use_cache=False)
                if logits is not None:
                    logits(c, out.logits[0].cpu())
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
            setattr(model.get_submodule(parent) if parent else model, leaf, fresh.float().to(device))
            continue
        _materialize(child, name + ".", source, base_prefix, model._init_weights)
        child.to(device)
    if tail and (repeat is not None or not 0 < tail < chunks.shape[1]):
        raise ValueError(f"a tail of {tail} positions needs branches without repeat and chunks longer than it")
    inboxes: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = [[] for _ in layers]
    skeleton = list(layers)
    with observe(model):  # entered while the model holds its own layers: observers may hook their modules
        for index in range(len(layers)):
            layers[index] = _Catcher(inboxes[index], last=index == len(layers) - 1)
        for row in chunks:
            with contextlib.suppress(_Captured):
                model(input_ids=row[None].to(device), use_cache=False)
        hidden = [args[0] if args else kwargs.pop("hidden_states") for args, kwargs in inboxes[0]]
        for inbox in inboxes[1:]:
            for _, kwargs in inbox:
                kwargs.pop("hidden_states", None)  # each layer gets the previous one's output instead
        streams: dict[int | None, list[torch.Tensor]] = {None: hidden}
        bar = tqdm(range(len(layers)), desc="calibrating", unit="layer", disable=not progress)
        for index in bar:
            layer = layers[index] = skeleton[index]
            _materialize(layer, f"{layers_prefix}{index}.", source, base_prefix, model._init_weights)
            layer.to(device)
            streams.update({b: [h[:, -tail:].clone() if tail else h for h in hidden]
                            for b, start in enumerate(branches or []) if start == index})  # fmt: skip
            inputs = {b: list(states) for b, states in streams.items()} if repeat is not None else {}
            prefixes: list[_Prefix] = [_Prefix(tail) for _ in inboxes[index]] if tail else []
            for branch, states in streams.items():
                _run_layer(layer, branch, states, states, inboxes[index], adapter.layer_cache_argument(layer), prefixes)
            if repeat is not None and repeat(index):
                for branch, states in streams.items():
                    _run_layer(layer, branch, inputs[branch], states, inboxes[index])
            layers[index] = layer.to("meta")  # frees this layer's weights
        if logits is None and branch_logits is None:
            return
        _materialize_head(model, head, source, base_prefix, adapter.stored_head)
        head.to(device)
        feeder = _Feeder()
        for index in range(len(layers)):
            layers[index] = feeder
        for branch, states in streams.items():
            if (logits if branch is None else branch_logits) is None:
                continue
            for c, row in enumerate(chunks):
                feeder.value = states[c][:, -tail:] if tail else states[c]
                ids = row[-tail:] if tail else row  # the feeder stands for every layer: only the length matters
                out = model(input_ids=ids[None].to(device), use_cache=False).logits[0].cpu()
                if branch is None:
                    assert logits is not None
                    logits(c, out)
                else:
                    assert branch_logits is not None
                    branch_logits(branch, c, out)


class _Prefix:
    """Stands in for a layer's KV cache (``update`` is all attention calls) in a ``tail`` run: on the unmodified
    stream it keeps the keys and values of the positions before the tail, and on a branch's tail it puts them in
    front of the tail's own."""

    def __init__(self, tail: int):
        self.tail = tail
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self.kv is None:  # the unmodified stream, which runs first
            self.kv = key[..., : -self.tail, :], value[..., : -self.tail, :]
            return key, value
        return torch.cat([self.kv[0], key], dim=-2), torch.cat([self.kv[1], value], dim=-2)


def _by_name(layer: nn.Module, hidden: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A layer call's arguments by name (some models pass the mask or cache by position), ``**kwargs`` merged in."""
    bound = inspect.signature(layer.forward).bind(hidden, *args, **kwargs)
    extra = next((p.name for p in bound.signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    named = {k: v for k, v in bound.arguments.items() if k != extra}
    return {**named, **(bound.arguments.get(extra, {}) if extra else {})}


@functools.lru_cache(maxsize=4)
def _tail_mask(tail: int, total: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, tail, total]``: the last ``tail`` positions see every position before them and themselves."""
    return torch.ones(tail, total, dtype=torch.bool, device=device).tril(total - tail)[None, None]


def _tail_arguments(arguments: dict[str, Any], tail: int, total: int, device: torch.device) -> None:
    """Cut a layer call's per-position arguments to the last ``tail`` of ``total`` positions, the attention
    mask to the tail's rows over every position (causal: the tail sees all of the prefix)."""
    for name, value in arguments.items():
        if name == "attention_mask":
            arguments[name] = _tail_mask(tail, total, device) if value is None else value[..., -tail:, :]
        elif name == "position_embeddings" and value is not None:
            arguments[name] = tuple(t[..., -tail:, :] for t in value)
        elif name == "position_ids" and value is not None:
            arguments[name] = value[..., -tail:]
        elif name == "cache_position" and value is not None:
            arguments[name] = value[-tail:]


def _run_layer(layer: nn.Module, branch: int | None, states: list[torch.Tensor], out: list[torch.Tensor],
               inbox: list[tuple[tuple[Any, ...], dict[str, Any]]], cache_argument: str = "past_key_values",
               prefixes: list[_Prefix] | None = None) -> None:  # fmt: skip
    """``out[c] = layer(states[c])`` for every chunk, with ``active_branch() == branch``; with ``prefixes``
    (a ``tail`` run) the layer's cache argument is chunk c's ``_Prefix``."""
    token = _BRANCH.set(branch)
    try:
        for c, (args, kwargs) in enumerate(inbox):
            _CHUNK.set(c)
            if not prefixes:
                result = layer(states[c], *args[1:], **kwargs)
            else:
                arguments = _by_name(layer, states[c], args[1:], kwargs)
                arguments[cache_argument] = prefixes[c]
                if branch is not None:
                    kv = prefixes[c].kv
                    assert kv is not None, "the unmodified stream runs a layer before its branches"
                    _tail_arguments(arguments, prefixes[c].tail, kv[0].shape[-2] + prefixes[c].tail, states[c].device)
                result = layer(**arguments)
            out[c] = result[0] if isinstance(result, tuple) else result
    finally:
        _BRANCH.reset(token)


def _materialize_head(model: Any, head: nn.Module, source: SourceCheckpoint, base_prefix: str,
                      stored_as: str | None = None) -> None:  # fmt: skip
    """Load the output head: the input embedding's weight where the two are tied, else its own tensors (under
    ``stored_as`` where the checkpoint names the head apart from the model's module)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "tie_word_embeddings", False):
        head.weight = model.get_input_embeddings().weight
        return
    name = next(n for n, m in model.named_modules() if m is head)
    if stored_as and f"{name}.weight" not in set(source.tensor_names()):
        name = stored_as
    _materialize(head, name + ".", source, base_prefix, model._init_weights)
