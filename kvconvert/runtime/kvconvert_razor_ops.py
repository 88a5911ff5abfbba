"""RazorAttention's attention arithmetic on tensors (no cache state): the compensated softmax of eq. 5, the
grouped products a decode step uses and the fused SDPA call chunks use. Copied verbatim into every razor output
directory with ``kvconvert_razor``, which holds the state."""

from __future__ import annotations

from typing import Any

import torch

from .kvconvert_common import softmax_rows
from .kvconvert_prefill import additive_mask, chunk_attention, prefill_attention, query_blocks


def count_logit(count: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The compensation token's additive logit ``ln N_d`` per row (``count [b]``): N_d·exp(q·k̂) =
    exp(q·k̂ + ln N_d); the dtype's lowest value where nothing was dropped (the token takes no weight). In ``dtype``:
    SDPA on a GPU takes no mask of another dtype than its query's (on a CPU it does)."""
    # counts are whole numbers: ln 0 = -inf clamps to the lowest value, every other count keeps its log
    return count.log().clamp(min=torch.finfo(dtype).min).to(dtype)


def compensated_attention(
    query: torch.Tensor,
    keys: torch.Tensor | tuple[torch.Tensor, ...],
    values: torch.Tensor | tuple[torch.Tensor, ...],
    scores: torch.Tensor | None,
    comp_key: torch.Tensor,
    comp_value: torch.Tensor,
    comp_count: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Eq. 5: softmax attention over kept tokens plus a compensation token weighted by N_d.

    Shapes: query ``[b, k, m, d]`` (m query rows per head k: a KV group's stacked heads, or one head's
    positions); keys/values ``[b, k, n, d]``, or consecutive parts of them (sink, window) that are
    never concatenated; scores ``[b, k, m, n]``, the masked, scaled ``query·keys`` when the caller
    has them (None: computed here, nothing masked); comp_key/comp_value ``[b, k, 1, d]`` (means of
    the dropped tokens); comp_count ``[b]`` (N_d, 0 where nothing was dropped: the compensation token
    then takes no weight). Returns ``[b, k, m, d]``.
    """
    keys = keys if isinstance(keys, tuple) else (keys,)
    values = values if isinstance(values, tuple) else (values,)
    if scores is None:
        scores = torch.cat([query @ part.transpose(-1, -2) for part in keys], dim=-1) * scaling
    log_count = count_logit(comp_count, scores.dtype)
    comp_scores = (query @ comp_key.transpose(-1, -2)) * scaling + log_count.view(-1, 1, 1, 1).to(scores.dtype)
    probs = softmax_rows(torch.cat([scores, comp_scores], dim=-1), values[0].dtype)
    out, start = probs[..., -1:] * comp_value, 0
    for part in values:
        out = out + probs[..., start : start + part.shape[-2]] @ part
        start += part.shape[-2]
    return out


def fused_attention(query: torch.Tensor, kv_heads: list[int], group: int, kv: tuple[torch.Tensor, torch.Tensor],
           mask: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """SDPA of ``kv_heads``' query heads over their ``kv`` keys and values ``[b, k, n, d]`` with the additive ``mask``
    ``[b|1, 1, q, n]``: ``[b, k, G·q, d]``, the layout ``attend_state`` writes."""
    rows = query[:, head_span(query_heads(kv_heads, group))]
    return chunk_attention(rows, kv[0], kv[1], mask, scale).reshape(rows.shape[0], len(kv_heads), -1, rows.shape[-1])


def extra_logits(sink_bias: torch.Tensor | None, log_count: torch.Tensor, heads: int, sink: int) -> torch.Tensor:
    """Additive logits ``[b, N, 1, sink + 1]`` of the sink's tokens (their mask ``sink_bias [b|1, 1, 1, sink]``,
    None: nothing masked) and the compensation token (``ln N_d``, ``log_count [b]``)."""
    batch = log_count.shape[0]
    sink_logits = log_count.new_zeros(1, 1, 1, sink) if sink_bias is None else sink_bias.float()
    comp_logits = log_count.view(-1, 1, 1, 1).expand(batch, heads, 1, 1)
    return torch.cat([sink_logits.expand(batch, heads, 1, sink), comp_logits], dim=-1)


def query_heads(kv_heads: list[int], group: int) -> list[int]:
    """The query heads that read ``kv_heads`` (G adjacent query heads per KV head)."""
    return [g * group + j for g in kv_heads for j in range(group)]


def window_budget(total: int, window: int, window_frac: float) -> int:
    """L = max(window, N·window_frac): the recent tokens a non-retrieval head keeps after ``total`` tokens."""
    return max(window, int(total * window_frac))


def head_tables(retrieval: list[int], others: list[int], heads: int, group: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The head-wise kernel's tables: per query head, the kind of KV head it reads (0 retrieval, 1 window) and that
    head's slot among its kind ``[H]``."""
    kv_of = [h // group for h in range(heads)]
    kind = torch.tensor([0 if g in retrieval else 1 for g in kv_of], device=device)
    slot = torch.tensor([retrieval.index(g) if g in retrieval else others.index(g) for g in kv_of], device=device)
    return kind, slot


def head_span(heads: list[int]) -> slice | list[int]:
    """``heads`` as a slice when they are consecutive: indexing then makes a view, not a copy (a decode
    step's transient tensors only; stores get copies, so they never keep a whole step's tensor alive)."""
    return slice(heads[0], heads[-1] + 1) if heads == list(range(heads[0], heads[-1] + 1)) else heads


def grouped_bias(scores: torch.Tensor, bias: torch.Tensor, group: int) -> torch.Tensor:
    """``scores [b, k, G·q, n]`` + ``bias [b|1, 1, q, n]``, the G stacked heads sharing the bias."""
    b, k, rows, n = scores.shape
    return (scores.view(b, k, group, rows // group, n) + bias[:, :, None]).view(b, k, rows, n)


def attend_chunk(
    layer: Any, query: torch.Tensor, mask: torch.Tensor | None, full: tuple[torch.Tensor, torch.Tensor] | None,
    short: Any, comp: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kept: torch.Tensor, scale: float,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """A chunk (prefill) of razor's ``layer``, once ``extend`` holds it (``layer.seen`` counts it), into ``out [b, k,
    G·q, d]`` through SDPA's fused kernel (4x faster on a CPU at 4K than scores in float32): the retrieval heads over
    all they hold (``prefill_attention``: no bias where nothing is padded or past), the others over sink + window
    (``kept``: their logical positions) + the compensation token, whose ln N_d joins their bias. Their bias
    (transformers' mask at the positions they hold) is built a block of query rows at a time: a whole prompt's
    ``[b, 1, n, n]`` in float32 would be 4 GB at 32K tokens."""
    batch, heads, q_len, dim = query.shape
    group, total = heads // out.shape[1], layer.seen
    out_heads = out.view(batch, heads, q_len, dim)
    if full is not None:
        at = head_span(query_heads(layer.retrieval, group))
        out_heads[:, at] = prefill_attention(query[:, at], full[0], full[1], mask, scale)
    if short is None:
        return
    (sink_k, recent_k), (sink_v, recent_v) = short
    comp_k, comp_v, count = comp
    at = head_span(query_heads(layer.others, group))
    if len(kept) == total and not bool(count.any()):
        # nothing dropped yet (a prompt's first chunk): every position held, the compensation token weighs nothing,
        # so the windows attend as the whole heads do (causal with no bias: half the work of a full bias)
        keys, values = torch.cat([sink_k, recent_k], dim=2), torch.cat([sink_v, recent_v], dim=2)
        out_heads[:, at] = prefill_attention(query[:, at], keys, values, mask, scale)
        return
    kv = torch.cat([sink_k, recent_k, comp_k], dim=2), torch.cat([sink_v, recent_v, comp_v], dim=2)
    comp_logit = count_logit(count, query.dtype).view(-1, 1, 1, 1)
    for rows in query_blocks(mask, batch, q_len, total):
        bias = additive_mask(mask, q_len, total, query.dtype, query.device, rows=rows, columns=kept)
        assert bias is not None  # a chunk's causal mask is built when transformers passes none
        n = bias.shape[-2]
        bias = torch.cat([bias.expand(batch, 1, n, -1), comp_logit.expand(batch, 1, n, 1)], dim=-1)
        out_heads[:, at, rows] = fused_attention(query[:, :, rows], layer.others, group, kv, bias, scale).view(
            batch, -1, n, dim
        )
