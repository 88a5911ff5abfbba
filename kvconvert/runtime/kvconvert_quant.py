"""Quantized-cache runtime (``kvconvert quant``): stock attention, every layer's K/V in quantized
storage (``kvconvert_codec``, ``kvconvert_tokenlayout``).

KIVI's layout (the default): keys per channel, values per token, recent tokens exact. Routed through
``quant_attention``, its decode steps read the codes (``KiviLayer``, ``StaticKiviLayer`` for a static cache: the
Triton kernel when asked for, else on a CPU ``kivi_decode_folded``, a growing cache's 4-bit values through torch's
int4 kernel: ``KiviInt4Values``); elsewhere a step reads the whole cache dequantized and stock attention runs on it
(``QuantizedLayer``).

The token layout (``--kv-layout token``, a kvconvert extension): keys and values per token, rotated,
stored as torch's int4 matrix layout (``TokenLayoutStore``). A registered attention function then
computes a decode step's scores and outputs from the codes with ``aten._weight_int4pack_mm_for_cpu``
(``token_decode``) instead of dequantizing the cache: on a CPU that reads 4-bit codes where stock
attention reads 32-bit floats. Every other case (prefill, other devices, a torch without the kernel, a
CPU whose int4 packing is none the stores know) takes the dequantize-then-SDPA path, which computes the
same thing in float32.

Copied verbatim into every output directory; imports only torch and transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kvconvert_codec import QuantSpec, rotation
from .kvconvert_common import LayerStateCache, cache_layer_of, static_refusal
from .kvconvert_folded import (
    byte_codes_pay,
    exact_partial,
    folded_fits,
    kivi_decode_folded,
    merge_partials,
    token_values_fit,
    token_values_sum,
    unrotated,
    value_rotation,
)
from .kvconvert_kernels import kernels_requested, use_kernels
from .kvconvert_kivi_kernel import kivi_decode_triton, kivi_kernel_fits
from .kvconvert_prefill import additive_mask
from .kvconvert_staticstore import StaticTokenStore
from .kvconvert_storage import (
    Fp8Layer,
    QuantizedLayer,
    RoutedLayer,
    StaticStoreLayer,
    sliding_layer,
    static_sliding_layer,
    static_stock_layer,
    stock_layer,
)
from .kvconvert_token_kernel import token_decode_kernel, token_kernel_reads
from .kvconvert_tokenlayout import (
    KiviInt4Values,
    TokenLayoutStore,
    code_outputs,
    code_scores,
    cpu_int4_rows,
    kivi_int4_fits,
    kivi_int4_values,
)
from .kvconvert_tokenstatic import StaticTokenLayoutLayer, static_codes
from .kvconvert_tokenstore import TokenStore, decode_columns

IMPLEMENTATION = "kvconvert_quant"


def int4_kernel_available(device: torch.device) -> bool:
    """torch's CPU int4 matrix-vector kernel is there (torch ≥ 2.6), its layout is one the stores can
    write (``cpu_int4_rows``), and the tensors are on the CPU."""
    return device.type == "cpu" and cpu_int4_rows() is not None


def decodes_from_codes(keys: TokenStore, values: TokenStore, device: torch.device) -> bool:
    """A decode step can be computed from the stores' codes (``token_decode``): keys in the token layout, values
    too, or per token in KIVI's packing at a width the torch reader weighs from its codes (``--kv-value-bits``)."""
    if not (isinstance(keys, TokenLayoutStore) and keys.blocks is not None and int4_kernel_available(device)):
        return False
    reads = values.kernel_reads() if isinstance(values, TokenLayoutStore) else token_values_fit(values, values.width)
    return keys.kernel_reads() and reads


def token_reader(keys: TokenStore, values: TokenStore, query: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """How a decode step of ``query [b, H, 1, d]`` reads these stores from their codes, with ``token_decode``'s
    arguments: the GPU kernel (``token_decode_kernel``) where it reads them and runs by default or when asked, torch's
    CPU int4 kernel (``token_decode``) where that reads them; None: read them back dequantized."""
    if token_kernel_reads(keys, values, query.shape[-1]) and use_kernels(query, default="gpu"):
        return token_decode_kernel
    return token_decode if decodes_from_codes(keys, values, query.device) else None


def token_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
    keys: TokenLayoutStore, values: TokenStore, scaling: float,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """One decode step over a token-layout cache, from the codes (values in KIVI's packing: ``token_values_sum``).

    ``query [b, H, 1, d]``, this step's ``key/value [b, Hkv, 1, d]`` (exact), ``bias [b|1, 1, 1, n]``
    additive or None; the stores hold the ``n − 1`` earlier tokens, at least one block quantized.
    Scores of quantized tokens: ``(q·R)·((codes − 8)·s + z)`` per group in one kernel call per
    (row, KV head), plus ``q·center`` of their block; outputs: ``(p·s)·(codes − 8) + p·z`` per group,
    rotated back by ``Rᵀ``. The sink, the float tail and this step's tokens are exact: the sink's
    stand-ins in the first block are masked out and its exact copy attended instead, as are tokens
    dropped from the front whose block is still held (``keys.offset``). ``extra``: more exact tokens
    attended in the same softmax, ``(keys, values) [b, Hkv, t, d]`` and their additive logits
    ``[b, Hkv, 1, t]`` (razor's sink and compensation token). Returns ``[b, H, 1, d]`` float32.

    Every step of every layer runs this, and on a CPU each torch op costs microseconds whatever its
    size: heads are flattened into one batch axis so that each product is one ``mm``/``bmm``, results
    are written into their place in ``scores`` instead of concatenated, and the queries are scaled
    once."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group, rows = heads // kv_heads, batch * kv_heads
    size = keys.group_size()
    rot = rotation(size, query.device)
    kb, vb = keys.blocks, values.blocks
    assert kb is not None and kb.center is not None and vb is not None
    assert keys.tail is not None and values.tail is not None
    n_q, sink, dropped = keys.quantized_tokens, (0 if keys.head is None else keys.head.shape[-2]), keys.offset
    q = query.reshape(rows, group, dim).float() * scaling  # [b·Hkv, G, d]
    q_rot = torch.mm(q.view(-1, size), rot).to(torch.bfloat16).view(rows, group, dim)
    exact_k, exact_v = [keys.tail, key], [values.tail, value]
    if sink:  # the first block holds stand-ins for the sink: attend to the exact copies instead
        assert keys.head is not None and values.head is not None
        exact_k.insert(0, keys.head)
        exact_v.insert(0, values.head)
    if extra is not None:
        exact_k.insert(0, extra[0])
        exact_v.insert(0, extra[1])
    k_exact = torch.cat(exact_k, dim=-2).flatten(0, 1).float()  # [b·Hkv, t, d]: extra, sink, tail, this step
    v_exact = torch.cat(exact_v, dim=-2).flatten(0, 1).float()
    scores = torch.empty(rows, group, n_q + k_exact.shape[1], device=query.device)
    code_scores(q, q_rot, keys.kernel_operands(), kb.center, size, scores[..., :n_q])
    scores[..., n_q:] = torch.bmm(q, k_exact.transpose(1, 2))
    if sink or dropped:  # the sink's stand-ins and the dropped tokens
        scores[..., : dropped + sink] = -math.inf
    first = n_q if extra is None else n_q + extra[0].shape[-2]  # the sink's first column
    by_head = scores.view(batch, kv_heads, group, -1)
    if extra is not None:
        by_head[..., n_q:first] += extra[2].float()
    if bias is not None:  # bias [b|1, 1, 1, n] over the held tokens: the quantized ones, then the tail and this step
        bias = bias.float()
        held = n_q - dropped
        by_head[..., dropped:n_q] += bias[..., :held]
        by_head[..., first : first + sink] += bias[..., :sink]  # the sink's copies: the mask of its positions
        by_head[..., first + sink :] += bias[..., held:]
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs[..., n_q:], v_exact)  # [b·Hkv, G, d]
    if not isinstance(values, TokenLayoutStore):  # per token in KIVI's packing, the same tokens quantized as the keys
        assert values.quantized_tokens == n_q and values.offset == dropped
        out = out + token_values_sum(probs[..., :n_q], (vb.codes, vb.scale, vb.zero), values, batch, dim)
        return out.view(batch, heads, 1, dim)
    out_rot = code_outputs(probs[..., :n_q], vb.scale, vb.zero, values.kernel_operands(), size)
    out = torch.addmm(out.view(-1, size), out_rot.view(-1, size), rot.T)  # rotated back, added to the exact part
    return out.view(batch, heads, 1, dim)


def kivi_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
    keys: TokenStore, values: TokenStore, scaling: float, kernel: bool,
    extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """One decode step over a cache in KIVI's layout from its codes: the Triton kernel (``kivi_decode_triton``,
    ``kernel``: 4-bit) or its algebra in torch (``kivi_decode_folded``, 2 to 4 and 8 bits: a CPU's default), as
    ``kivi_kernel_reads`` allows. ``query [b, H, 1, d]``, this step's ``key/value [b, Hkv, 1, d]``, ``bias [b|1, 1,
    1, n]`` additive or None over the held tokens (the stores hold the ``n − 1`` earlier ones, a block quantized).
    The reader takes the quantized blocks, the sink's stand-ins and the tokens a window dropped from the front of
    its first block (``keys.offset``) masked; the exact sink, float tail and this step's token join the torch
    reader's softmax (``exact``), or are attended here and merged with the kernel's partial. ``extra``: more exact
    tokens in the same softmax, ``(keys, values) [b, Hkv, t, d]`` and their logits ``[b, Hkv, 1, t]`` (razor's sink
    and compensation token). Values the store rotated come out of the reader rotated: the rotation is undone on
    the ``[b, H, d]`` weighted sum, not on the cache. Values may be of another width ``e`` than the keys (ZACK's
    packed columns): ``value [b, Hkv, 1, e]``, the result ``[b, H, 1, e]``. Returns ``[b, H, 1, e]`` float32."""
    batch, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], value.shape[-1]
    kb, vb = keys.blocks, values.blocks
    assert kb is not None and vb is not None and keys.tail is not None and values.tail is not None
    skip = 0 if kernel else keys.offset  # the torch reader leaves the dropped tokens out; the kernel masks them
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    bias_q, exact_k, exact_v, exact_bias = decode_columns(bias, keys, values, key, value, extra, skip)
    codes = (kb.codes, kb.scale, kb.zero, vb.codes, vb.scale, vb.zero)
    rotated = value_rotation(values, width, query.device)
    if not kernel:  # the exact tokens in the reader's own softmax
        acc, ml = kivi_decode_folded(q, *codes, bias_q, scaling, keys.quant.bits, values.quant.bits, skip=skip,
                                     exact=(exact_k, exact_v, exact_bias), value_rotation=rotated,
                                     value_sum=int4_value_sum(values), value_width=width)  # fmt: skip
        return (acc / ml[..., 1:]).view(batch, heads, 1, width)
    acc, ml = kivi_decode_triton(q, *codes, bias_q, scaling, precise=query.dtype == torch.float32)
    if rotated is not None:
        acc = unrotated(acc, rotated)
    exact = exact_partial(q, exact_k, exact_v, exact_bias, scaling)
    return merge_partials([(acc, ml), exact]).view(batch, heads, 1, dim)


def token_values_store(quant: QuantSpec, layer: int) -> TokenStore:
    """An empty value store beside token-layout keys: the token layout too, or, with values of their own width
    (``--kv-value-bits``), KIVI's per-token codes (``QuantSpec.side``), quantized in the keys' blocks (the same group
    and residual), which ``token_decode`` and the GPU kernel read from their codes."""
    if quant.value_bits is None:
        return TokenLayoutStore(quant.side(layer, keys=False), keys=False)
    return TokenStore(quant.side(layer, keys=False), per_channel=False)


def int4_values_read(quant: QuantSpec, values: torch.Tensor) -> bool:
    """Values of this width and device go into ``KiviInt4Values``: on a CPU whose int4 kernel reads them
    (``kivi_int4_fits``), unless the Triton kernels are asked for (they read KIVI's own packing;
    ``KVCONVERT_KERNELS=triton`` under ``TRITON_INTERPRET=1``, tests)."""
    on_cpu = values.device.type == "cpu" and kernels_requested() != "triton"
    return on_cpu and quant.quantized and not quant.fp8 and kivi_int4_fits(quant, values.shape[-1])


def int4_values_or(store: TokenStore, values: torch.Tensor) -> TokenStore:
    """An empty KIVI-layout ``store``, or where it holds values per token that ``int4_values_read`` allows, a
    ``KiviInt4Values`` in its place. The layers ask at their first states, when device and width are known (quant's
    ``KiviLayer``, razor's retrieval and window stores, MiniCache's merged directions)."""
    per_token = not store.per_channel and not isinstance(store, TokenLayoutStore)
    return KiviInt4Values(store.quant) if per_token and int4_values_read(store.quant, values) else store


def int4_value_sum(values: TokenStore) -> Any:
    """``kivi_decode_folded``'s ``value_sum`` for a value store: the int4 kernel's weighted sum over a
    ``KiviInt4Values`` (``kivi_int4_values``), None over KIVI's own packing."""
    return (lambda weights: kivi_int4_values(values, weights)) if isinstance(values, KiviInt4Values) else None


def kivi_kernel_reads(keys: TokenStore, values: TokenStore, dim: int, kernel: bool = True) -> bool:
    """``kivi_decode`` can read these stores, through the kernel (``kernel``) or else in torch: KIVI's layout (keys per
    channel), widths and blocks its reader takes (``kivi_kernel_fits``: 4-bit; ``kivi_folded_fits``: 2 to 4 bits, and
    8-bit keys from ``BYTE_CODES_MIN`` codes: ``byte_codes_pay``), for the kernel none dropped from the front, and
    quantized blocks that cover the exact sink's stand-ins."""
    if not (isinstance(keys, TokenStore) and isinstance(values, TokenStore)):  # e.g. the tests' float reference
        return False
    if kernel:
        fits = all(kivi_kernel_fits(store.quant.bits, keys.quant.group, dim) for store in (keys, values))
        fits = fits and not isinstance(values, KiviInt4Values)  # its codes are the int4 kernel's to read
    else:
        fits = folded_fits(keys, values) and byte_codes_pay(keys)
    layout = keys.per_channel and not isinstance(keys, TokenLayoutStore)
    sink = 0 if keys.head is None else keys.head.shape[-2]
    front, quantized = not keys.offset or not kernel, keys.quantized_tokens - keys.offset  # a window's: masked
    return layout and fits and front and keys.blocks is not None and quantized >= sink


class KiviLayer(RoutedLayer, QuantizedLayer):
    """``QuantizedLayer`` whose decode steps read the codes once its attention is routed (``RoutedLayer``: until then
    ``update`` returns the past dequantized); then ``update`` only records and ``attend`` does the work: decode steps
    from the codes (``kivi_decode``) through the kernel when it reads them (4-bit) and is asked for (``use_kernels``:
    by default only in captured CUDA graphs, which a growing cache never is), else on a CPU through the torch reader
    (2 to 4 and 8 bits), else dequantize-then-SDPA (the torch reader is not measured on a GPU). On a CPU 4-bit values
    go into the int4 kernel's rows (``int4_values_or``: ``KiviInt4Values``), which the torch reader weighs with that
    kernel."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.value_store = int4_values_or(self.value_store, value_states)
        if not self.routed:
            return super().update(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    def attend_routed(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        keys, values = self.key_store, self.value_store
        step, dim = query.shape[2] == 1, query.shape[-1]
        kernel = step and kivi_kernel_reads(keys, values, dim) and use_kernels(query, default="graphs")
        folded = step and not kernel and query.device.type == "cpu" and kivi_kernel_reads(keys, values, dim, False)
        if kernel or folded:
            bias = additive_mask(attention_mask, 1, len(keys) + 1, torch.float32, query.device)
            out = kivi_decode(query, key, value, bias, keys, values, scaling, kernel).to(query.dtype)
            keys.append(key)
            values.append(value)
            return out.transpose(1, 2).contiguous(), None
        k, v = keys.extend(key), values.extend(value)
        return sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling, **kwargs)


class StaticKiviLayer(RoutedLayer, StaticStoreLayer):
    """``StaticStoreLayer`` in KIVI's layout whose decode steps read the codes, as ``KiviLayer`` does for a growing
    cache (routed the same way, ``RoutedLayer``: until then a plain static layer). A step reads
    every block the buffers have room for with ``kivi_decode_folded`` (a CPU; the kernel, 4-bit, only those quantized
    so far) — fixed shapes, what ``torch.compile`` and CUDA graphs need — masking the blocks not quantized yet and
    the sink's stand-ins by position, and attends the exact part (sink, the ring's tokens not quantized yet, this
    step's token) beside it; then the token is written as ``StaticTokenStore.extend`` writes it. Elsewhere (a prefill,
    widths neither reads) it dequantizes, as ``StaticStoreLayer`` does."""

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.routed:
            return super().update(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    def attend_routed(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        step, dim = query.shape[2] == 1, query.shape[-1]
        kernel = step and self._folded_reads(dim, kernel=True) and use_kernels(query, default="graphs")
        if kernel or (step and query.device.type == "cpu" and self._folded_reads(dim)):
            out = self._decode(query, key, value, attention_mask, scaling, kernel).to(query.dtype)
            return out.transpose(1, 2).contiguous(), None
        k, v = StaticStoreLayer.update(self, key, value)
        assert v is not None
        return sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling, **kwargs)

    def _folded_reads(self, dim: int, kernel: bool = False) -> bool:
        return self.value_store is not None and static_reads_codes(self.key_store, self.value_store, dim, kernel)

    def _decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                scaling: float, kernel: bool = False) -> torch.Tensor:  # fmt: skip
        """One decode step (``[b, H, 1, d]`` float32) over every slot (``static_kivi_decode``), then the token
        stored."""
        keys, values = self.key_store, self.value_store
        assert values is not None
        self._check_room(1)
        out = static_kivi_decode(query, key, value, attention_mask, scaling, keys, values, self.filled,
                                 self.max_cache_len, kernel)  # fmt: skip
        keys.extend_only(key, self.filled)
        values.extend_only(value, self.filled)
        self._advance(1)
        return out


def static_reads_codes(keys: StaticTokenStore, values: StaticTokenStore, dim: int, kernel: bool = False) -> bool:
    """Static stores in KIVI's layout that the torch reader (or, ``kernel``, the Triton kernel: 4-bit) reads."""
    if keys.codes is None or values.codes is None or not keys.per_channel:
        return False
    same_ring = keys.ring_len == values.ring_len and keys.quant.sink == values.quant.sink
    fits = all(kivi_kernel_fits(s.quant.bits, keys.quant.group, dim) for s in (keys, values)) if kernel else True
    return same_ring and fits and folded_fits(keys, values)


def static_kivi_decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, scaling: float,
    keys: StaticTokenStore, values: StaticTokenStore, filled: torch.Tensor, max_cache_len: int, kernel: bool = False,
) -> torch.Tensor:  # fmt: skip
    """One decode step ``[b, H, 1, d]`` float32 over static stores (``static_reads_codes``) from their codes
    (``static_codes``), writing nothing: the torch reader, or (``kernel``) the Triton kernel over the blocks quantized
    so far, its partial merged with the exact part's. Values may be of another width ``e`` than the keys, as
    ``kivi_decode``'s (ZACK's packed columns; the torch reader): the result ``[b, H, 1, e]``."""
    batch, heads, _, dim = query.shape
    kv_heads, device, width = key.shape[1], query.device, value.shape[-1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    codes, bias_q, exact = static_codes(keys, values, key, value, attention_mask, filled, max_cache_len, not kernel)
    rotated = value_rotation(values, width, device)
    if kernel:
        acc, ml = kivi_decode_triton(q, *codes, bias_q, scaling, precise=query.dtype == torch.float32,
                                     length=keys.quantized_count(filled))  # the blocks quantized so far  # fmt: skip
        parts = [(acc if rotated is None else unrotated(acc, rotated), ml), exact_partial(q, *exact, scaling)]
        return merge_partials(parts).view(batch, heads, 1, dim)
    acc, ml = kivi_decode_folded(q, *codes, bias_q, scaling, keys.quant.bits, values.quant.bits, exact=exact,
                                 value_rotation=rotated, value_width=width)  # fmt: skip
    return (acc / ml[..., 1:]).view(batch, heads, 1, width)


def _kivi_quantized(quant: QuantSpec, layer: int) -> bool:
    """Both sides of ``layer`` are quantized in KIVI's integer layout (what the codes readers read)."""
    quantized = quant.side(layer, keys=True).quantized and quant.side(layer, keys=False).quantized
    return quantized and not quant.fp8 and quant.layout == "kivi"


def static_quant_layer(quant: QuantSpec, layer: int, max_cache_len: int) -> Any:
    """``static_stock_layer``, with ``StaticKiviLayer`` for a layer quantized in KIVI's layout and
    ``StaticTokenLayoutLayer`` in the token layout (whose steps read their codes)."""
    if quant.layout == "token":
        return StaticTokenLayoutLayer(quant, layer, max_cache_len)
    if _kivi_quantized(quant, layer):
        return StaticKiviLayer(max_cache_len, quant, layer)
    return static_stock_layer(quant, layer, max_cache_len)


def kivi_stock_layer(quant: QuantSpec, layer: int) -> Any:
    """``stock_layer`` for a method whose attention function hands a layer it leaves untouched to the layer's own
    ``attend`` when it has one: ``KiviLayer`` where the layer is quantized in KIVI's layout, so that its decode steps
    read the codes."""
    return KiviLayer(quant, layer) if _kivi_quantized(quant, layer) else stock_layer(quant, layer)


def kivi_routed(model: Any) -> bool:
    """Whether ``configure`` routes a KIVI-layout model's attention through ``quant_attention`` (so that its decode
    steps can read the codes, ``KiviLayer``): always, unless the model soft-caps its attention logits, which the
    readers do not apply."""
    softcap = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
    return softcap is None


class TokenLayoutLayer(QuantizedLayer):
    """A stock attention layer's keys and values in the token layout. ``update`` only records this
    step's states; ``quant_attention`` reads the stores and commits the step (like razor's layers)."""

    key_store: TokenLayoutStore
    value_store: TokenStore

    def reset(self) -> None:
        super().reset()
        self.key_store = TokenLayoutStore(self.quant, keys=True)
        self.value_store = token_values_store(self.quant, self.layer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        keys, values = self.key_store, self.value_store
        reader = token_reader(keys, values, query) if query.shape[2] == 1 else None
        if reader is not None:
            bias = additive_mask(attention_mask, 1, len(keys) + 1, torch.float32, query.device)
            out = reader(query, key, value, bias, keys, values, scaling).to(query.dtype)
            result = out.transpose(1, 2).contiguous(), None
        else:
            past_k = keys.read() if len(keys) else key[..., :0, :]
            past_v = values.read() if len(values) else value[..., :0, :]
            k, v = torch.cat([past_k, key], dim=-2), torch.cat([past_v, value], dim=-2)
            result = sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling, **kwargs)
        keys.append(key)
        values.append(value)
        return result


def quant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function. Token-layout layers do their own work (``TokenLayoutLayer.attend``,
    found by duck typing: see ``cache_layer_of``); every other layer's cache already returned the keys
    and values, so stock SDPA runs."""
    layer = cache_layer_of(module)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if hasattr(layer, "attend"):
        return layer.attend(module, query, key, value, attention_mask, scale, dropout=dropout, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale, dropout=dropout, **kwargs)


AttentionInterface.register(IMPLEMENTATION, quant_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def make_attention(spec: dict[str, Any], layer_idx: int, rotary: Any) -> None:
    """Attention modules and weights stay stock."""
    return None


def make_cache(spec: dict[str, Any], max_cache_len: int | None = None) -> LayerStateCache:
    """With ``max_cache_len`` (a static cache asked for), every layer's storage preallocated (``static_stock_layer``),
    and transformers' own static window on sliding-window layers kept stock, unless ``static_refusal`` has a reason
    not to."""
    quant = QuantSpec.from_spec(spec)
    layers = range(len(spec["attention_modules"]))
    if max_cache_len is not None and static_refusal(spec, static_windows=True) is None:
        length = max_cache_len
        return LayerStateCache([static_sliding_layer(spec, i, length) or static_quant_layer(quant, i, length)
                                for i in layers])  # fmt: skip
    layer_class = Fp8Layer if quant.fp8 else TokenLayoutLayer if quant.layout == "token" else KiviLayer
    return LayerStateCache([sliding_layer(spec, i) or layer_class(quant, i) for i in layers])


def configure(model: Any) -> None:
    """Token layout, KIVI's layout and fp8: route attention through ``quant_attention`` (``kivi_routed``: not
    under soft-capping), so that decode steps can read the codes."""
    quant = QuantSpec.from_spec(model.config.kvconvert)
    if quant.layout == "token" or kivi_routed(model):
        model.set_attn_implementation(IMPLEMENTATION)
