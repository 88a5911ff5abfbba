"""RULER-style long-context tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), generated on the fly from the model's own tokenizer with a fixed seed and
answered through the model's cache.

Tasks (RULER's definitions, its answer prefixes and its ``string_match_all`` scoring: the fraction of the
expected strings found in the generated answer):

- ``niah_single``: one "special magic number" for a key hidden in an essay haystack (RULER's
  niah_single_2); ``niah_multikey``: four needles with different keys, one asked for (niah_multikey_1);
  ``niah_multivalue``: four numbers for one key, all asked for; ``niah_multiquery``: four keys, all asked for;
- ``vt``: variable tracking, one chain of four hops (``VAR A = 12345``, ``VAR B = VAR A`` …) hidden in
  repeated filler; every variable that holds the value is asked for;
- ``cwe``: common-words extraction, a numbered list where ten words appear 30 times (from 4K tokens on; fewer
  below, length ÷ 120, at least 4) and the rest 3 times; the ten are asked for;
- ``fwe``: frequent-words extraction, coded text of random words drawn from a Zipf law (α = 2); the three
  most frequent are asked for.

Haystacks come from the calibration text the package ships (``kvconvert/calib_data``), repeated when a
length needs more; words for ``cwe`` from the same text. As in RULER, every needle task of one length draws the
same haystack (from a start the seed picks) and samples differ in their needles and depths, so their prompts
share the text before their first needle. Prompts go into the cache in chunks (bounded memory at any length),
the answer is generated greedily through it: a method that drops, merges or quantizes cached tokens loses here
what it loses in use. A model answering several samples prefills a shared prefix once (``SharedPrefixes``).
"""

from __future__ import annotations

import copy
import functools
import random
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvconvert.errors import KVConvertError

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ESSAYS = Path(__file__).resolve().parents[1] / "calib_data"


@dataclass(frozen=True)
class Sample:
    """One task instance: the prompt (its answer prefix included) as token ids, the strings a correct answer
    contains, and how many tokens to generate."""

    task: str
    prompt: list[int]
    answers: tuple[str, ...]
    new_tokens: int
    # where the question starts in ``prompt``: tools that compress only the context (kvpress's protocol: the
    # question is read through the compressed cache afterwards) split the prompt here
    question_at: int = 0


def parse_task_names(text: str, keywords: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``--tasks``: comma-separated task names or ``all``; one line listing the tasks (and ``keywords``, which a
    caller handles itself) for anything else."""
    names = TASKS if text.strip() == "all" else tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise KVConvertError(f"unknown task {', '.join(unknown) or repr(text)}; tasks: {', '.join(TASKS)} "
                             f"(or {', '.join(('all', *keywords))})")  # fmt: skip
    return names


def score(prediction: str, answers: tuple[str, ...]) -> float:
    """RULER's ``string_match_all``: the fraction of ``answers`` found in ``prediction`` (case-insensitive)."""
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def essay_sentences() -> list[str]:
    """The shipped text as sentences, files in name order (the haystack every length draws from)."""
    text = " ".join(p.read_text().strip() for p in sorted(ESSAYS.glob("[0-9]*.txt")))
    return [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]


class _Tokens:
    """Token counting and encoding with one tokenizer (no special tokens: the prompt adds BOS once)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        adds = tokenizer.bos_token_id is not None and getattr(tokenizer, "add_bos_token", False)
        self.bos = [tokenizer.bos_token_id] if adds else []  # as the tokenizer would add it

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def sample(self, task: str, text: str, answers: tuple[str, ...], new_tokens: int) -> Sample:
        """The sample of a fitted prompt ``text``, its question located (the last line that asks)."""
        marker = max(text.rfind("\nQuestion:"), text.rfind("\nWhat are all"))
        try:
            offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            before = next(i for i, (start, _) in enumerate(offsets) if start >= marker)
        except (NotImplementedError, StopIteration):  # a slow tokenizer: the prefix's own tokens
            before = self.count(text[:marker])
        return Sample(task, self.bos + self.encode(text), answers, new_tokens, len(self.bos) + before)


def _fit(
    build: Callable[[int], tuple[str, str]], tokens: _Tokens, length: int, new_tokens: int, most: int
) -> tuple[str, int]:
    """(prompt text, n) of ``build(n)`` (→ (prompt, answer prefix)) with the largest ``n`` ≤ ``most`` whose
    prompt and answer fit in ``length`` tokens (binary search, as RULER sizes its haystacks)."""
    low, high, best, fitted = 1, most, None, 0
    while low <= high:
        middle = (low + high) // 2
        prompt, prefix = build(middle)
        if len(tokens.bos) + tokens.count(prompt + prefix) + new_tokens <= length:
            best, fitted, low = prompt + prefix, middle, middle + 1
        else:
            high = middle - 1
    if best is None:
        raise KVConvertError(f"a {length}-token prompt cannot hold the task's needles and question: give a longer one")
    return best, fitted


def random_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def random_word(rng: random.Random, size: int = 6) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(size))


def _niah(task: str, tokens: _Tokens, length: int, rng: random.Random, sentences: list[str], start: int) -> Sample:
    keys = [f"{random_word(rng)}-{random_word(rng)}" for _ in range(4)]
    if task == "niah_single":
        needles, asked = [(keys[0], random_number(rng))], [keys[0]]
    elif task == "niah_multikey":  # distractors: other keys' numbers
        needles, asked = [(k, random_number(rng)) for k in keys], [keys[0]]
    elif task == "niah_multivalue":
        needles, asked = [(keys[0], random_number(rng)) for _ in range(4)], [keys[0]]
    else:  # niah_multiquery
        needles, asked = [(k, random_number(rng)) for k in keys], keys
    rng.shuffle(needles)
    depths = sorted(rng.random() for _ in needles)
    query = ", ".join(asked)
    new_tokens = 32 * len(needles) if task in ("niah_multivalue", "niah_multiquery") else 32  # ~32 per number

    def build(n: int) -> tuple[str, str]:
        hay = [sentences[(start + i) % len(sentences)] for i in range(n)]
        for offset, ((key, value), depth) in enumerate(zip(needles, depths, strict=True)):
            hay.insert(int(depth * n) + offset, f"One of the special magic numbers for {key} is: {value}.")
        prompt = (f"Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                  f"I will quiz you about the numbers afterwards.\n{' '.join(hay)}\nWhat are all the special magic "
                  f"numbers for {query} mentioned in the provided text?")  # fmt: skip
        return prompt, f" The special magic numbers for {query} mentioned in the provided text are"

    text = _fit(build, tokens, length, new_tokens, most=max(4, length))[0]
    answers = tuple(value for key, value in needles if key in asked)
    return tokens.sample(task, text, answers, new_tokens)


def _vt(tokens: _Tokens, length: int, rng: random.Random) -> Sample:
    value = str(rng.randint(10_000, 99_999))
    names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(5)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
    depths = sorted(rng.random() for _ in chain)

    def build(n: int) -> tuple[str, str]:
        hay = [FILLER] * n
        for offset, (line, depth) in enumerate(zip(chain, depths, strict=True)):
            hay.insert(int(depth * n) + offset, line)
        prompt = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                  f"{' '.join(hay)}\nQuestion: Find all variables that are assigned the value {value} in the text "
                  "above.")  # fmt: skip
        return prompt, (f" Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                        f"are assigned the value {value}, they are: ")  # fmt: skip

    return tokens.sample("vt", _fit(build, tokens, length, 30, most=max(4, length))[0], tuple(names), 30)


def _cwe(tokens: _Tokens, length: int, rng: random.Random, vocabulary: list[str]) -> Sample:
    words = rng.sample(vocabulary, len(vocabulary))
    common, rare = words[:10], words[10:]
    frequency = max(4, min(30, length // 120))  # RULER's 30 from 4K on; fewer where 300 list lines do not fit

    def build(n: int) -> tuple[str, str]:
        listed = [w for w in common for _ in range(frequency)] + [w for w in rare[:n] for _ in range(3)]
        random.Random(n).shuffle(listed)
        numbered = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
        prompt = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                  f"ones that appear most often.\n{numbered}\nQuestion: What are the 10 most common words in the above "
                  "list?")  # fmt: skip
        return prompt, " Answer: The top 10 words that appear most often in the list are:"

    return tokens.sample("cwe", _fit(build, tokens, length, 120, most=len(rare))[0], tuple(common), 120)


def _fwe(tokens: _Tokens, length: int, rng: random.Random) -> Sample:
    vocabulary = list(dict.fromkeys(random_word(rng, rng.randint(3, 5)) for _ in range(2000)))
    weights = [1 / (rank + 1) ** 2.0 for rank in range(len(vocabulary))]
    stream = rng.choices(vocabulary, weights, k=4 * length)  # more words than any prompt of ``length`` holds

    def build(n: int) -> tuple[str, str]:
        prompt = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                  f"frequently appeared coded words. {' '.join(stream[:n])}\nQuestion: Do not provide any "
                  "explanation. Please ignore the dots '....'. What are the three most frequently appeared words in "
                  "the above coded text?")  # fmt: skip
        return prompt, " Answer: According to the coded text above, the three most frequently appeared words are:"

    text, used = _fit(build, tokens, length, 50, most=len(stream))
    top = tuple(word for word, _ in Counter(stream[:used]).most_common(3))
    return tokens.sample("fwe", text, top, 50)


def cwe_vocabulary(sentences: list[str]) -> list[str]:
    """Distinct lowercase words of 4–10 letters from the haystack text, in order of appearance."""
    seen = dict.fromkeys(w for s in sentences for w in re.findall(r"[a-z]{4,10}", s.lower()))
    return list(seen)


def make_samples(tokenizer: Any, task: str, length: int, count: int, seed: int, first: int = 0) -> list[Sample]:
    """``count`` samples of ``task`` at ``length`` tokens (prompt + answer); the same arguments give the same
    samples, so a model and its reference answer the very same prompts. Each sample is seeded by its index:
    ``first`` > 0 gives samples ``first``, ``first + 1``, … of the same seed (a run extended to more samples
    without repeating the ones already answered)."""
    if task not in TASKS:
        raise KVConvertError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    tokens, sentences = _Tokens(tokenizer), essay_sentences()
    vocabulary = cwe_vocabulary(sentences)
    # one haystack per seed and length, every needle task's (RULER's design): prompts then share their text up
    # to their first needle, which a model answering them prefills once (``SharedPrefixes``)
    start = random.Random(f"{seed}/{length}").randrange(len(sentences))
    out = []
    for i in range(first, first + count):
        rng = random.Random(f"{seed}/{task}/{length}/{i}")
        if task.startswith("niah"):
            out.append(_niah(task, tokens, length, rng, sentences, start))
        elif task == "vt":
            out.append(_vt(tokens, length, rng))
        elif task == "cwe":
            out.append(_cwe(tokens, length, rng, vocabulary))
        else:
            out.append(_fwe(tokens, length, rng))
    return out


KEEP_BYTES = 1 << 29  # copies of prefix caches held at once, at most (512 MiB: peak memory stays bounded)


class SharedPrefixes:
    """Prefill of prompts answered one after another (``prompts``, in that order) that reuses what they share:
    while a prompt goes into the cache, a copy of the cache is kept at each chunk boundary up to which a prompt
    still to come shares its tokens, and that prompt starts from the copy. Chunks from position 0 and from a copy
    end at the same positions, so the cache and logits are the ones a prefill from scratch gives, bit for bit, for
    any cache, token-dropping and merging ones included (``tests/test_method_contract.py``). Copies are taken only
    while those held total at most ``keep_bytes`` (their bytes as run), and dropped once no prompt to come starts
    from them. Without ``chunk`` (one forward per prompt) nothing is shared."""

    def __init__(self, prompts: list[list[int]], chunk: int | None, keep_bytes: int = KEEP_BYTES):
        self.prompts = [torch.tensor(p) for p in prompts]
        self.chunk, self.keep_bytes = chunk, keep_bytes
        self.kept: dict[tuple[int, int], Any] = {}  # (prompt, tokens) -> the cache after its first ``tokens``
        self.prefilled = 0  # tokens that went through the model (for tests and reports)

    def shared(self, a: int, b: int) -> int:
        """Tokens prompt ``b`` can take from prompt ``a``'s prefill: their common prefix down to a chunk boundary,
        short of ``b``'s last token (its logits are the answer's first)."""
        if self.chunk is None:
            return 0
        pa, pb = self.prompts[a], self.prompts[b]
        n = min(pa.numel(), pb.numel() - 1)
        differ = (pa[:n] != pb[:n]).nonzero()
        common = int(differ[0]) if differ.numel() else n
        return common // self.chunk * self.chunk

    def _start(self, j: int) -> tuple[int, tuple[int, int] | None]:
        """The kept copy prompt ``j`` starts from (most tokens) and its tokens; (0, None) for none."""
        usable = [(tokens, key) for key in self.kept if (tokens := key[1]) <= self.shared(key[0], j)]
        return max(usable, default=(0, None))

    def prefill(self, model: Any, ids: torch.Tensor, index: int) -> tuple[Any, torch.Tensor]:
        """(cache, last logits) of prompt ``index`` (``ids`` = it on the model's device), as ``quality.prefill``."""
        from kvconvert.eval.memory import cache_nbytes
        from kvconvert.eval.quality import prefill

        j = index
        start, key = self._start(j)
        past = None if key is None else copy.deepcopy(self.kept[key])
        later = range(j + 1, len(self.prompts))
        # a copy where a later prompt could start further than from anything kept now (inside this prompt: a prompt
        # that is another's beginning gives it no copy, its cache goes on to the answer)
        marks = sorted({b for k in later if max(start, self._start(k)[0]) < (b := self.shared(j, k)) < ids.shape[1]})
        cache, at, logits = past, start, None
        for end in [*marks, ids.shape[1]]:
            cache, logits = prefill(model, ids[:, at:end], self.chunk, past=cache)
            self.prefilled += end - at
            held = sum(cache_nbytes(c) for c in self.kept.values())
            if end < ids.shape[1] and held + cache_nbytes(cache) <= self.keep_bytes:
                self.kept[j, end] = copy.deepcopy(cache)
            at = end
        for kept in list(self.kept):  # drop what no prompt to come starts from
            if all(self._start(k)[1] != kept for k in later):
                del self.kept[kept]
        assert logits is not None
        return cache, logits


@torch.no_grad()
def answer(
    model: Any, tokenizer: Any, sample: Sample, chunk: int = 512,
    prefill_with: Callable[[Any, torch.Tensor], tuple[Any, torch.Tensor]] | None = None,
) -> str:  # fmt: skip
    """Greedy answer to ``sample``: the prompt into the model's own cache ``chunk`` tokens at a time (only the
    last position's logits kept), then ``new_tokens`` generated through it (stopping at end of sequence).
    ``prefill_with(model, ids)``: what puts the prompt in instead (``SharedPrefixes.prefill``), same result."""
    from kvconvert.devices import model_device
    from kvconvert.eval.quality import prefill

    ids = torch.tensor([sample.prompt], device=model_device(model))
    cache, logits = prefill(model, ids, chunk) if prefill_with is None else prefill_with(model, ids)
    eos = tokenizer.eos_token_id
    generated: list[int] = []
    for _ in range(sample.new_tokens):
        token = int(logits[0, -1].argmax())
        if token == eos:
            break
        generated.append(token)
        if score(str(tokenizer.decode(generated, skip_special_tokens=True)), sample.answers) == 1:
            break  # every answer is there already: more tokens cannot change the score (containment)
        out = model(torch.tensor([[token]], device=ids.device), past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits
    return str(tokenizer.decode(generated, skip_special_tokens=True))


Batches = dict[tuple[str, int], list[Sample]]
SampleKey = tuple[tuple[str, int], int]  # ((task, length), index in its batch)


def make_batches(
    tokenizer: Any, tasks: tuple[str, ...], lengths: tuple[int, ...], samples: int, seed: int = 0, first: int = 0
) -> Batches:
    """Every sample of every task and length, made before any model runs (a length too short for a task is one
    error up front), so that each model answers the very same prompts."""
    return {(task, length): make_samples(tokenizer, task, length, samples, seed, first) for length in lengths
            for task in tasks}  # fmt: skip


def task_accuracy(
    model: Any, tokenizer: Any, batches: Batches, chunk: int = 512, progress: str | None = None
) -> dict[str, dict[str, float]]:
    """Accuracy (0–100) of one model per task and length: ``{task: {length: acc}}``; ``progress``: a bar with
    this label over the samples (tens of seconds each at 8K on a CPU)."""
    return checked_accuracy(model, tokenizer, batches, chunk, progress)[0]


def checked_accuracy(
    model: Any, tokenizer: Any, batches: Batches, chunk: int = 512, progress: str | None = None,
    floor: float | None = None, order: list[SampleKey] | None = None, scores: dict[SampleKey, float] | None = None,
    answers: dict[SampleKey, str] | None = None,
) -> tuple[dict[str, dict[str, float]], bool]:  # fmt: skip
    """``task_accuracy`` that may stop early: with ``floor``, as soon as some length's average accuracy (the mean
    over tasks) could no longer reach ``floor`` even if every sample left were answered right, the rest are not
    run (each costs a long prefill) and count as right, so the accuracies returned are upper bounds. Returns them
    and whether every sample was scored. A check against a bound gives the same pass / fail either way.
    ``order``: every sample's key, in the order to answer them (default: as batched); ``scores``: receives each
    answered sample's score (0 or 1) by its key; ``answers``: its generated text."""
    from tqdm import tqdm

    right = {key: 0.0 for key in batches}
    left = {key: len(batch) for key, batch in batches.items()}
    bar = tqdm(total=sum(left.values()), desc=progress, unit="sample", disable=progress is None)

    def accuracies() -> dict[str, dict[str, float]]:  # samples not scored yet count as right
        accuracy: dict[str, dict[str, float]] = {}
        for (task, length), batch in batches.items():
            accuracy.setdefault(task, {})[str(length)] = 100 * (right[task, length] + left[task, length]) / len(batch)
        return accuracy

    keys = order if order is not None else [(key, i) for key, batch in batches.items() for i in range(len(batch))]
    assert sorted(keys) == sorted((key, i) for key, batch in batches.items() for i in range(len(batch))), "each once"
    shared = SharedPrefixes([batches[key][i].prompt for key, i in keys], chunk)
    for j, (key, i) in enumerate(keys):
        s = batches[key][i]
        text = answer(model, tokenizer, s, chunk, functools.partial(shared.prefill, index=j))
        got = score(text, s.answers)
        if scores is not None:
            scores[key, i] = got
        if answers is not None:
            answers[key, i] = text
        right[key] += got
        left[key] -= 1
        bar.update()
        if floor is not None and min(average_accuracy(accuracies()).values()) < floor - 1e-9:
            break
    bar.close()
    return accuracies(), sum(left.values()) == 0


def average_accuracy(accuracy: dict[str, dict[str, float]]) -> dict[str, float]:
    """Mean over tasks per length."""
    lengths = next(iter(accuracy.values()))
    return {n: sum(by_length[n] for by_length in accuracy.values()) / len(accuracy) for n in lengths}


def run_tasks(
    models: dict[str, Any], tokenizer: Any, tasks: tuple[str, ...], lengths: tuple[int, ...], samples: int,
    seed: int = 0, chunk: int = 512, progress: bool = False, first: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Accuracy (0–100) per model, task and length on the same samples: ``{"accuracy": {model: {task:
    {length: acc}}}, "average": {model: {length: acc}}, "samples": samples, "answers": {model: {task: {length:
    [[score, text], ...]}}}}``: every sample's score and generated text too, so that two models' misses can be told
    apart (the same samples lost, or others; a distractor's value answered, or nothing)."""
    batches = make_batches(tokenizer, tasks, lengths, samples, seed, first)
    accuracy, answers = {}, {}
    for name, model in models.items():
        scores: dict[SampleKey, float] = {}
        texts: dict[SampleKey, str] = {}
        accuracy[name] = checked_accuracy(model, tokenizer, batches, chunk, f"tasks: {name}" if progress else None,
                                          scores=scores, answers=texts)[0]  # fmt: skip
        by_task: dict[str, dict[str, list[list[Any]]]] = {}
        for (task, length), batch in batches.items():
            by_task.setdefault(task, {})[str(length)] = [[scores[(task, length), i], texts[(task, length), i]]
                                                         for i in range(len(batch))]  # fmt: skip
        answers[name] = by_task
    average = {name: average_accuracy(by_task) for name, by_task in accuracy.items()}
    return {"tasks": list(tasks), "lengths": list(lengths), "samples": samples, "seed": seed, "first": first,
            "accuracy": accuracy, "average": average, "answers": answers}  # fmt: skip
