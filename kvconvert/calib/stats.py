"""Per-head second moments of Q, K and V, accumulated online in float64 while the model runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconvert.calib.hooks import observed_attention

F64 = torch.float64


@dataclass
class HeadGrams:
    """Running Gram matrices per (layer, KV head), all ``[L, Hkv, dk, dk]`` float64.

    ``query``: Σ over the group's query heads and all tokens of qᵀq (after RoPE); ``key``: kᵀk
    (after RoPE); ``value``: vᵀv. Stacking Q‖K (or V‖·) along the sequence and taking its SVD
    (ZACK fig. 9) is the eigendecomposition of the sum of the parts, so only d×d sums are kept,
    never activations. ``tokens [L]``: tokens seen per layer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    query: torch.Tensor = field(init=False)
    key: torch.Tensor = field(init=False)
    value: torch.Tensor = field(init=False)
    tokens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.num_kv_heads, self.head_dim, self.head_dim)
        self.query = torch.zeros(shape, dtype=F64)
        self.key = torch.zeros(shape, dtype=F64)
        self.value = torch.zeros(shape, dtype=F64)
        self.tokens = torch.zeros(self.num_layers, dtype=torch.long)

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """query ``[b, H, n, dk]``, key/value ``[b, Hkv, n, dk]`` (query heads of a group adjacent)."""
        b, heads, n, dk = query.shape
        kv_heads = key.shape[1]
        grouped = query.to(F64).view(b, kv_heads, heads // kv_heads, n, dk)
        self.query[layer] += torch.einsum("bgjnd,bgjne->gde", grouped, grouped)
        key, value = key.to(F64), value.to(F64)
        self.key[layer] += torch.einsum("bgnd,bgne->gde", key, key)
        self.value[layer] += torch.einsum("bgnd,bgne->gde", value, value)
        self.tokens[layer] += b * n


@contextlib.contextmanager
def accumulating_grams(model: Any, num_kv_heads: int, head_dim: int) -> Iterator[HeadGrams]:
    """Accumulate ``HeadGrams`` of every attention layer of ``model`` while the block runs."""
    grams = HeadGrams(model.config.num_hidden_layers, num_kv_heads, head_dim)

    def observe(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> None:
        grams.add(int(module.layer_idx), query, key, value)

    with observed_attention(model, observe):
        yield grams


def collect_head_grams(source: Any, adapter: Any, chunks: torch.Tensor, progress: bool = True) -> HeadGrams:
    """``HeadGrams`` of a checkpoint over ``chunks [n, T]``, computed one decoder layer at a time."""
    layout = adapter.layout()
    grams = observe_layers(source, adapter, chunks, [
        lambda model: accumulating_grams(model, layout.num_kv_heads, layout.head_dim),
    ], progress)  # fmt: skip
    return grams[0]


@contextlib.contextmanager
def accumulating_input_grams(model: Any, attention_paths: list[str]) -> Iterator[list[torch.Tensor | None]]:
    """Σ xᵀx over every token of the hidden states entering each attention module (the inputs of
    W_Q, W_K, W_V), float64 on the CPU: ``grams[layer] [D, D]`` (None until that layer has run).
    Forward pre-hooks on the modules at ``attention_paths``, removed on exit."""
    grams: list[torch.Tensor | None] = [None] * len(attention_paths)

    def hook_for(layer: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            x = x.reshape(-1, x.shape[-1]).to(F64)
            gram = (x.T @ x).cpu()
            grams[layer] = gram if grams[layer] is None else grams[layer] + gram

        return hook

    handles = [model.get_submodule(path).register_forward_pre_hook(hook_for(i), with_kwargs=True)
               for i, path in enumerate(attention_paths)]  # fmt: skip
    try:
        yield grams
    finally:
        for handle in handles:
            handle.remove()


def observe_layers(
    source: Any, adapter: Any, chunks: torch.Tensor, observers: Sequence[Callable[[Any], Any]], progress: bool = True
) -> list[Any]:
    """Feed ``chunks [n, T]`` through the checkpoint one decoder layer at a time with every observer's context
    manager (``observer(model)``, e.g. ``accumulating_grams``) entered around the pass; what each one yielded,
    in order."""
    from kvconvert.calib.sequential import run_layer_by_layer

    result: list[Any] = []

    @contextlib.contextmanager
    def observe(model: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            result.extend(stack.enter_context(observer(model)) for observer in observers)
            yield

    run_layer_by_layer(source, adapter, chunks, observe, progress=progress)
    return result


def complete_input_grams(inputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``accumulating_input_grams``' result, checked: every attention layer ran."""
    missing = [i for i, g in enumerate(inputs) if g is None]
    if missing:
        raise RuntimeError(f"attention layers {missing} never ran during calibration")
    return [g for g in inputs if g is not None]


def collect_layer_grams(
    source: Any, adapter: Any, chunks: torch.Tensor, progress: bool = True
) -> tuple[list[torch.Tensor], HeadGrams]:
    """Each attention layer's input Gram ``[D, D]`` and its per-head ``HeadGrams`` over ``chunks [n, T]``,
    float64, in one layer-by-layer pass."""
    layout = adapter.layout()
    inputs, heads = observe_layers(source, adapter, chunks, [
        lambda model: accumulating_input_grams(model, adapter.attention_module_paths()),
        lambda model: accumulating_grams(model, layout.num_kv_heads, layout.head_dim),
    ], progress)  # fmt: skip
    return complete_input_grams(inputs), heads
