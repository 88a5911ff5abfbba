"""What quantized storage costs retrieval at long context (a kvconvert extension): ``--recall-context``.

The width allocation's text probes (``bits``) score 512-token windows of plain text, where the newest few hundred
tokens hold most of what the next token needs: there, 8-bit keys look worth nothing. At 8K, the keys of the
layers that look facts up decide whether a needle 6K tokens back is found (measured on SmolLM2: 8-bit keys in
layers 15-29 found five of seven multikey needles, in layers 0-14 two; README, long-context tasks).

So the allocation can also probe recall: prompts ``--recall-context`` tokens long cut from the calibration text,
with four facts "the passcode of KEY is NUMBER" at random depths and, at the end, one key's question and its
answer. Every store (layer, keys or values) at every width is simulated on the prompt's tail alone (question and
answer), reading the prompt as the store holds it (``run_layer_by_layer``'s tail branches), and the KL of the
answer tokens' predictions against the source's is that store's recall loss: one prefill of the prompts plus a
question-sized forward per probe. The prefix itself is computed unquantized, so what is measured is the lookup.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvconvert.errors import KVConvertError
from kvconvert.eval.tasks import random_number, random_word
from kvconvert.runtime.kvconvert_codec import QuantSpec

FACTS = 4  # needles per prompt: the question's and three distractors that a wrong lookup finds instead


@dataclass(frozen=True)
class RecallSet:
    """``chunks [n, length]`` recall prompts, each ending in its question and answer within the last ``tail``
    tokens; ``scored[c]``: the tail positions that predict prompt c's answer tokens."""

    chunks: torch.Tensor
    tail: int
    scored: list[list[int]]
    source: str


def recall_prompts(tokenizer: Any, text: str, source: str, length: int, count: int, seed: int) -> RecallSet:
    """``count`` prompts of exactly ``length`` tokens of ``text`` (each from a seeded sentence start) with
    ``FACTS`` facts after sentence ends at random depths and one of them asked at the end."""
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    bos = tokenizer.bos_token_id
    bos_ids = [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []
    if len(ids) < length:
        raise KVConvertError(f"calibration text {source!r} has {len(ids)} tokens; --recall-context {length} needs "
                             f"at least that many: pass more text or a shorter --recall-context")  # fmt: skip
    ends = [i + 1 for i, piece in enumerate(tokenizer.convert_ids_to_tokens(ids)) if piece.endswith((".", "!", "?"))]
    prompts: list[list[int]] = []
    tails: list[tuple[int, int]] = []  # (question + answer tokens, answer tokens) per prompt
    for c in range(count):
        rng = random.Random(f"{seed}/recall/{length}/{c}")
        keys = [f"{random_word(rng, 5)}-{random_word(rng, 5)}" for _ in range(FACTS)]
        numbers = [random_number(rng) for _ in keys]
        facts = [tokenizer(f" Note: the passcode of {k} is {n}.", add_special_tokens=False).input_ids
                 for k, n in zip(keys, numbers, strict=True)]  # fmt: skip
        asked = keys[rng.randrange(FACTS)]
        question = tokenizer(f"\nWhat is the passcode of {asked}? The passcode of {asked} is",
                             add_special_tokens=False).input_ids  # fmt: skip
        answer = tokenizer(f" {numbers[keys.index(asked)]}", add_special_tokens=False).input_ids
        room = length - len(bos_ids) - sum(map(len, facts)) - len(question) - len(answer)
        if room < 16 * FACTS:
            raise KVConvertError(f"--recall-context {length} is too short for {FACTS} facts and a question")
        start = rng.choice([0, *(e for e in ends if e + room <= len(ids))])
        inside = [e - start for e in ends if start < e < start + room]
        places = sorted(rng.sample(inside, FACTS) if len(inside) >= FACTS else rng.sample(range(room), FACTS))
        hay, body, previous = ids[start : start + room], list(bos_ids), 0
        for place, fact in zip(places, facts, strict=True):
            body += hay[previous:place] + fact
            previous = place
        prompts.append(body + hay[previous:] + question + answer)
        tails.append((len(question) + len(answer), len(answer)))
    tail = max(t for t, _ in tails)
    # tail position j predicts token j + 1: the answer's tokens are the last ``a``, predicted by the ``a`` before
    scored = [list(range(tail - a - 1, tail - 1)) for _, a in tails]
    return RecallSet(torch.tensor(prompts, dtype=torch.long), tail, scored, source)


def floor_width(widths: Sequence[int], choices: Sequence[int], budget: float, storage: QuantSpec,
                head_dim: int) -> int:  # fmt: skip
    """The widest of ``choices`` that every (non-window) store could take within ``budget``: the width most
    stores end up near, where the recall probes measure (the narrowest when none fits)."""
    from kvconvert.methods.quant.bits import accounted_budget

    for bits in sorted(choices, reverse=True):
        if accounted_budget([(bits, bits)] * len(widths), widths, storage, head_dim) <= budget + 1e-12:
            return bits
    return min(choices)


@torch.no_grad()
def recall_sensitivity(
    source: Any,
    recall: RecallSet,
    widths: Sequence[int],
    choices: Sequence[int],
    storage: QuantSpec,
    floor: int,
    progress: bool = True,
) -> list[list[dict[int, float]]]:
    """``[layer][side][bits]``: the KL of the answer tokens (vs the source's) with that store at ``bits`` and
    every other store at ``floor``, less the same with that store at ``max(choices)`` (so 0 there, as the text
    probes'). Measured with the others narrow because that is where a retrieval breaks: with one store at 3 bits
    and the rest exact no lookup fails (SmolLM2 at 8K), with all at 3 bits most do, and the bits that mend it
    are what the allocation must find. Layers of width 0 (sliding windows) stay exact and are not probed."""
    from kvconvert.calib.hooks import observed_attention
    from kvconvert.calib.probes import branch_kls
    from kvconvert.calib.sequential import active_branch, active_chunk
    from kvconvert.devices import return_large_frees_to_the_os
    from kvconvert.methods.quant.bits import stored_after_prefill

    return_large_frees_to_the_os()
    probes = [(i, s, b) for i in range(len(widths)) if widths[i] for s in (0, 1) for b in choices]
    spec = dataclasses.replace(storage, layers=None)
    # (layer, chunk, side, bits) -> the prompt before the tail as that store holds it; the floor's is the same for
    # every branch, so it is quantized once per layer and chunk (only the running layer's are kept)
    stored: dict[tuple[int, int, int, int], torch.Tensor] = {}

    def held(prefix: torch.Tensor, layer: int, side: int, bits: int) -> torch.Tensor:
        key = (layer, active_chunk(), side, bits)
        if key not in stored:
            if any(k[0] != layer for k in stored):
                stored.clear()
            side_spec = dataclasses.replace(spec, bits=bits).side(layer, keys=side == 0)
            stored[key] = stored_after_prefill(prefix, side_spec, per_channel=side == 0)
        return stored[key]

    def store(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Any) -> Any:
        branch, layer = active_branch(), module.layer_idx
        if branch is None or not widths[layer]:
            return None
        probed, probed_side, bits = probes[branch]
        # the tail reads the prompt from the store and its own tokens exact, as a prefill chunk reads itself
        before = key.shape[-2] - query.shape[-2]
        out = []
        for side, states in enumerate((key, value)):
            width = bits if (probed, probed_side) == (layer, side) else floor
            out.append(torch.cat([held(states[..., :before, :], layer, side, width), states[..., before:, :]], -2))
        return query, out[0], out[1]

    # every branch re-runs every layer (the others' stores change too), on the question and answer alone
    kls = branch_kls(source, recall.chunks, [0] * len(probes), lambda model: observed_attention(model, store),
                     progress, recall.tail, recall.scored)  # fmt: skip
    measured = dict(zip(probes, kls, strict=True))
    top = max(choices)
    return [[{b: measured[i, s, b] - measured[i, s, top] if widths[i] else 0.0 for b in choices} for s in (0, 1)]
            for i in range(len(widths))]  # fmt: skip


def recall_set(model_path: Path, spec: str | None, length: int, count: int, seed: int) -> RecallSet:
    """The recall prompts of a calibration source (``calib.text``'s) for the model at ``model_path``."""
    from kvconvert.calib.text import load_tokenizer, read_calibration_text

    text, source = read_calibration_text(spec)
    return recall_prompts(load_tokenizer(model_path), text, source, length, count, seed)
