"""Long-context checks where token- and head-dropping methods fail first.

* passkey: a 5-digit number hidden at several depths of filler text, asked for at the end;
  correct when the greedy continuation starts with the number.
* copy: a random token sequence repeated twice; accuracy of the argmax predictions over the
  second copy (induction), which even small models do well.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from kvconvert.devices import model_device

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = " What is the pass key? The pass key is"


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@torch.no_grad()
def passkey_accuracy(
    model: Any, tokenizer: Any, length: int, depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0), seed: int = 0
) -> float | None:
    """Fraction of depths at which the model retrieves the key from a ``length``-token prompt
    (answer included); None when the needle and question alone do not fit in ``length``."""
    rng = random.Random(seed + length)
    filler = _encode(tokenizer, FILLER)
    question = _encode(tokenizer, QUESTION)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and tokenizer.add_bos_token else []
    correct = 0
    for depth in depths:
        key = str(rng.randint(10000, 99999))
        needle = _encode(tokenizer, f" The pass key is {key}. Remember it. {key} is the pass key. ")
        expected = _encode(tokenizer, " " + key)
        # prompt + answer fit in ``length`` tokens
        budget = length - len(needle) - len(question) - len(bos) - len(expected) - 2
        if budget < 0:
            return None
        haystack = (filler * (budget // len(filler) + 1))[:budget]
        cut = int(len(haystack) * depth)
        ids = torch.tensor([bos + haystack[:cut] + needle + haystack[cut:] + question], device=model_device(model))
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(expected) + 2, do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )  # fmt: skip
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        correct += answer.strip().startswith(key)
    return correct / len(depths)


def ordinary_token_ids(tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """Ids of the tokenizer's ordinary vocabulary that the model has embeddings for: no special or
    added tokens, and no padding rows (embedding rows past the tokenizer's vocabulary are untrained,
    e.g. Qwen2's)."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = sorted(i for i in tokenizer.get_vocab().values() if i < vocab_size and i not in special)
    if len(ids) < 2:
        raise ValueError("the tokenizer has fewer than 2 ordinary tokens")
    return torch.tensor(ids)


@torch.no_grad()
def copy_accuracy(model: Any, length: int, vocab: torch.Tensor, seed: int = 0) -> float:
    """Argmax accuracy on the second half of a ``length``-token sequence that repeats its first half.

    Tokens are drawn from ``vocab`` (``ordinary_token_ids``). The first copy goes into the cache in one
    forward and the second is read through it, as in generation: a method that drops or merges cached
    tokens loses here what it loses in use. The first token of the second copy is not scored: nothing
    announces that the sequence restarts there.
    """
    half = length // 2
    gen = torch.Generator().manual_seed(seed + length)
    first = vocab[torch.randint(0, vocab.numel(), (half,), generator=gen)].to(model_device(model))
    prefix = model(first[None], use_cache=True)
    second = model(first[None, :-1], past_key_values=prefix.past_key_values, use_cache=True)
    predictions = second.logits[0].argmax(-1)  # second copy token i predicts first[i + 1]
    return (predictions == first[1:]).float().mean().item()
