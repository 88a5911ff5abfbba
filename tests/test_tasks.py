"""``kvconvert eval --tasks``: RULER-style samples (their lengths, needles, answers, determinism), the scoring,
the chunked prefill, and the command's errors."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from helpers import run_cli

from kvconvert.eval.tasks import TASKS, Sample, answer, make_samples, score


@pytest.fixture(scope="module")
def tokenizer(aidreams_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(aidreams_dir)


def test_scoring_is_rulers_string_match_all():
    assert score("The numbers are 1234567 and 7654321.", ("1234567", "7654321")) == 1.0
    assert score("the numbers are 1234567", ("1234567", "7654321")) == 0.5
    assert score("ABCDE", ("abcde",)) == 1.0 and score("", ("x",)) == 0.0


@pytest.mark.parametrize("task", TASKS)
def test_samples_fit_their_length_hold_their_answers_and_repeat_with_the_seed(tokenizer, task):
    length = 1024
    samples = make_samples(tokenizer, task, length, 3, seed=0)
    assert make_samples(tokenizer, task, length, 3, seed=0) == samples
    assert make_samples(tokenizer, task, length, 3, seed=1) != samples
    # a later run extends an earlier one: samples 2-3 of the seed are the same whether made with the first or not
    assert make_samples(tokenizer, task, length, 2, seed=0, first=1) == samples[1:]
    for sample in samples:
        # prompt + answer fit, and the haystack filled most of the room (RULER sizes it by binary search)
        assert 0.8 * length <= len(sample.prompt) + sample.new_tokens <= length
        text = tokenizer.decode(sample.prompt)
        body = text[: text.rindex("Question") if "Question" in text else text.rindex("What are all")]
        # the question starts where the sample says (kvpress's protocol compresses only what comes before)
        question = tokenizer.decode(sample.prompt[sample.question_at :]).lstrip()
        assert question.startswith(("Question:", "What are all")), question[:40]
        assert body.rstrip().endswith(tokenizer.decode(sample.prompt[: sample.question_at]).rstrip()[-40:])
        if task.startswith("niah") or task == "vt":
            assert all(a in body for a in sample.answers), (task, sample.answers)
        if task == "niah_multikey":  # three distractor numbers that are not the answer
            assert len(re.findall(r"special magic numbers for \S+ is: \d{7}", body)) == 4
        if task == "cwe":  # the ten answers are the ten most frequent list entries
            counts = Counter(re.findall(r"^\d+\. (\w+)$", body, re.M))
            assert set(sample.answers) == {w for w, _ in counts.most_common(10)}
            assert counts.most_common(11)[9][1] > counts.most_common(11)[10][1]
        if task == "fwe":
            counts = Counter(body.split("coded words. ", 1)[1].split())
            assert [w for w, _ in counts.most_common(3)] == list(sample.answers)


@torch.no_grad()
def test_the_prompt_goes_in_by_chunks_as_it_would_in_one_forward(tiny_model_dir):
    """Chunked prefill through the cache gives the answer one forward gives (what bounds memory at 32K)."""
    from helpers import load_reference

    model = load_reference(tiny_model_dir("llama_gqa"))

    class Digits:  # the tiny model's vocabulary as a tokenizer: ids in, their decimal strings out
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    prompt = torch.randint(3, 90, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    sample = Sample("niah_single", prompt, ("never",), 12)
    assert answer(model, Digits(), sample, chunk=7) == answer(model, Digits(), sample, chunk=1000)


def test_eval_tasks_scores_model_and_reference_on_the_same_samples(aidreams_dir, tmp_path):
    out = tmp_path / "tasks.json"
    result = run_cli("eval", "--model", str(aidreams_dir), "--reference", str(aidreams_dir), "--tasks",
                     "niah_single,fwe", "--lengths", "512", "--allow-extrapolation", "--samples", "2",
                     "--json", str(out), "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["tasks"] == ["niah_single", "fwe"] and data["lengths"] == [512]
    assert data["accuracy"]["model"] == data["accuracy"]["reference"]  # the same model, the same samples
    assert data["answers"]["model"] == data["answers"]["reference"]
    for task in data["tasks"]:  # every sample's score and text, and the accuracy is their mean
        kept = data["answers"]["model"][task]["512"]
        assert len(kept) == 2 and all(isinstance(text, str) and got in (0, 1) for got, text in kept)
        assert data["accuracy"]["model"][task]["512"] == pytest.approx(100 * sum(got for got, _ in kept) / 2)
    assert "average" in result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--tasks", "niah_single,sudoku"), "unknown task sudoku; tasks: niah_single"),
        (("--tasks", "vt", "--lengths", "99999"), "exceeds the model's"),
        (("--tasks", "niah_multivalue", "--lengths", "64"), "cannot hold the task's needles"),
        (("--tasks", "vt", "--data", "x.txt"), "give --data"),
        ((), "give --data"),
    ],
)
def test_bad_task_arguments_are_one_line(aidreams_dir, args, says):
    result = run_cli("eval", "--model", str(aidreams_dir), "--quiet", *args)
    assert result.exit_code == 2, result.output
    assert says in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_a_check_against_a_floor_stops_once_out_of_reach_with_the_same_verdict(seed, shuffled, monkeypatch):
    """``checked_accuracy`` with a floor: the verdict (average ≥ floor at every length) is the full run's, it
    stops at the first sample after which the floor is out of reach, and what it returns bounds the full run's
    accuracies from above; in any ``order`` of the samples (the planner's: what the source missed first), each
    answered in that order and its score recorded. Answers are faked by a random pattern of right and wrong."""
    import random

    import kvconvert.eval.tasks as tasks

    rng = random.Random(seed)
    batches = {(task, length): [Sample(task, [i, length], (f"a{i}",), 4) for i in range(rng.randint(1, 4))]
               for task in ("niah_single", "vt", "cwe") for length in (64, 128)}  # fmt: skip
    right = {id(s): rng.random() < 0.8 for batch in batches.values() for s in batch}
    asked: list[int] = []

    def fake_answer(model, tokenizer, sample, chunk=512, prefill_with=None):
        asked.append(id(sample))
        return sample.answers[0] if right[id(sample)] else "no"

    monkeypatch.setattr(tasks, "answer", fake_answer)
    full = tasks.task_accuracy(None, None, batches)
    floor = rng.choice([50.0, 75.0, 90.0, 100.0])
    asked.clear()
    keys = [(key, i) for key, batch in batches.items() for i in range(len(batch))]
    if shuffled:
        rng.shuffle(keys)
    scores: dict = {}
    bounded, complete = tasks.checked_accuracy(None, None, batches, floor=floor, order=keys if shuffled else None,
                                               scores=scores)  # fmt: skip
    assert list(scores) == keys[: len(asked)] and all(scores[k] == right[id(batches[k[0]][k[1]])] for k in scores)
    passes = min(tasks.average_accuracy(full).values()) >= floor
    assert (min(tasks.average_accuracy(bounded).values()) >= floor) == passes
    assert all(bounded[t][n] >= full[t][n] for t in full for n in full[t])
    if passes:
        assert complete and bounded == full
    elif not complete:  # it stopped at the first sample that put the floor out of reach, not later
        order = [id(batches[key][i]) for key, i in keys]
        assert asked == order[: len(asked)] and not right[asked[-1]]
    assert len(asked) == (sum(map(len, batches.values())) if complete else len(asked))


def test_needle_samples_of_one_length_share_their_haystack_start(tokenizer):
    """RULER's design (one haystack per length, needles at random depths): every needle task's prompts share
    their text up to the first needle, which ``SharedPrefixes`` prefills once; another seed, another haystack."""
    from kvconvert.eval.tasks import SharedPrefixes

    samples = [s for task in ("niah_single", "niah_multikey") for s in make_samples(tokenizer, task, 1024, 3, seed=0)]
    shared = SharedPrefixes([s.prompt for s in samples], chunk=1)
    opening = "Some special magic numbers are hidden within the following text. Make sure to memorize them."
    instruction = len(tokenizer(opening + " I will quiz you about the numbers afterwards.").input_ids)
    assert all(shared.shared(i, j) >= instruction for i in range(6) for j in range(6))
    # one needle each: these share their haystack up to the earlier needle (a four-needle sample's first may be at
    # the very start)
    assert all(shared.shared(i, j) > instruction + 20 for i in range(3) for j in range(3))
    other = make_samples(tokenizer, "niah_single", 1024, 1, seed=1)[0]
    assert SharedPrefixes([samples[0].prompt, other.prompt], chunk=1).shared(0, 1) < instruction + 20


@torch.no_grad()
@pytest.mark.parametrize("keep_bytes", [0, 1 << 29])
def test_answers_through_shared_prefixes_are_the_answers_from_scratch(tiny_model_dir, keep_bytes):
    """``checked_accuracy`` answers through ``SharedPrefixes``: the same answers as each prompt prefilled alone;
    nothing kept (no room for a copy: ``keep_bytes`` 0) still answers right, prefilling every token."""
    from helpers import load_reference

    from kvconvert.eval.tasks import SharedPrefixes

    model = load_reference(tiny_model_dir("llama_gqa"))

    class Digits:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    trunk = torch.randint(3, 90, (180,), generator=torch.Generator().manual_seed(0)).tolist()
    # chunks of 16: the second and third start from the first's cache at 64 tokens (the first, 96 long, is all of
    # the third's and fourth's beginning: no copy at its end), the fourth from the third's at 112
    prompts = [trunk[:96], trunk[:70] + trunk[70:][::-1], trunk[:120] + trunk[120:][::-1], trunk + trunk[:20]]
    shared = SharedPrefixes(prompts, chunk=16, keep_bytes=keep_bytes)
    for j, prompt in enumerate(prompts):
        sample = Sample("niah_single", prompt, ("never",), 6)
        alone = answer(model, Digits(), sample, chunk=16)
        assert answer(model, Digits(), sample, 16, lambda m, ids, j=j: shared.prefill(m, ids, j)) == alone
    assert shared.prefilled == sum(map(len, prompts)) - (0 if keep_bytes == 0 else 64 + 64 + 112)
