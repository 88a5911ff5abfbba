"""Routing a transformers model's attention through an observer, or its attention modules' inputs and outputs
through a hook, only inside a ``with`` block."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch

# (module, query [b, H, n, dk] after RoPE, key [b, Hkv, n, dk] after RoPE, value [b, Hkv, n, dk],
#  softmax scale or None for 1/sqrt(dk)) -> None, or replacement (query, key, value) to attend with
AttentionObserver = Callable[
    [Any, torch.Tensor, torch.Tensor, torch.Tensor, float | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
]


@contextlib.contextmanager
def observed_attention(model: Any, observer: AttentionObserver) -> Iterator[None]:
    """Run stock SDPA attention, calling ``observer`` with every layer's q/k/v first (and
    attending with the q/k/v it returns, if any: searches simulate a method this way).

    The function is registered under a fresh name in transformers' ``AttentionInterface`` (the
    one place every supported architecture takes q/k/v after RoPE) and unregistered on exit, and
    the model's previous attention implementation is restored, even when the block raises.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  **kwargs: Any) -> Any:  # fmt: skip
        # observers see CPU tensors (their statistics accumulate in float64 there) wherever the layer runs
        seen = [t if t.device.type == "cpu" else t.cpu() for t in (query, key, value)]
        replaced = observer(module, seen[0], seen[1], seen[2], kwargs.get("scaling"))
        if replaced is not None:
            query, key, value = (t.to(query.device) for t in replaced)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"kvconvert_observe_{uuid.uuid4().hex[:8]}"
    previous = model.config._attn_implementation
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    try:
        model.set_attn_implementation(name)
        yield
    finally:
        model.set_attn_implementation(previous)
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


# (layer, the attention module's input hidden states, its output) -> a replacement output, or None
AttentionIO = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@contextlib.contextmanager
def attention_io(model: Any, attention_paths: list[str], hook: AttentionIO) -> Iterator[None]:
    """Call ``hook`` with each attention module's input hidden states and output (after W_O) as it runs, and
    pass on the tensor it returns instead of the output, if any: a method whose attention is not stock SDPA over
    the source's q/k/v (``lorc --latent mla``) is simulated whole this way. Forward hooks on the modules at
    ``attention_paths`` (layer order), removed on exit."""

    def hook_for(layer: int) -> Any:
        def on_output(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            hidden = args[0] if args else kwargs["hidden_states"]
            replaced = hook(layer, hidden, output[0])
            return None if replaced is None else (replaced.to(output[0]), *output[1:])

        return on_output

    handles = [model.get_submodule(path).register_forward_hook(hook_for(i), with_kwargs=True)
               for i, path in enumerate(attention_paths)]  # fmt: skip
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
