"""MiniCache's static cache (``generate(cache_implementation="static")``, ``torch.compile``, CUDA graphs): a subspace
pair's latents preallocated for ``max_cache_len`` tokens.

A ``--merge subspace`` pair holds, per token and side, one latent of fixed width, so its state has fixed shapes: the
keys' and values' latents in ``StaticTokenStore``s (plain buffers at 16 bits, KIVI's blocks where the checkpoint
quantizes them, as ``SubspaceState``'s growing stores hold them) and each member's exact sink. A step attends with
the growing pair's own math (``latent_attention``; longer query blocks restore the past, as ``SubspaceState`` does)
over every slot, those not written yet masked by position, this step's exact states after them; eagerly on a CPU,
where the count is free to read, over the slots written so far. SLERP and average merges keep some tokens' exact
states, as many as the data asks for, so they have no static form (``static_refusal``).

Copied verbatim into every minicache output directory.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kvconvert_codec import QuantSpec, eager_on_cpu
from .kvconvert_folded import folded_channel_mix, folded_scores, kivi_folded_fits
from .kvconvert_minicache import LATENT_MAX_QUERIES, PairedLayer, PairFirst, _encode, latent_attention, restored_states
from .kvconvert_prefill import additive_mask
from .kvconvert_staticstore import StaticTokenStore, ring_positions
from .kvconvert_storage import StaticKVLayer
from .kvconvert_tokenstatic import written_blocks


class StaticSubspaceState(StaticKVLayer, PairedLayer):
    """``SubspaceState`` preallocated for ``max_cache_len`` tokens (``StaticKVLayer``: a 0-d count, buffers written
    in place): latents ``[b, max_cache_len, r]`` per side and, per member, the exact keys and values of the first
    ``sink`` tokens ``[b, Hkv, sink, dk]``. Layer l-1's share of the new tokens' latents waits in ``pending`` until
    layer l adds its own, as in the growing pair."""

    def __init__(self, quant: QuantSpec, layer: int, sink: int, max_cache_len: int):
        StaticKVLayer.__init__(self, max_cache_len)
        self.quant, self.layer, self.sink = quant, layer, min(sink, max_cache_len)
        self.pair, self.member = self, 1
        self.latents = tuple(StaticTokenStore(quant.side(layer, keys=side), True, max_cache_len)
                             for side in (True, False))  # fmt: skip
        self.exact: list[list[torch.Tensor]] = []  # per member: keys, values
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """A no-op (``step`` stores), which unlike ``PairedLayer.update`` leaves the buffers to ``step`` to allocate."""
        return key_states, value_states

    def _held(self) -> list[torch.Tensor]:
        return [t for store in self.latents for t in store.held()] + [t for pair in self.exact for t in pair]

    def apply(self, fn: Any) -> None:
        for store in self.latents:
            store.apply(fn)
        self.exact = [[fn(t) for t in pair] for pair in self.exact]

    def reset(self) -> None:
        StaticKVLayer.reset(self)
        self.pending = None

    def crop_to(self, length: int) -> None:
        if self.quant.quantized and length < int(self.filled):
            raise ValueError("a static quantized cache cannot be cropped; use cache_implementation='dynamic'")
        StaticKVLayer.crop_to(self, length)

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        return self.step(self.member, module, query, key, value, attention_mask, **kwargs)

    def _allocate(self, module: torch.nn.Module, key: torch.Tensor) -> None:
        """Every buffer, at the first step (the latents' widths are the encoders')."""
        b, kv_heads, _, dk = key.shape
        self.filled = self.filled.to(key.device)
        for store, side in zip(self.latents, "kv", strict=True):
            width = getattr(module, f"subspace_{side}_encoder").shape[1]
            store.past(self.filled, key.new_zeros(b, 0, width))
        self.exact = [[key.new_zeros(b, kv_heads, self.sink, dk) for _ in "kv"] for _ in range(2)]
        self._initialized(key.device)

    def step(self, member: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        """Member ``member``'s attention over the pair's past and this step's states ``key``/``value`` ``[b, Hkv, q,
        dk]``, which it then stores (layer l-1's share waits for layer l's)."""
        count = query.shape[2]
        if not self.is_initialized:
            self._allocate(module, key)
        self._check_room(count)
        # past slots read: every one (fixed shapes), or eagerly on a CPU those written so far
        past = int(self.filled) if eager_on_cpu(query.device) else self.max_cache_len
        slots = self.slots(count)
        columns = _static_mask(mask, count, past, self.filled, slots)
        exact = [t[:, :, : min(self.sink, past)] for t in self.exact[member]]
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        if count > LATENT_MAX_QUERIES:  # a prefill: the past restored once for SDPA, as the growing pair does
            floats = [self._floats(store, key, past) for store in self.latents]
            past_k, past_v = restored_states(module, floats, exact, key.shape[-1])
            full_k, full_v = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
            out = sdpa_attention_forward(module, query, full_k, full_v, columns, **kwargs)[0]
        else:
            bias = additive_mask(columns, count, past + count, query.dtype, query.device)
            keys, values = (self._reader(store, key, past) for store in self.latents)
            out = latent_attention(module, query, key, value, bias, past, exact, keys.scores, values.mix, scaling)
        self._commit(member, module, key, value)
        return out, None

    def _floats(self, store: StaticTokenStore, key: torch.Tensor, past: int) -> torch.Tensor:
        """The store's first ``past`` slots ``[b, past, r]`` as a step reads them, dequantized."""
        return store.past(self.filled, key.new_zeros(key.shape[0], 0, store.width))[:, :past]

    def _reader(self, store: StaticTokenStore, key: torch.Tensor, past: int) -> _CodesReader | _BufferReader:
        """How a decode step reads the store's latents: quantized ones from their codes, the rest as they are."""
        return _CodesReader(store, self.filled, past) if _reads_codes(store) else _BufferReader(
            self._floats(store, key, past))  # fmt: skip

    def _commit(self, member: int, module: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor) -> None:
        shares = (_encode(module, "k", keys), _encode(module, "v", values))
        if self.sink:
            for held, new in zip(self.exact[member], (keys, values), strict=True):
                _write_sink(held, new, self.filled)
        if member == 0:
            self.pending = shares
            return
        assert self.pending is not None, "layer l of a merged pair ran before layer l-1"
        for store, first, second in zip(self.latents, self.pending, shares, strict=True):
            store.extend_only((first + second).to(keys.dtype), self.filled)
        self.pending = None
        self._advance(keys.shape[2])


class _BufferReader:
    """``latent_attention``'s reads of latents held in float ``[b, n, r]``."""

    def __init__(self, latents: torch.Tensor):
        self.latents = latents

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.latents.to(x.dtype).transpose(1, 2))

    def mix(self, weights: torch.Tensor) -> torch.Tensor:
        return torch.bmm(weights, self.latents.to(weights.dtype))


def _reads_codes(store: StaticTokenStore) -> bool:
    """A static store of quantized latents whose blocks ``folded_scores`` / ``folded_channel_mix`` read."""
    return store.codes is not None and kivi_folded_fits(store.quant.bits, store.quant.group)


class _CodesReader:
    """``latent_attention``'s reads of a static store's first ``past`` slots from its codes, as the growing pair reads
    its blocks (``_latent_scores``, ``_latent_mix``), by position: slots below the quantized count from the blocks
    (eagerly on a CPU only the blocks written so far), the ring's tokens not quantized yet and the sink exact. Slots
    past the count hold what they held: the mask hides them. Dequantizing every slot instead made a compiled CPU step's
    scores about 5× as slow (4-bit, 4K slots of 192 channels: 4.4 ms against 0.9 ms, a one-off measurement)."""

    def __init__(self, store: StaticTokenStore, filled: torch.Tensor, past: int):
        assert store.codes is not None and store.scale is not None and store.zero is not None
        assert store.ring is not None
        self.store, self.past, group = store, past, store.quant.group
        blocks = written_blocks(store, filled) if eager_on_cpu(filled.device) else store.blocks
        self.codes, self.scale, self.zero = store.codes[:, :blocks], store.scale[:, :blocks], store.zero[:, :blocks]
        self.length = blocks * group
        device = filled.device
        quantized = store.quantized_count(filled)
        sink = 0 if store.head is None else store.head.shape[-2]
        columns = torch.arange(self.length, device=device)
        self.from_codes = (columns < quantized) & (columns >= sink)  # the sink's blocks hold stand-ins
        positions = ring_positions(filled, store.ring_len, device)
        self.in_ring = (positions >= quantized) & (positions >= sink) & (positions >= 0)
        self.ring_at = torch.where(self.in_ring, positions, past)  # past: a spare column
        self.head_held = torch.arange(sink, device=device) < filled

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        store, past = self.store, self.past
        assert store.ring is not None
        codes = folded_scores(x[:, None], self.codes[:, None], self.scale[:, None], self.zero[:, None],
                              store.quant.bits)[:, 0]  # fmt: skip
        out = torch.zeros(*x.shape[:2], past + 1, device=x.device)
        width = min(past, self.length)
        out[..., :width] = codes[..., :width]
        out.index_copy_(-1, self.ring_at, x.float() @ store.ring.float().transpose(1, 2))
        if store.head is not None:
            sink = min(self.head_held.shape[0], past)  # eagerly, a first step may have fewer slots before it
            exact = x.float() @ store.head[:, :sink].float().transpose(1, 2)
            out[..., :sink] = torch.where(self.head_held[:sink], exact, out[..., :sink])
        return out[..., :past].to(x.dtype)

    def mix(self, weights: torch.Tensor) -> torch.Tensor:
        store, past = self.store, self.past
        assert store.ring is not None
        w = torch.cat([weights.float(), weights.new_zeros(*weights.shape[:2], 1).float()], dim=-1)  # + the spare
        in_blocks = w.new_zeros(*w.shape[:2], self.length)
        width = min(past, self.length)
        in_blocks[..., :width] = w[..., :width]
        mixed = folded_channel_mix(torch.where(self.from_codes, in_blocks, 0.0), self.codes, self.scale, self.zero,
                                   store.quant.bits)  # fmt: skip
        mixed = mixed + torch.where(self.in_ring, w.index_select(-1, self.ring_at), 0.0) @ store.ring.float()
        if store.head is not None:
            sink = min(self.head_held.shape[0], past)
            mixed = mixed + torch.where(self.head_held[:sink], w[..., :sink], 0.0) @ store.head[:, :sink].float()
        return mixed.to(weights.dtype)


class StaticPairFirst(PairFirst):
    """Layer l-1 of a static pair: holds nothing; reads, writes and answers the cache protocol through ``pair``."""

    is_compileable = True
    pair: StaticSubspaceState

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        return self.pair.step(self.member, module, query, key, value, attention_mask, **kwargs)

    def get_seq_length(self) -> Any:
        return self.pair.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.pair.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.pair.get_max_length()


def _static_mask(mask: torch.Tensor | None, count: int, past: int, filled: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The mask ``[b|1, 1, q, past + q]`` of the columns attended (``past`` slots, then this step's ``count`` tokens),
    of the kind transformers gave (boolean or additive; None: causal), from its static mask ``[b|1, 1, q,
    max_cache_len]``: a past slot counts where written before this step and the mask allows it, this step's tokens
    where their slots are allowed. The kind matters: a growing pair hands SDPA the mask as it came, and a padding
    query (no column allowed) averages differently over a boolean and an additive mask."""
    written = torch.arange(past, device=slots.device) < filled
    if mask is None:
        steps = torch.arange(count, device=slots.device)
        return torch.cat([written.expand(count, past), steps[None, :] <= steps[:, None]], dim=-1)[None, None]
    mask = mask[..., -count:, :]
    blocked = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    return torch.cat([torch.where(written, mask[..., :past], blocked), mask.index_select(-1, slots)], dim=-1)


def _write_sink(held: torch.Tensor, new: torch.Tensor, filled: torch.Tensor) -> None:
    """The tokens of ``new [b, Hkv, q, dk]`` (at positions ``filled …``) that fall within the sink, into ``held [b,
    Hkv, sink, dk]``: eagerly with Python counts; a compiled or captured step (one token) with tensor ops."""
    sink = held.shape[2]
    if eager_on_cpu(new.device) or new.shape[2] > 1:
        start = int(filled)
        if start < sink:
            end = min(sink, start + new.shape[2])
            held[:, :, start:end] = new[:, :, : end - start]
        return
    slot = filled.clamp(max=sink - 1).view(1)
    held.index_copy_(2, slot, torch.where(filled < sink, new, held.index_select(2, slot)))


def static_pair_layers(plan: dict[str, Any], quant: QuantSpec, layers: list[Any], max_cache_len: int) -> None:
    """Put each subspace pair's static layers into ``layers`` (the first and second layer of every pair)."""
    for first, second in plan["pairs"]:
        state = StaticSubspaceState(quant, second, int(plan.get("sink", 0)), max_cache_len)
        layers[first], layers[second] = StaticPairFirst(state), state
