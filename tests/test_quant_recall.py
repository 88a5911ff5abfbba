"""``quant --kv-budget --recall-context``: recall prompts cut from the calibration text, and what each store's
width costs the answer when the question reads the prompt through that store (``kvconvert.methods.quant.recall``)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import convert, load_reference, run_cli

from kvconvert.calib.text import read_calibration_text
from kvconvert.errors import KVConvertError
from kvconvert.io.source import open_source
from kvconvert.methods.quant.bits import stored_after_prefill
from kvconvert.methods.quant.recall import FACTS, RecallSet, floor_width, recall_prompts, recall_sensitivity
from kvconvert.runtime.kvconvert_codec import QuantSpec


def _tokenizer_with_digits():
    """A BPE tokenizer of the calibration text whose alphabet holds digits and '?' (the tiny models' leaves the
    rare characters out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text, _ = read_calibration_text(None)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"], show_progress=False,
                                  initial_alphabet=list("0123456789?-."))  # fmt: skip
    tokenizer.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_recall_prompts_hold_the_facts_and_score_the_answer():
    tokenizer = _tokenizer_with_digits()
    text, source = read_calibration_text(None)
    recall = recall_prompts(tokenizer, text, source, 400, 3, seed=5)
    assert recall.chunks.shape == (3, 400)
    for c, row in enumerate(recall.chunks.tolist()):
        flat = tokenizer.decode(row).replace(" ", "")  # the tiny tokenizer decodes with spaces between tokens
        found = re.search(r"passcodeof([a-z]{5}-[a-z]{5})is(\d{7})$", flat)
        assert found, flat[-80:]
        asked, number = found.groups()
        assert flat.count("passcodeof") == FACTS + 2 and f"passcodeof{asked}is{number}." in flat
        # the scored tail positions predict exactly the answer's tokens, the last of the prompt
        targets = [row[400 - recall.tail + j + 1] for j in recall.scored[c]]
        assert tokenizer.decode(targets).replace(" ", "") == number and recall.scored[c][-1] == recall.tail - 2
    again = recall_prompts(tokenizer, text, source, 400, 3, seed=5)
    assert torch.equal(again.chunks, recall.chunks)
    assert not torch.equal(recall_prompts(tokenizer, text, source, 400, 3, seed=6).chunks, recall.chunks)
    with pytest.raises(KVConvertError, match="has 1[0-9]* tokens; --recall-context 5000"):
        recall_prompts(tokenizer, text[:5000], "short.txt", 5000, 1, seed=0)


def test_recall_sensitivity_is_the_answer_kl_of_one_store_read_through_the_cache(tiny_model_dir):
    """Reference: the whole model prefilled on each prompt but its tail with transformers' own cache, every
    layer's cached keys and values replaced by what its store holds (the probed one at its width, the others at
    the floor, layer 1 of width 0 exact), then the tail forwarded through that cache; KL at the scored positions."""
    from transformers import DynamicCache

    src = tiny_model_dir("llama_gqa")
    chunks = torch.randint(3, 90, (2, 80), generator=torch.Generator().manual_seed(7))
    recall = RecallSet(chunks, tail=5, scored=[[2, 3], [1, 2, 3]], source="random")
    storage = QuantSpec(16, group=16, residual=0, sink=2)
    got = recall_sensitivity(open_source(str(src)), recall, [32, 0, 32], [8, 3, 2], storage, floor=3,
                             progress=False)  # fmt: skip
    assert got[1] == [{8: 0.0, 3: 0.0, 2: 0.0}, {8: 0.0, 3: 0.0, 2: 0.0}]  # width 0: not probed
    whole = load_reference(src)

    def kl_of(probed: int, keys: bool, bits: int) -> float:
        def spec(layer: int, side_is_keys: bool) -> QuantSpec:
            width = bits if (layer, side_is_keys) == (probed, keys) else 3
            return QuantSpec(width, group=16, residual=0, sink=2)

        total = 0.0
        with torch.no_grad():
            for c, row in enumerate(chunks):
                exact = torch.log_softmax(whole(row[None], use_cache=False).logits[0, -5:][recall.scored[c]], -1)
                cache = DynamicCache(config=whole.config)
                whole(row[None, :-5], past_key_values=cache, use_cache=True)
                for layer in (0, 2):
                    held = cache.layers[layer]
                    held.keys = stored_after_prefill(held.keys, spec(layer, True), per_channel=True)
                    held.values = stored_after_prefill(held.values, spec(layer, False), per_channel=False)
                probe = whole(row[None, -5:], past_key_values=cache, use_cache=True).logits[0][recall.scored[c]]
                total += float((exact.exp() * (exact - torch.log_softmax(probe, -1))).sum())
        return total / 5

    for layer, side in ((0, 0), (2, 1)):
        for bits in (3, 2):
            expected = kl_of(layer, side == 0, bits) - kl_of(layer, side == 0, 8)
            assert abs(expected) > 1e-5 and got[layer][side][bits] == pytest.approx(expected, rel=1e-3, abs=1e-7)
        assert got[layer][side][8] == 0.0


def test_floor_is_the_widest_uniform_width_within_the_budget():
    storage = QuantSpec(16, group=64, residual=0)
    widths, choices = [192] * 4, [8, 4, 3, 2]
    # of a 16-bit cache, groups of 64 (codes, fp16 scale, zero): 8 bits 0.531, 4 bits 0.281, 3 0.219, 2 0.156
    assert floor_width(widths, choices, 0.6, storage, 64) == 8
    assert floor_width(widths, choices, 0.3, storage, 64) == 4
    assert floor_width(widths, choices, 0.25, storage, 64) == 3
    assert floor_width(widths, choices, 0.2, storage, 64) == 2
    assert floor_width(widths, choices, 0.01, storage, 64) == 2  # none fits: the narrowest


@pytest.mark.slow
def test_quant_budget_weighs_recall_and_says_so(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    args = ("--kv-budget", "0.45", "--min-bits", "2", "--max-bits", "8", "--calib-tokens", "512", "--kv-group", "8",
            "--kv-residual", "0")  # fmt: skip
    report = convert("quant", src, tmp_path / "q", *args, "--recall-context", "256", "--recall-prompts", "2")
    recall = report["plan"]["recall"]
    assert recall["context"] == 256 and recall["prompts"] == 2 and len(recall["sensitivity"]) == 3
    assert all(side["8"] == 0.0 for layer in recall["sensitivity"] for side in layer)
    assert report["plan"]["kv_budget"] <= 0.45
    recipe = (tmp_path / "q" / "recipe.yaml").read_text()
    assert "recall_context: 256" in recipe
    for extra, message in ((("--recall-context", "4096"), "exceeds the model's context of"),
                           (("--recall-context", "-1"), "recall_context must be >= 0")):  # fmt: skip
        bad = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "x"), *args, *extra)
        assert bad.exit_code == 2 and message in bad.output and not (tmp_path / "x").exists(), bad.output
    alone = run_cli("quant", "--model", str(src), "--out", str(tmp_path / "x"), "--kv-bits", "4",
                    "--recall-context", "192")  # fmt: skip
    assert alone.exit_code == 2 and "give --kv-budget too" in alone.output
    assert json.loads((tmp_path / "q" / "kvconvert.json").read_text())["plan"] == report["plan"]
