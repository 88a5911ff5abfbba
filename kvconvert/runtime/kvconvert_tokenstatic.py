"""Static (preallocated) quantized caches decoded from their codes: what a step reads (``static_codes``, KIVI's
layout) and attends beside the codes (``static_columns``, shared with it), and the token layout's layer
(``StaticTokenLayoutLayer``).

Copied verbatim into every output directory; imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kvconvert_codec import QuantSpec, eager_on_cpu, rotation
from .kvconvert_folded import token_values_fit, token_values_sum
from .kvconvert_kernels import use_kernels
from .kvconvert_prefill import additive_mask
from .kvconvert_staticstore import StaticTokenStore, ring_positions
from .kvconvert_storage import StaticStoreLayer
from .kvconvert_token_kernel import static_token_kernel_decode, static_token_kernel_reads
from .kvconvert_tokenlayout import StaticTokenLayoutStore, code_outputs, code_scores

# a KIVI store pair's codes as its readers take them: keys' codes, scales, zeros, then values'
SixCodes = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def written_blocks(store: StaticTokenStore, filled: torch.Tensor) -> int:
    """Eagerly, where the count is free to read: the blocks quantized once ``filled`` tokens are stored (at least one),
    what a step reads instead of every block the buffers have room for."""
    return max(1, int(store.quantized_count(filled)) // store.quant.group)


def static_columns(
    keys: StaticTokenStore, values: StaticTokenStore, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    filled: torch.Tensor, max_cache_len: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """What a decode step over static stores attends, by position, with tensor ops only (fixed shapes): the additive
    bias ``[b, length]`` of every block's room (``length`` = blocks × group; the mask's where a slot is quantized
    already and no sink stand-in, the float32 minimum elsewhere), and the exact part ``(keys, values) [b, Hkv, t, d]``
    with its bias ``[b, 1, 1, t]``: the sink, the ring's slots not quantized yet (slot s holds the newest position
    ≡ s mod its length), this step's ``key``/``value`` at position ``filled``."""
    batch, device = key.shape[0], key.device
    minimum = torch.finfo(torch.float32).min
    # the mask's bias per slot [b, max_cache_len] (positions past it: never valid)
    bias = additive_mask(attention_mask, 1, max_cache_len, torch.float32, device)
    bias = (torch.zeros(1, max_cache_len, device=device) if bias is None else bias[:, 0, 0]).expand(batch, -1)
    length, sink = keys.blocks * keys.quant.group, keys.quant.sink if keys.head is not None else 0
    positions = torch.arange(length, device=device)
    quantized = keys.quantized_count(filled)
    bias_q = torch.full((batch, length), minimum, device=device)
    bias_q[:, :max_cache_len] = bias
    bias_q = torch.where((positions < quantized) & (positions >= sink), bias_q, minimum)
    assert keys.ring is not None and values.ring is not None
    ring = ring_positions(filled, keys.ring_len, device)
    where = [ring, filled.view(1)]
    valid = [(ring >= quantized) & (ring >= sink) & (ring >= 0), torch.ones(1, dtype=torch.bool, device=device)]
    exact_k, exact_v = [keys.ring, key], [values.ring, value]
    if keys.head is not None and values.head is not None:
        held = torch.arange(sink, device=device)
        where, valid = [held, *where], [held < filled, *valid]
        exact_k, exact_v = [keys.head, *exact_k], [values.head, *exact_v]
    at, ok = torch.cat(where), torch.cat(valid)
    exact_bias = torch.where(ok, bias.index_select(1, at.clamp(0, max_cache_len - 1)), minimum)
    return bias_q, (torch.cat(exact_k, dim=-2), torch.cat(exact_v, dim=-2), exact_bias[:, None, None])


def static_codes(
    keys: StaticTokenStore, values: StaticTokenStore, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    filled: torch.Tensor, max_cache_len: int, written: bool = True,
) -> tuple[SixCodes, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """What a decode step reads from static stores in KIVI's layout: their codes (keys' codes, scales, zeros, then
    values'), the bias of the tokens they hold and the exact part (``static_columns``). ``written``: eagerly on a CPU,
    where the count is free to read, only the blocks written so far, not every one the buffers have room for."""
    assert keys.codes is not None and keys.scale is not None and keys.zero is not None
    assert values.codes is not None and values.scale is not None and values.zero is not None
    bias_q, exact = static_columns(keys, values, key, value, attention_mask, filled, max_cache_len)
    codes = (keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero)
    if written and eager_on_cpu(key.device):
        upto = written_blocks(keys, filled)
        kc, ks, kz, vc, vs, vz, tokens = *codes, upto * keys.quant.group
        codes = (kc[:, :, :upto], ks[:, :, :upto], kz[:, :, :upto],
                 vc[:, :, :tokens], vs[:, :, :tokens], vz[:, :, :tokens])  # fmt: skip
        bias_q = bias_q[:, :tokens]
    return codes, bias_q, exact


class StaticTokenLayoutLayer(StaticStoreLayer):
    """``TokenLayoutLayer`` preallocated for ``max_cache_len`` tokens (``StaticStoreLayer`` with
    ``StaticTokenLayoutStore``s): ``update`` only records the step, ``attend`` (called by ``quant_attention``) reads
    and writes. A decode step on a GPU whose Triton kernel reads the stores runs it (``static_token_kernel_decode``);
    on a CPU whose int4 kernel reads the stores runs ``token_decode``'s two halves over every
    block's room (``code_scores``, ``code_outputs``), the blocks not quantized yet and the sink's stand-ins masked by
    position (``static_columns``), then stores the token; elsewhere (a prefill, another device or layout) the
    stores are dequantized whole and SDPA attends, as ``StaticStoreLayer`` does. Values of their own width
    (``--kv-value-bits``) are stored per token in KIVI's packing and weighed from their codes (``token_values_sum``)."""

    key_store: StaticTokenLayoutStore
    value_store: StaticTokenStore

    def __init__(self, quant: QuantSpec, layer: int, max_cache_len: int):
        super().__init__(max_cache_len, quant, layer)
        self.key_store = StaticTokenLayoutStore(quant, True, max_cache_len)
        self.value_store = (StaticTokenLayoutStore(quant, False, max_cache_len) if quant.value_bits is None else
                            StaticTokenStore(quant.side(layer, keys=False), False, max_cache_len))  # fmt: skip

    def _reads_codes(self, dim: int) -> bool:
        return int4_reads(self.key_store, self.value_store, dim)

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return key_states, value_states

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
        step = query.shape[2] == 1
        kernel = step and static_token_kernel_reads(self.key_store, self.value_store, query.shape[-1]) and (
            use_kernels(query, default="gpu"))  # fmt: skip
        if kernel or (step and query.device.type == "cpu" and self._reads_codes(query.shape[-1])):
            out = self._decode(query, key, value, attention_mask, scaling, kernel).to(query.dtype)
            return out.transpose(1, 2).contiguous(), None
        k, v = StaticStoreLayer.update(self, key, value)
        assert v is not None
        return sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling, **kwargs)

    def _decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                scaling: float, kernel: bool = False) -> torch.Tensor:  # fmt: skip
        """One decode step ``[b, H, 1, d]`` float32 through the GPU kernel (``kernel``) or the CPU's int4 kernel,
        then the token stored."""
        keys, values, filled = self.key_store, self.value_store, self.filled
        self._check_room(1)
        columns = static_columns(keys, values, key, value, attention_mask, filled, self.max_cache_len)
        if kernel:
            out = static_token_kernel_decode(query, scaling, keys, values, filled, columns)
        else:
            out = int4_decode(query, scaling, keys, values, filled, *columns)
        keys.extend_only(key, filled)
        values.extend_only(value, filled)
        self._advance(1)
        return out


def int4_reads(keys: StaticTokenLayoutStore, values: StaticTokenStore, dim: int) -> bool:
    """``int4_decode`` reads these stores from their codes: this machine's int4 kernel reads the keys' rows, and the
    values' (the token layout) or the torch reader folds them (per token in KIVI's packing)."""
    reads = values.reads_codes if isinstance(values, StaticTokenLayoutStore) else token_values_fit(values, dim)
    return keys.reads_codes and reads


def int4_decode(query: torch.Tensor, scaling: float, keys: StaticTokenLayoutStore, values: StaticTokenStore,
                filled: torch.Tensor, bias_q: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                ring: bool = False) -> torch.Tensor:  # fmt: skip
    """``token_decode``'s two halves over every block's room of static stores (``static_columns``' bias and exact
    part, or a caller's of the same shapes), writing nothing: ``[b, H, 1, d]`` float32. ``ring``: the stores' blocks
    lie in a ring (razor's windows), so every slot is read, never the first ones written."""
    batch, heads, _, dim = query.shape
    k_exact, v_exact, exact_bias = exact
    kv_heads = k_exact.shape[1]
    group, rows = heads // kv_heads, batch * kv_heads
    size = keys.codec.group_size()
    rot = rotation(size, query.device)
    center, codes, scale, zero = keys.center, values.codes, values.scale, values.zero
    assert center is not None and codes is not None and scale is not None and zero is not None
    held = None  # every block's room (fixed shapes: a compiled step)
    if eager_on_cpu(query.device) and not ring:  # the count is free to read: the blocks written so far, not every one
        blocks = written_blocks(keys, filled)
        held = blocks * keys.quant.group
        center, bias_q = center[..., :blocks, :], bias_q[:, :held]
    key_ops = keys.kernel_operands(held)
    length = bias_q.shape[-1]
    q = query.reshape(rows, group, dim).float() * scaling  # [b·Hkv, G, d]
    q_rot = torch.mm(q.view(-1, size), rot).to(torch.bfloat16).view(rows, group, dim)
    scores = torch.empty(rows, group, length + k_exact.shape[-2], device=query.device)
    code_scores(q, q_rot, key_ops, center, size, scores[..., :length])
    scores[..., length:] = torch.bmm(q, k_exact.flatten(0, 1).float().transpose(1, 2))
    by_head = scores.view(batch, kv_heads, group, -1)
    by_head[..., :length] += bias_q[:, None, None]
    by_head[..., length:] += exact_bias
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs[..., length:], v_exact.flatten(0, 1).float())  # [b·Hkv, G, d]
    if isinstance(values, StaticTokenLayoutStore):  # scales and zeros token-last
        scale, zero = (t if held is None else t[..., :held] for t in (scale, zero))
        out_rot = code_outputs(probs[..., :length], scale, zero, values.kernel_operands(held), size)
        out = torch.addmm(out.view(-1, size), out_rot.view(-1, size), rot.T)  # rotated back, added to the exact
    else:  # per token in KIVI's packing, token-major: the first ``length`` tokens read
        out = out + token_values_sum(probs[..., :length], (codes, scale, zero), values, batch, dim)
    return out.view(batch, heads, 1, dim)
