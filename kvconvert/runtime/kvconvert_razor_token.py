"""Razor's preallocated cache with ``--kv-bits`` in the token layout (``razor --kv-layout token``): what
``StaticRazorKiviLayer`` is for KIVI's layout, so that ``generate(cache_implementation="static")`` and
``torch.compile`` decode razor's smallest caches in this layout too.

Retrieval heads keep every token in ``StaticTokenLayoutStore``s, read as quant's static token layer reads them
(``int4_decode``: torch's int4 kernel on a CPU that reads the rows; the GPU kernel where it runs; elsewhere
dequantized). The other heads keep the sink exact, then a window whose blocks lie in a ring (``RingTokenLayoutStore``),
read from their codes in the same pass where the int4 kernel reads them, the sink, the store's float ring and exact
sink, this step's token and the compensation token (its logit ``ln N_d``) joining as exact columns. The growing
store's windows slide by whole units (``TokenStore.whole_front``: a unit leaves at once, dequantized into the
compensation sums), so the window's front after ``n`` tokens is ``sink + ⌊(n − sink − L(n)) / unit⌋·unit``, a
function of the count alone, as the static layer needs; that holds while the window is at least ``residual + group``
wide (``window_static_refusal``). Longer steps go through a growing layer built from the buffers and written back,
as ``StaticRazorKiviLayer`` does. Copied verbatim into every razor output directory.
"""

from __future__ import annotations

from typing import Any

import torch

from .kvconvert_codec import QuantSpec
from .kvconvert_kernels import use_kernels
from .kvconvert_razor_kivi import RingTokenStore, StaticRazorKiviLayer
from .kvconvert_staticstore import StaticTokenStore
from .kvconvert_token_kernel import static_token_kernel_decode, static_token_kernel_reads
from .kvconvert_tokenlayout import StaticTokenLayoutStore, TokenLayoutStore
from .kvconvert_tokenstatic import int4_decode, int4_reads, static_columns


class RingTokenLayoutStore(StaticTokenLayoutStore):
    """A ``StaticTokenLayoutStore`` of ``slots`` blocks held in a ring (``RingTokenStore`` in the token layout)."""

    def __init__(self, quant: QuantSpec, keys: bool, slots: int):
        super().__init__(quant, keys, slots * quant.group)

    block_slots = RingTokenStore.block_slots


class StaticRazorTokenLayer(StaticRazorKiviLayer):
    """``StaticRazorKiviLayer`` with token-layout stores: the retrieval heads' ``full_keys/values`` for
    ``max_cache_len`` tokens, the other heads' window ``window_keys/values`` in a ring of blocks wide enough for the
    widest window, the unit waiting to leave it whole, the block being written and the one the front leaves."""

    def _make_stores(self, keys: QuantSpec, values: QuantSpec) -> None:
        """The token layout's stores: values in it too, or per token in KIVI's packing (``--kv-value-bits``), as
        ``token_values_store`` makes the growing ones."""
        self.unit = TokenLayoutStore(keys, keys=True)._front_unit()  # what the growing window drops at once
        max_len, slots = self.max_cache_len, self._ring_slots(keys.group)
        self.full_keys = StaticTokenLayoutStore(keys, True, max_len)
        self.window_keys = RingTokenLayoutStore(keys, True, slots)
        if self.quant.value_bits is None:
            self.full_values = StaticTokenLayoutStore(values, False, max_len)
            self.window_values = RingTokenLayoutStore(values, False, slots)
        else:
            self.full_values = StaticTokenStore(values, False, max_len)
            self.window_values = RingTokenStore(values, False, slots)

    def _read_codes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    scale: float) -> torch.Tensor | None:  # fmt: skip
        keys, values, dim = self.full_keys, self.full_values, query.shape[-1]
        assert isinstance(keys, StaticTokenLayoutStore)
        kernel = static_token_kernel_reads(keys, values, dim) and use_kernels(query, default="gpu")
        if not (kernel or (query.device.type == "cpu" and int4_reads(keys, values, dim))):
            return None
        columns = static_columns(keys, values, key, value, attention_mask, self.filled, self.max_cache_len)
        if kernel:
            return static_token_kernel_decode(query, scale, keys, values, self.filled, columns)
        return int4_decode(query, scale, keys, values, self.filled, *columns)

    def _window_reads_codes(self, dim: int) -> bool:
        keys = self.window_keys
        assert isinstance(keys, StaticTokenLayoutStore)
        return int4_reads(keys, self.window_values, dim)

    def _read_window(self, rows: torch.Tensor, scale: float, bias_q: torch.Tensor,
                     exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """``int4_decode`` over every block slot of the ring: torch's int4 kernel. ``[b, N, G, d]`` float32."""
        keys, (batch, kv_heads, group, dim) = self.window_keys, rows.shape
        assert isinstance(keys, StaticTokenLayoutStore)
        out = int4_decode(rows.reshape(batch, kv_heads * group, 1, dim), scale, keys, self.window_values,
                          self.filled, bias_q, exact, ring=True)  # fmt: skip
        return out.view(batch, kv_heads, group, dim)
