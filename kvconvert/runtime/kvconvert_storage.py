"""transformers cache layers over ``TokenStore``: ``KVLayer`` (one protocol every method's cache
speaks), ``QuantizedLayer`` and its sliding-window variant. Copied verbatim into every output directory;
imports only torch and transformers."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kvconvert_codec import FP8, QuantSpec, fp8_read, fp8_store
from .kvconvert_fp8_kernel import fp8_decode_triton
from .kvconvert_kernels import use_kernels
from .kvconvert_prefill import additive_mask
from .kvconvert_staticstore import StaticTokenStore
from .kvconvert_tokenstore import TokenStore


def select_rows_fn(index: torch.Tensor) -> Any:
    """``fn`` for ``TokenStore.apply`` and friends: new row i is old row ``index[i]``."""
    return lambda t: t.index_select(0, index.to(t.device))


class KVLayer(DynamicLayer):
    """Base of every kvconvert cache layer: the batch edits that generate() makes (beam reordering,
    batch selection and repetition) are all ``select_rows``; ``crop_to``, ``apply`` and
    ``get_seq_length`` complete the protocol. Subclasses hold their state however they like."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / repeat / reorder batch rows: new row i is old row ``index[i]``. By default every state
        tensor has the batch on dim 0; a layer whose state is indexed otherwise overrides this."""
        self.apply(select_rows_fn(index))

    def rows(self) -> int:
        """Batch rows held (0 before the first update)."""
        raise NotImplementedError

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` tokens."""
        raise NotImplementedError

    def apply(self, fn: Any) -> None:
        """Apply ``fn`` to every state tensor (device moves)."""
        raise NotImplementedError

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.rows():
            self.select_rows(torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows():
            self.select_rows(torch.arange(self.rows()).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.rows():
            self.select_rows(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop() takes a negative number of tokens to remove")
        if tokens_to_remove:
            self.crop_to(max(0, self.get_seq_length() + tokens_to_remove))

    def offload(self) -> None:
        if self.is_initialized:
            self.apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized:
            self.apply(lambda t: t.to(self.device, non_blocking=True))


class QuantizedLayer(KVLayer):
    """A stock attention layer's ``[b, Hkv, n, d]`` keys and values in quantized storage: keys per
    channel, values per token. ``update`` returns the past (dequantized) with this step's exact states."""

    def __init__(self, quant: QuantSpec, layer: int = 0):
        super().__init__()
        self.quant, self.layer = quant, layer
        self.reset()

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        return self.key_store.extend(key_states), self.value_store.extend(value_states)

    def get_seq_length(self) -> int:
        return len(self.key_store)

    def rows(self) -> int:
        return 0 if self.key_store.tail is None else self.key_store.tail.shape[0]

    def crop_to(self, length: int) -> None:
        self.key_store.crop(length)
        self.value_store.crop(length)

    def apply(self, fn: Any) -> None:
        self.key_store.apply(fn)
        self.value_store.apply(fn)

    def reset(self) -> None:
        self.key_store = TokenStore(self.quant.side(self.layer, keys=True), per_channel=True)
        self.value_store = TokenStore(self.quant.side(self.layer, keys=False), per_channel=False)
        self.keys = self.values = None
        self.is_initialized = False


class RoutedLayer(KVLayer):
    """A layer that reads its own store once the model's attention is routed to it (``configure``: kvconvert's
    attention function calls its ``attend``). Until ``attend`` is first called, ``update`` does what a stock attention
    needs (returns every token), so a model whose attention was not routed reads it as a plain layer; that first call
    attends to what ``update`` returned, and from then on ``update`` only stores and ``attend_routed`` reads."""

    routed = False

    def reset(self) -> None:
        super().reset()
        self.routed = False

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        if not self.routed:
            self.routed = True
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        return self.attend_routed(module, query, key, value, attention_mask, scaling, **kwargs)

    def attend_routed(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        """Attention over this layer's store (``key``/``value``: this step's states, stored by ``update``)."""
        raise NotImplementedError


class Fp8Reads(RoutedLayer):
    """What the fp8 layers share (``RoutedLayer``): decode steps that read the codes through ``fp8_decode_triton``
    when the kernels are asked for, or by default on an NVIDIA GPU (``use_kernels``); prefill and every step without
    the kernel read the codes back for SDPA."""

    key_scale: torch.Tensor
    value_scale: torch.Tensor
    # float32 in any model dtype (what the engines read); a float32 run's bytes counted as 16-bit keep them at 4
    _keep_in_fp32 = ("key_scale", "value_scale")
    dtype: torch.dtype

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Key and value codes ``[b, Hkv, n, d]`` (this step's stored), and the tokens written (None: all n)."""
        raise NotImplementedError

    def attend_routed(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        keys, values, length = self._codes()
        if query.shape[2] == 1 and use_kernels(query, default="gpu"):
            batch, heads, _, dim = query.shape
            bias = additive_mask(attention_mask, 1, keys.shape[2], torch.float32, query.device)
            bias = None if bias is None else bias[:, 0, 0].expand(batch, -1)
            q = query.view(batch, keys.shape[1], heads // keys.shape[1], dim)
            out = fp8_decode_triton(q, keys, values, self.key_scale, self.value_scale, bias, scaling, length)
            return out.to(query.dtype).view(batch, 1, heads, dim), None
        k, v = fp8_read(keys.view(FP8), self.key_scale, self.dtype), fp8_read(values.view(FP8), self.value_scale,
                                                                               self.dtype)  # fmt: skip
        return sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling, **kwargs)


class Fp8Layer(Fp8Reads):
    """A stock attention layer's ``[b, Hkv, n, d]`` keys and values as float8 e4m3 codes with the layer's
    static scales (``QuantSpec.scales``): what vLLM and SGLang store for the same checkpoint. ``update``
    returns every token read back, this step's too, as the engines attend to them (``Fp8Reads``: or, routed, reads
    them itself)."""

    key_codes: torch.Tensor | None
    value_codes: torch.Tensor | None

    def __init__(self, quant: QuantSpec, layer: int = 0):
        super().__init__()
        if quant.scales is None:
            raise ValueError("fp8 storage needs calibrated scales; this checkpoint's kv_quant has none")
        k, v = quant.scales[layer]
        self.key_scale, self.value_scale = torch.tensor(k), torch.tensor(v)
        self.reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.key_scale, self.value_scale = self.key_scale.to(self.device), self.value_scale.to(self.device)
            self.is_initialized = True
        new_keys, new_values = fp8_store(key_states, self.key_scale), fp8_store(value_states, self.value_scale)
        self.key_codes = new_keys if self.key_codes is None else torch.cat([self.key_codes, new_keys], dim=-2)
        self.value_codes = new_values if self.value_codes is None else torch.cat([self.value_codes, new_values], -2)
        if self.routed:
            return key_states, value_states
        return (fp8_read(self.key_codes, self.key_scale, self.dtype),
                fp8_read(self.value_codes, self.value_scale, self.dtype))  # fmt: skip

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        assert self.key_codes is not None and self.value_codes is not None
        return self.key_codes, self.value_codes, None

    def get_seq_length(self) -> int:
        return 0 if self.key_codes is None else self.key_codes.shape[-2]

    def rows(self) -> int:
        return 0 if self.key_codes is None else self.key_codes.shape[0]

    def crop_to(self, length: int) -> None:
        if self.key_codes is not None and self.value_codes is not None:
            self.key_codes, self.value_codes = self.key_codes[..., :length, :], self.value_codes[..., :length, :]

    def apply(self, fn: Any) -> None:
        if self.key_codes is not None and self.value_codes is not None:
            self.key_codes, self.value_codes = fn(self.key_codes), fn(self.value_codes)

    def reset(self) -> None:
        self.key_codes = self.value_codes = None
        self.keys = self.values = None
        self.is_initialized = self.routed = False


def in_graph(device: torch.device) -> bool:
    """Inside a ``torch.compile`` trace or a CUDA-graph capture on ``device``: a step may not read device values on
    the host (a capture fails on the first such read), so the eager checks that need one are skipped. Asked only for
    CUDA tensors: the query would start a CUDA context on a GPU machine that runs the model on its CPU."""
    return torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class StaticKVLayer(KVLayer):
    """Base of kvconvert's preallocated cache layers (``generate(cache_implementation="static")``): state buffers
    of ``max_cache_len`` tokens (the attributes named in ``buffers``, or what ``_held`` returns), written in place at
    slots counted by a 0-d tensor, so that a decode step has the same shapes and tensor addresses every time
    (``torch.compile``, CUDA graphs). Masks are sized for the whole buffer, as transformers' ``StaticLayer`` sizes
    them: the slots not written yet are masked out."""

    is_compileable = True
    buffers: tuple[str, ...] = ()

    def __init__(self, max_cache_len: int):
        super().__init__()
        self.max_cache_len = max_cache_len
        # tokens written: a tensor, as transformers' StaticLayer keeps it (a Python int would be baked into a
        # compiled graph)
        self.filled = torch.tensor(0)
        for name in self.buffers:
            setattr(self, name, None)

    def _held(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, name) for name in self.buffers) if t is not None]

    def _initialized(self, device: torch.device) -> None:
        """Called once the buffers are allocated (on ``device``): fixes their addresses."""
        self.filled = self.filled.to(device)
        if not torch.compiler.is_compiling():  # fixed addresses: what CUDA graphs replay against
            for buffer in (*self._held(), self.filled):
                torch._dynamo.mark_static_address(buffer)
        self.is_initialized = True

    def slots(self, count: int) -> torch.Tensor:
        """Where the next ``count`` tokens go (``[count]`` int64)."""
        return torch.arange(count, device=self.filled.device) + self.filled

    def _check_room(self, count: int) -> None:
        """One line instead of an index error when ``count`` more tokens do not fit (eagerly: a compiled or captured
        step cannot raise, as with transformers' ``StaticLayer``, which never checks). Then the caller writes, and
        ``_advance``s."""
        if not in_graph(self.filled.device) and int(self.filled) + count > self.max_cache_len:
            raise ValueError(f"this static cache holds {self.max_cache_len} tokens and already has "
                             f"{int(self.filled)}: {count} more do not fit; generate with a larger "
                             "max_length / max_cache_len, or cache_implementation='dynamic'")  # fmt: skip

    def _advance(self, count: int) -> None:
        self.filled.add_(count)

    def get_seq_length(self) -> Any:
        return self.filled if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def rows(self) -> int:
        held = self._held()
        return held[0].shape[0] if held else 0

    def crop_to(self, length: int) -> None:
        """Later slots are left as they are: the mask hides them until they are written again."""
        self.filled.fill_(min(length, int(self.filled)))

    def apply(self, fn: Any) -> None:
        for name in self.buffers:
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def reset(self) -> None:
        """Zeroed in place: the buffers keep their addresses for the next generation."""
        for buffer in self._held():
            buffer.zero_()
        self.filled.zero_()


class StaticFp8Layer(Fp8Reads, StaticKVLayer):
    """``Fp8Layer`` preallocated for ``max_cache_len`` tokens (``StaticKVLayer``): codes ``[b, Hkv, max_cache_len,
    d]`` held as uint8 (torch has no ``index_copy_`` for float8 on the CPU; the bytes are the e4m3 codes), read
    back whole with the layer's static scales, as ``Fp8Layer`` reads its growing codes (``Fp8Reads``: or, routed,
    through the kernel, which reads the slots written so far)."""

    buffers = ("key_codes", "value_codes")
    key_codes: torch.Tensor | None
    value_codes: torch.Tensor | None

    def __init__(self, quant: QuantSpec, layer: int, max_cache_len: int):
        super().__init__(max_cache_len)
        if quant.scales is None:
            raise ValueError("fp8 storage needs calibrated scales; this checkpoint's kv_quant has none")
        k, v = quant.scales[layer]
        self.key_scale, self.value_scale = torch.tensor(k), torch.tensor(v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        count = key_states.shape[-2]
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.key_scale, self.value_scale = self.key_scale.to(self.device), self.value_scale.to(self.device)
            batch, heads, _, _ = key_states.shape
            self.key_codes = torch.zeros(batch, heads, self.max_cache_len, key_states.shape[-1], dtype=torch.uint8,
                                         device=self.device)  # fmt: skip
            self.value_codes = torch.zeros(batch, heads, self.max_cache_len, value_states.shape[-1],
                                           dtype=torch.uint8, device=self.device)  # fmt: skip
            self._initialized(self.device)
        assert self.key_codes is not None and self.value_codes is not None
        self._check_room(count)
        slots = self.slots(count)
        self.key_codes.index_copy_(2, slots, fp8_store(key_states, self.key_scale).view(torch.uint8))
        self.value_codes.index_copy_(2, slots, fp8_store(value_states, self.value_scale).view(torch.uint8))
        self._advance(count)
        if self.routed:
            return key_states, value_states
        return (fp8_read(self.key_codes.view(FP8), self.key_scale, self.dtype),
                fp8_read(self.value_codes.view(FP8), self.value_scale, self.dtype))  # fmt: skip

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        assert self.key_codes is not None and self.value_codes is not None
        return self.key_codes, self.value_codes, self.filled


class StaticStoreLayer(StaticKVLayer):
    """``QuantizedLayer`` (or, as ``StaticLatentLayer``, ``LatentLayer``) preallocated for ``max_cache_len`` tokens
    (``StaticKVLayer``): keys per channel and values per token in ``StaticTokenStore``s, which hold what the growing
    layers' stores hold (plain buffers at 16 bits). ``update`` takes ``[..., q, w]`` states (values optional) and
    returns every slot ``[..., max_cache_len, w]``, the past below the quantized count from its codes, the rest
    exact."""

    def __init__(self, max_cache_len: int, quant: QuantSpec | None = None, layer: int = 0):
        super().__init__(max_cache_len)
        self.quant, self.layer = quant or QuantSpec(), layer
        self.key_store = StaticTokenStore(self.quant.side(layer, keys=True), True, max_cache_len)
        self.value_store: StaticTokenStore | None = None

    def _held(self) -> list[torch.Tensor]:
        return self.key_store.held() + ([] if self.value_store is None else self.value_store.held())

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        count = key_states.shape[-2]
        first = not self.is_initialized
        if first:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.filled = self.filled.to(self.device)
        self._check_room(count)
        keys = self.key_store.extend(key_states, self.filled)
        values = None
        if value_states is not None:
            if self.value_store is None:
                side = self.quant.side(self.layer, keys=False)
                self.value_store = StaticTokenStore(side, False, self.max_cache_len)
            values = self.value_store.extend(value_states, self.filled)
        if first:  # the stores allocate at their first tokens
            self._initialized(self.device)
        self._advance(count)
        return keys, values

    def apply(self, fn: Any) -> None:
        self.key_store.apply(fn)
        if self.value_store is not None:
            self.value_store.apply(fn)

    def crop_to(self, length: int) -> None:
        """Quantized: only to the length held (the float tokens a shorter cache would need again are overwritten)."""
        if self.quant.quantized and length < int(self.filled):
            raise ValueError("a static quantized cache cannot be cropped; use cache_implementation='dynamic'")
        super().crop_to(length)


def stock_layer(quant: QuantSpec, layer: int) -> DynamicLayer:
    """The cache layer of a layer a method leaves untouched: transformers' own, or quantized."""
    if quant.fp8:
        return Fp8Layer(quant, layer)
    quantized = quant.side(layer, keys=True).quantized or quant.side(layer, keys=False).quantized
    return QuantizedLayer(quant, layer) if quantized else DynamicLayer()


def static_stock_layer(quant: QuantSpec, layer: int, max_cache_len: int) -> CacheLayerMixin:
    """``stock_layer`` preallocated for ``max_cache_len`` tokens (a static cache)."""
    if quant.fp8:
        return StaticFp8Layer(quant, layer, max_cache_len)
    quantized = quant.side(layer, keys=True).quantized or quant.side(layer, keys=False).quantized
    return StaticStoreLayer(max_cache_len, quant, layer) if quantized else StaticLayer(max_cache_len)


class QuantizedSlidingLayer(QuantizedLayer):
    """``QuantizedLayer`` for a sliding-window layer: like transformers' ``DynamicSlidingWindowLayer``
    it keeps the newest ``window − 1`` tokens after each step (older blocks are freed as they leave)
    and gives the masks the same sizes."""

    is_sliding = True

    def __init__(self, quant: QuantSpec, layer: int, window: int):
        self.sliding_window = window
        super().__init__(quant, layer)

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ):
        keys, values = super().update(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        excess = len(self.key_store) - (self.sliding_window - 1)
        if excess > 0:
            self.key_store.drop_front(excess)
            self.value_store.drop_front(excess)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of the attention mask, as ``DynamicSlidingWindowLayer`` gives them."""
        offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        held = min(self.cumulative_length, self.sliding_window - 1)
        return held + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop_to(self, length: int) -> None:
        if length < self.cumulative_length:
            raise ValueError("a sliding-window cache cannot be cropped: the tokens it dropped are gone")


def static_sliding_layer(spec: dict[str, Any], layer: int, max_cache_len: int) -> CacheLayerMixin | None:
    """``sliding_layer`` preallocated (a static cache): transformers' own ``StaticSlidingWindowLayer`` for a
    sliding-window layer kept stock; None for a global layer."""
    if layer not in (spec.get("local_layers") or ()):
        return None
    return StaticSlidingWindowLayer(max_cache_len, int(spec["sliding_window"]))


def sliding_layer(spec: dict[str, Any], layer: int) -> DynamicLayer | None:
    """The cache layer of a sliding-window layer between global ones (Gemma 2/3): transformers' own,
    which already holds at most the window, or a quantized one when the storage includes local
    layers. None for a global layer."""
    if layer not in (spec.get("local_layers") or ()):
        return None
    quant, window = QuantSpec.from_spec(spec), int(spec["sliding_window"])
    if quant.include_local and quant.quantized:
        return QuantizedSlidingLayer(quant.for_local(), layer, window)
    return DynamicSlidingWindowLayer(window)
