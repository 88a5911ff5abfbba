"""Mixed-precision KV storage allocated by measured loss (a kvconvert extension; KIVI uses one width).

Layers and sides (K, V) differ in how much quantization hurts. For every layer and side and every
lower width, the source model is run on calibration text with that one store quantized (the others
at the widest choice) inside attention, exactly as the runtime's store would hold the tokens after a
prefill (``kvconvert_tokenstore.TokenStore``), and KL(source ‖ simulated) is measured. A greedy
pass then lowers, one step at a time, the store whose next step costs the least KL per byte saved,
until the cache fits the budget — the additive sensitivity model that mixed-precision searches
(HAQ, Palu's rank search) use. The chosen allocation is measured once more as a whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from kvconvert.arch import adapter_for
from kvconvert.calib.hooks import observed_attention
from kvconvert.calib.sequential import run_layer_by_layer
from kvconvert.errors import KVConvertError
from kvconvert.runtime.kvconvert_codec import QuantSpec
from kvconvert.runtime.kvconvert_tokenstore import TokenStore


def stored_after_prefill(x: torch.Tensor, spec: QuantSpec, per_channel: bool) -> torch.Tensor:
    """``x [..., n, w]`` as the runtime's ``TokenStore`` holds it after one prefill: the sink exact,
    whole blocks of aged tokens quantized, the newest ``residual`` (and the partial block behind them)
    exact."""
    if not spec.quantized:
        return x
    store = TokenStore(spec, per_channel)
    store.append(x)
    return store.read()


@contextlib.contextmanager
def simulated_storage(model: Any, quant: QuantSpec, stock: frozenset[int] = frozenset()) -> Iterator[None]:
    """Inside the block every layer of ``model`` but ``stock`` ones (sliding-window layers the runtime keeps
    unquantized) attends to keys and values as ``quant`` stores them."""

    def store(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> Any:
        layer = module.layer_idx
        if layer in stock:
            return query, key, value
        return (query, stored_after_prefill(key, quant.side(layer, keys=True), per_channel=True),
                stored_after_prefill(value, quant.side(layer, keys=False), per_channel=False))  # fmt: skip

    with observed_attention(model, store):
        yield


@torch.no_grad()
def mean_kl(source: Any, chunks: torch.Tensor, reference_logp: list[torch.Tensor], observe: Any) -> float:
    """Mean per-token KL(reference ‖ source with ``observe(model)`` active) over ``chunks [n, T]``,
    the source run layer by layer."""
    total = 0.0

    def add(c: int, logits: torch.Tensor) -> None:
        nonlocal total
        ref = reference_logp[c]
        total += (ref.exp() * (ref - torch.log_softmax(logits.float(), dim=-1))).sum().item()

    run_layer_by_layer(source, adapter_for(source.config), chunks, observe, progress=False, logits=add)
    return total / chunks.numel()


def log_probs(source: Any, chunks: torch.Tensor) -> list[torch.Tensor]:
    """The source's log-probabilities ``[T, vocab]`` for every chunk, run layer by layer."""
    out: list[torch.Tensor] = [torch.empty(0)] * chunks.shape[0]

    def keep(c: int, logits: torch.Tensor) -> None:
        out[c] = torch.log_softmax(logits.float(), dim=-1)

    run_layer_by_layer(source, adapter_for(source.config), chunks, contextlib.nullcontext, progress=False, logits=keep)
    return out


def stored_bytes(bits: int, width: int, per_channel: bool, storage: QuantSpec, head_dim: int) -> float:
    """Accounted bytes per token of one ``width``-wide store at ``bits`` in ``storage``'s layout: the runtime
    quantizes each head's ``head_dim`` channels apart (codes + fp16 scale and zero per group), so a head
    narrower than a group pays its scale and zero per head, not per ``storage.group`` values."""
    spec = dataclasses.replace(storage, bits=bits, layers=None)
    return width * spec.bytes_per_value(head_dim, per_channel)


def accounted_budget(bits: Sequence[tuple[int, int]], widths: Sequence[int], storage: QuantSpec,
                     head_dim: int) -> float:  # fmt: skip
    """Bytes of stores ``widths[layer]`` wide at ``bits[layer]`` (keys, values) ÷ a 16-bit cache's."""
    full = sum(2 * 2 * w for w in widths)  # 16-bit K and V
    held = sum(stored_bytes(b, w, s == 0, storage, head_dim) for (k, v), w in zip(bits, widths, strict=True)
               for s, b in enumerate((k, v)))  # fmt: skip
    return held / full


@dataclass(frozen=True)
class Allocation:
    """Per layer (key bits, value bits), the accounted budget vs a 16-bit cache, the KL predicted by
    adding single-store sensitivities, and each store's measured ΔKL per width."""

    layers: tuple[tuple[int, int], ...]
    budget: float
    predicted_kl: float
    sensitivity: list[list[dict[str, float]]]  # [layer][side] -> {bits: ΔKL}


def allocate(
    sensitivity: Sequence[Sequence[dict[int, float]]],
    widths: Sequence[int],
    choices: Sequence[int],
    budget: float,
    storage: QuantSpec,
    head_dim: int,
) -> tuple[tuple[tuple[int, int], ...], float]:
    """Greedy allocation: ``sensitivity[layer][side][bits]`` = ΔKL of that store alone at ``bits``
    (0 at ``max(choices)``), ``widths[layer]`` values per token and side. Lowers the store whose next
    step costs the least ΔKL per byte saved until Σ bytes ≤ ``budget`` × a 16-bit cache's. A layer of width 0
    is not allocated (it keeps ``max(choices)``): a sliding-window layer, whose bounded window does not count
    in a long-context budget.
    Bytes are accounted as ``storage`` (group, layout) holds heads ``head_dim`` wide.
    Returns (per layer (key bits, value bits), accounted budget)."""
    ordered = sorted(choices, reverse=True)
    bits = [[ordered[0], ordered[0]] for _ in widths]

    def bytes_of(bits: int, width: int, per_channel: bool) -> float:
        return stored_bytes(bits, width, per_channel, storage, head_dim)

    def used() -> float:
        return accounted_budget([(k, v) for k, v in bits], widths, storage, head_dim)

    while used() > budget + 1e-12:
        best: tuple[float, int, int, int] | None = None
        for i, w in enumerate(widths):
            for s in (0, 1) if w else ():
                step = ordered.index(bits[i][s]) + 1
                if step == len(ordered):
                    continue
                lower = ordered[step]
                saved = bytes_of(bits[i][s], w, s == 0) - bytes_of(lower, w, s == 0)
                cost = sensitivity[i][s][lower] - sensitivity[i][s][bits[i][s]]
                if best is None or cost / saved < best[0]:
                    best = (cost / saved, i, s, lower)
        if best is None:
            raise KVConvertError(
                f"--kv-budget {budget} is below what {min(choices)}-bit storage of every layer reaches "
                f"({used():.3f} of a 16-bit cache); raise the budget or lower --min-bits"
            )
        _, i, s, lower = best
        bits[i][s] = lower
    return tuple((k, v) for k, v in bits), used()


@torch.no_grad()
def measure_allocation(
    source: Any,
    chunks: torch.Tensor,
    widths: Sequence[int],
    choices: Sequence[int],
    budget: float,
    storage: QuantSpec,
    head_dim: int,
    progress: bool = True,
    stock: frozenset[int] = frozenset(),
    recall: Sequence[Sequence[dict[int, float]]] | None = None,
) -> tuple[Allocation, float]:
    """Measure every store's sensitivity on ``chunks``, allocate, and measure the allocation;
    ``storage`` gives everything but the widths (group, residual, sink, rotation); ``stock`` layers attend
    unquantized, as the runtime keeps them; layers of width 0 are not probed. ``recall[layer][side][bits]``
    (``quant.recall``'s answer-token KL) is added to each store's text loss before allocating: the predicted
    and measured KLs stay the text's. Every probe runs
    ``source`` (a ``SourceCheckpoint``) layer by layer: memory stays at about one layer.
    Returns (allocation, measured KL of the allocation)."""
    top = max(choices)
    layers = len(widths)
    allocate([[dict.fromkeys(choices, 0.0)] * 2] * layers, widths, choices, budget, storage, head_dim)  # reachable?
    reference = log_probs(source, chunks)

    def kl_of(per_layer: list[tuple[int, int]]) -> float:
        spec = dataclasses.replace(storage, bits=top, layers=tuple(per_layer))
        return mean_kl(source, chunks, reference, lambda model: simulated_storage(model, spec, stock))

    baseline = kl_of([(top, top)] * layers)
    sensitivity: list[list[dict[int, float]]] = [[{top: 0.0}, {top: 0.0}] for _ in range(layers)]
    probes = [(i, s, b) for i in range(layers) if widths[i] for s in (0, 1) for b in choices if b != top]
    for i, s, b in tqdm(probes, desc="measuring KV sensitivity", disable=not progress):
        per_layer = [(top, top)] * layers
        per_layer[i] = (b, top) if s == 0 else (top, b)
        sensitivity[i][s][b] = kl_of(per_layer) - baseline
    weighed = sensitivity if recall is None else [
        [{b: side[b] + recall[i][s][b] for b in side} for s, side in enumerate(layer)]
        for i, layer in enumerate(sensitivity)
    ]  # fmt: skip
    chosen, used = allocate(weighed, widths, choices, budget, storage, head_dim)
    predicted = baseline + sum(sensitivity[i][s][chosen[i][s]] for i in range(layers) for s in (0, 1))
    report = [[{str(b): round(v, 6) for b, v in side.items()} for side in layer] for layer in sensitivity]
    return Allocation(chosen, used, predicted, report), kl_of(list(chosen))
