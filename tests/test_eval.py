"""The measuring instrument: each number against an independent computation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

from kvconvert.eval.memory import cache_nbytes, kv_bytes_per_token
from kvconvert.eval.quality import evaluate_quality, windows
from kvconvert.eval.retrieval import copy_accuracy
from tests.conftest import build_tiny_model
from tests.helpers import convert_slim, run_cli

DESIGN_KEYS = {
    "ppl", "reference_ppl", "kl_mean", "top1_agreement", "kv_bytes_per_token", "reference_kv_bytes_per_token",
    "kv_budget_measured", "tokens", "ctx", "seconds",
}  # fmt: skip


@torch.no_grad()
def test_perplexity_and_kl_match_hand_computation():
    model, other = build_tiny_model("llama", seed=0), build_tiny_model("llama", seed=1)
    ids = torch.randint(3, 90, (50,), generator=torch.Generator().manual_seed(0))
    ctx = 16
    nll = kl = 0.0
    agree = count = 0
    for i in range(0, 50, ctx):  # windows 0-15, 16-31, 32-47, 48-49
        w = ids[i : i + ctx]
        p_ref = torch.softmax(other(w[None]).logits[0, :-1].double(), -1)
        p_mod = torch.softmax(model(w[None]).logits[0, :-1].double(), -1)
        for t in range(len(w) - 1):
            nll -= math.log(p_mod[t, w[t + 1]].item())
            kl += sum(p_ref[t, v].item() * math.log(p_ref[t, v].item() / p_mod[t, v].item()) for v in range(97))
            agree += int(p_ref[t].argmax() == p_mod[t].argmax())
            count += 1
    result = evaluate_quality(model, ids, ctx, reference=other)
    assert result.tokens == count == 15 * 3 + 1
    assert result.ppl == pytest.approx(math.exp(nll / count), rel=1e-9)
    assert result.kl_mean == pytest.approx(kl / count, rel=1e-6)
    assert result.top1_agreement == pytest.approx(agree / count)


def test_kl_of_a_model_against_itself_is_zero():
    model = build_tiny_model("gpt2")
    ids = torch.randint(3, 90, (40,))
    result = evaluate_quality(model, ids, 20, reference=model)
    assert result.kl_mean == pytest.approx(0.0, abs=1e-12)
    assert result.top1_agreement == 1.0 and result.ppl == result.reference_ppl


def test_windows_are_non_overlapping_and_drop_single_tokens():
    parts = windows(torch.arange(11), 5)
    assert [p.tolist() for p in parts] == [[list(range(5))], [list(range(5, 10))]]


def test_cache_bytes_of_a_known_cache():
    cache = DynamicCache()
    for layer in range(3):
        cache.update(torch.zeros(2, 4, 10, 8), torch.zeros(2, 4, 10, 8), layer)
    assert cache_nbytes(cache) == 3 * 2 * (2 * 4 * 10 * 8) * 4


def test_kv_bytes_per_token_of_a_stock_model():
    model = build_tiny_model("llama")  # 3 layers, 4 KV heads × 16 dims, float32
    per_token = kv_bytes_per_token(model, torch.randint(3, 90, (2, 32)), 8, 32)
    assert per_token == 3 * 2 * 4 * 16 * 4


def test_copy_accuracy_of_a_perfect_copier():
    class Copier(torch.nn.Module):
        """Predicts the token that followed the previous occurrence of the current token."""

        config = type("C", (), {"vocab_size": 50})()

        def forward(self, ids, use_cache=False):
            seq = ids[0].tolist()
            logits = torch.zeros(1, len(seq), 50)
            for i, tok in enumerate(seq):
                earlier = [j for j in range(i) if seq[j] == tok]
                if earlier and earlier[-1] + 1 < len(seq):
                    logits[0, i, seq[earlier[-1] + 1]] = 1.0
            return type("O", (), {"logits": logits})()

    # random tokens may repeat inside the first copy, so a perfect induction copier can still miss a few
    assert copy_accuracy(Copier(), 20) >= 0.8
    assert copy_accuracy(Copier(), 20) > copy_accuracy(build_tiny_model("llama"), 20)


def _save_word_tokenizer(directory, vocab_size: int = 97) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="</s>").save_pretrained(directory)  # fmt: skip


def test_eval_cli_json_has_design_keys(tmp_path):
    src = tmp_path / "src"
    build_tiny_model("llama").save_pretrained(src)
    _save_word_tokenizer(src)
    convert_slim(src, tmp_path / "slim")
    text = tmp_path / "text.txt"
    gen = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"w{i}" for i in torch.randint(3, 97, (600,), generator=gen).tolist()))
    out = tmp_path / "eval.json"
    result = run_cli(
        "eval", "--model", str(tmp_path / "slim"), "--reference", str(src), "--data", str(text), "--ctx", "128",
        "--retrieval-lengths", "64", "--json", str(out), "--quiet",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data) >= DESIGN_KEYS
    assert data["tokens"] == 600 - 5  # 5 windows of ≤128, each first token is context only
    assert data["ppl"] == pytest.approx(data["reference_ppl"], rel=1e-4)  # slim is exact
    assert data["kv_budget_measured"] == pytest.approx(0.5, abs=0.01)
    assert "perplexity" in result.output and "KL(ref‖model)" in result.output


def test_eval_cli_bad_data_is_a_user_error(tmp_path):
    src = tmp_path / "src"
    build_tiny_model("llama").save_pretrained(src)
    _save_word_tokenizer(src)
    result = run_cli("eval", "--model", str(src), "--data", "no-such-file.txt")
    assert result.exit_code == 2 and "neither a file nor a dataset spec" in result.stderr


def test_chunked_scoring_equals_single_forward_for_full_caches(tiny_model_dir, tmp_path):
    from tests.helpers import load_converted

    model = build_tiny_model("llama_gqa")
    ids = torch.randint(3, 90, (100,), generator=torch.Generator().manual_seed(2))
    whole, chunked = evaluate_quality(model, ids, 64), evaluate_quality(model, ids, 64, chunk=10)
    assert chunked.ppl == pytest.approx(whole.ppl, rel=1e-5) and chunked.tokens == whole.tokens
    convert_slim(tiny_model_dir("llama"), tmp_path / "slim")
    slim = load_converted(tmp_path / "slim")
    assert evaluate_quality(slim, ids, 64, chunk=7).ppl == pytest.approx(evaluate_quality(slim, ids, 64).ppl, rel=1e-5)
