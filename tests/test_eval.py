"""The measuring instrument: each number against an independent computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvconvert.eval.memory import cache_nbytes, kv_bytes_per_token
from kvconvert.eval.quality import evaluate_quality, windows
from kvconvert.eval.retrieval import copy_accuracy
from tests.conftest import build_tiny_model
from tests.helpers import convert_slim, run_cli

CALIB_TEXT = Path(__file__).resolve().parents[1] / "kvconvert" / "calib_data" / "01_lighthouses.txt"

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


class Copier(torch.nn.Module):
    """Predicts the token that followed the previous occurrence of the current token; its "cache" is
    the list of ids seen, of which a forgetful copier keeps only the last ``keep``."""

    config = type("C", (), {"vocab_size": 50})()

    def __init__(self, keep: int | None = None):
        super().__init__()
        self.keep = keep

    def forward(self, ids, use_cache=False, past_key_values=None):
        past = list(past_key_values or [])
        seq = past + ids[0].tolist()
        logits = torch.zeros(1, ids.shape[1], 50)
        for i in range(len(past), len(seq)):
            earlier = [j for j in range(i) if seq[j] == seq[i]]
            if earlier and earlier[-1] + 1 < len(seq):
                logits[0, i - len(past), seq[earlier[-1] + 1]] = 1.0
        kept = seq if self.keep is None else seq[-self.keep :]
        return type("O", (), {"logits": logits, "past_key_values": kept if use_cache else None})()


def test_copy_accuracy_of_a_perfect_copier_through_its_cache():
    vocab = torch.arange(3, 50)
    # random tokens may repeat inside the first copy, so a perfect induction copier can still miss a few
    assert copy_accuracy(Copier(), 20, vocab) >= 0.8
    assert copy_accuracy(Copier(), 20, vocab) > copy_accuracy(build_tiny_model("llama"), 20, vocab)
    # the second copy is read through the cache: a cache that dropped the first copy cannot copy
    assert copy_accuracy(Copier(keep=2), 20, vocab) < 0.2


def test_random_tokens_come_from_the_ordinary_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    from kvconvert.eval.retrieval import ordinary_token_ids

    _save_word_tokenizer(tmp_path, vocab_size=97)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = ordinary_token_ids(tokenizer, vocab_size=128)  # rows 97..127: untrained padding rows
    assert ids.min() == 3 and ids.max() == 96 and ids.numel() == 94
    # GPT-2's layout: the last id is special; the old range (max special, vocab) was empty
    assert ordinary_token_ids(tokenizer, vocab_size=97).max() == 96


def test_log_probs_in_row_chunks_equal_the_whole(monkeypatch):
    from kvconvert.eval import quality

    model, reference = build_tiny_model("llama"), build_tiny_model("llama", seed=1)
    ids = torch.randint(3, 90, (150,), generator=torch.Generator().manual_seed(4))
    whole = evaluate_quality(model, ids, 64, reference)
    monkeypatch.setattr(quality, "ROWS", 7)
    rows = evaluate_quality(model, ids, 64, reference)
    assert rows.ppl == pytest.approx(whole.ppl, rel=1e-12) and rows.kl_mean == pytest.approx(whole.kl_mean, rel=1e-9)
    assert rows.top1_agreement == whole.top1_agreement


def test_context_protocol_scores_the_continuation_through_the_cache():
    """A stock model: the continuation read through the cache equals one forward (nothing is lost);
    only the continuation's tokens are scored."""
    model = build_tiny_model("llama_gqa")
    ids = torch.randint(3, 90, (2 * 48,), generator=torch.Generator().manual_seed(3))
    result = evaluate_quality(model, ids, 48, model, context=32)
    assert result.tokens == 2 * 16 and result.kl_mean == pytest.approx(0, abs=1e-9)
    whole = model(ids[None, :47]).logits[0, 31:]
    logp = torch.log_softmax(whole.double(), -1).gather(-1, ids[32:48, None])
    first = torch.log_softmax(model(ids[None, 48:95]).logits[0, 31:].double(), -1).gather(-1, ids[80:96, None])
    assert result.ppl == pytest.approx(torch.exp(-(logp.sum() + first.sum()) / 32).item(), rel=1e-6)


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
    # slim's cache in a 16-bit deployment is also half a 16-bit stock cache (measured on bf16 copies)
    assert data["kv_budget_vs_16bit"] == pytest.approx(0.5, abs=0.01)
    assert "perplexity" in result.output and "KL(ref‖model)" in result.output


def _source_and_4bit(tmp_path):
    """A tiny GQA Llama with a word tokenizer at ``tmp_path/src`` and its 4-bit quant conversion at
    ``tmp_path/q`` (groups of 16, residual 0); returns the source directory."""
    src = tmp_path / "src"
    build_tiny_model("llama_gqa").save_pretrained(src)
    _save_word_tokenizer(src)
    assert run_cli("quant", "--model", str(src), "--out", str(tmp_path / "q"), "--kv-bits", "4", "--kv-residual",
                   "0", "--kv-group", "16", "--quiet").exit_code == 0  # fmt: skip
    return src


def test_eval_context_protocol_and_16bit_budget(tmp_path):
    src = _source_and_4bit(tmp_path)
    text = tmp_path / "text.txt"
    gen = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"w{i}" for i in torch.randint(3, 97, (400,), generator=gen).tolist()))
    out = tmp_path / "eval.json"
    result = run_cli("eval", "--model", str(tmp_path / "q"), "--reference", str(src), "--data", str(text),
                     "--context", "64", "--continuation", "32", "--no-retrieval", "--no-speed", "--json", str(out),
                     "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["tokens"] == 4 * 32 and data["ctx"] == 96 and data["kv_measured_after"] == 64
    # 4-bit codes + fp16 scale/zero per 16 values, against a 16-bit cache (the reference runs in fp32)
    assert data["kv_budget_vs_16bit"] == pytest.approx((0.5 + 4 / 16) / 2, rel=1e-6)
    assert data["kv_budget_measured"] == pytest.approx(data["kv_budget_vs_16bit"] / 2, rel=1e-6)
    assert data["ppl"] != data["reference_ppl"]
    bad = run_cli("eval", "--model", str(tmp_path / "q"), "--data", str(text), "--context", "64")
    assert bad.exit_code == 2 and "--context and --continuation go together" in bad.stderr


def test_eval_warns_when_the_cache_kept_everything(tokenized_model_dir, tmp_path):
    src = tokenized_model_dir("llama_gqa")
    assert run_cli("razor", "--model", str(src), "--out", str(tmp_path / "r"), "--profile-tokens", "16",
                   "--window", "200", "--quiet").exit_code == 0  # fmt: skip
    text = tmp_path / "text.txt"
    text.write_text((CALIB_TEXT.read_text() + " ") * 2)
    result = run_cli("eval", "--model", str(tmp_path / "r"), "--reference", str(src), "--data", str(text),
                     "--ctx", "128", "--max-tokens", "256", "--no-retrieval", "--no-speed", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "warning: the cache kept every token" in result.output and "newest 200 tokens" in result.output


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


def test_eval_speed_contexts_side_by_side(tmp_path):
    """``--speed-contexts``: decode tokens/s of model and reference after each context, measured in one
    process, with the caches' bytes (the quantized cache holds fewer)."""
    src = _source_and_4bit(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in range(3, 97)) * 3)
    out = tmp_path / "eval.json"
    result = run_cli("eval", "--model", str(tmp_path / "q"), "--reference", str(src), "--data", str(text),
                     "--ctx", "64", "--no-retrieval", "--speed-contexts", "48,96", "--json", str(out),
                     "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["speed_at"]
    assert [r["context"] for r in rows] == [48, 96]
    for row in rows:
        assert row["decode_tokens_per_s"] > 0 and row["reference_decode_tokens_per_s"] > 0
        assert row["decode_speed_ratio"] == pytest.approx(
            row["decode_tokens_per_s"] / row["reference_decode_tokens_per_s"]
        )
        assert row["cache_bytes"] < row["reference_cache_bytes"]
    assert "decode tok/s @96" in result.output
    bad = run_cli("eval", "--model", str(src), "--data", str(text), "--speed-contexts", "4k")
    assert bad.exit_code == 2 and "--speed-contexts must be comma-separated integers" in bad.stderr


def test_eval_device_is_checked_before_anything_loads(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("w3 w4 w5")
    bad = run_cli("eval", "--model", str(tmp_path / "missing"), "--data", str(text), "--device", "tpu")
    assert bad.exit_code == 2 and "--device must be cpu, cuda, cuda:N or auto, got 'tpu'" in bad.stderr
    if not torch.cuda.is_available():
        bad = run_cli("eval", "--model", str(tmp_path / "missing"), "--data", str(text), "--device", "cuda:0")
        assert bad.exit_code == 2 and "--device cuda:0: this torch sees no CUDA GPU" in bad.stderr


def test_eval_runs_every_forward_on_the_requested_device(tmp_path, monkeypatch):
    """Every forward of both models (quality, KV bytes, both 16-bit copies, speed, passkey, copy) gets
    its inputs on the device asked for, with the model's weights there: no silent CPU fall-back. With
    ``auto`` this is a real move on a machine with a GPU; on a CPU-only one it checks the plumbing."""
    import kvconvert.eval.runner as runner
    from kvconvert.devices import resolve_device

    src = _source_and_4bit(tmp_path)
    want = resolve_device("auto")
    seen: list[tuple[str, set[torch.device]]] = []
    load = runner.load_model

    def watched(path, dtype=None, device=None):
        model = load(path, dtype=dtype, device=device)

        def hook(module, args, kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            seen.append((path, {t.device for t in tensors} | {p.device for p in module.parameters()}))

        model.register_forward_pre_hook(hook, with_kwargs=True)
        return model

    monkeypatch.setattr(runner, "load_model", watched)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in range(3, 97)) * 3)
    out = tmp_path / "eval.json"
    result = run_cli("eval", "--model", str(tmp_path / "q"), "--reference", str(src), "--data", str(text),
                     "--ctx", "64", "--retrieval-lengths", "48", "--speed-contexts", "48", "--device", "auto",
                     "--json", str(out), "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["device"] == str(want)
    paths = {path for path, _ in seen}
    assert paths == {str(tmp_path / "q"), str(src)}  # both models, the bf16 copy included, ran
    assert all(devices == {want} for _, devices in seen), {d for _, ds in seen for d in ds}


def test_chunked_context_prefill_equals_one_forward_and_records_costs(tiny_model_dir, tmp_path):
    """``--context`` with ``--chunk``: the context goes into the cache ``chunk`` tokens at a time (a long
    prompt's chunked prefill); for exact caches the scores are the one-forward protocol's. Prefill seconds and
    peak memory are recorded per model, the reference's only when it went through its cache the same way."""
    from tests.helpers import load_converted

    model = build_tiny_model("llama_gqa")
    ids = torch.randint(3, 90, (2 * 48,), generator=torch.Generator().manual_seed(3))
    whole = evaluate_quality(model, ids, 48, model, context=32)
    chunked = evaluate_quality(model, ids, 48, model, context=32, chunk=10)
    assert chunked.ppl == pytest.approx(whole.ppl, rel=1e-6) and chunked.kl_mean == pytest.approx(0, abs=1e-9)
    assert set(whole.costs) == {"model"} and set(chunked.costs) == {"model", "reference"}
    for costs in chunked.costs.values():
        assert costs.windows == 2 and costs.prefill_tokens == 64 and costs.prefill_seconds > 0
    convert_slim(tiny_model_dir("llama"), tmp_path / "slim")
    slim = load_converted(tmp_path / "slim")
    one = evaluate_quality(slim, ids, 48, context=32).ppl
    assert evaluate_quality(slim, ids, 48, context=32, chunk=7).ppl == pytest.approx(one, rel=1e-5)


def test_peak_memory_counts_what_the_block_allocates():
    from kvconvert.eval.memory import PeakMemory

    with PeakMemory("cpu") as idle:
        pass
    if idle.bytes is None:
        pytest.skip("no resident-set high-water mark on this platform")
    with PeakMemory("cpu") as busy:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written: resident
        del block
    assert busy.bytes is not None and 60 * 2**20 <= busy.bytes <= 80 * 2**20
    assert idle.bytes < 8 * 2**20


def test_eval_long_document_reports_prefill_and_peak_memory(tmp_path):
    src = _source_and_4bit(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in torch.randint(3, 97, (400,), generator=torch.Generator()).tolist()))
    out = tmp_path / "eval.json"
    result = run_cli("eval", "--model", str(tmp_path / "q"), "--reference", str(src), "--data", str(text),
                     "--context", "128", "--continuation", "32", "--chunk", "48", "--no-retrieval", "--no-speed",
                     "--json", str(out), "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["tokens"] == 2 * 32 and "48 tokens per prefill forward" in data["window"]
    for prefix in ("", "reference_"):
        assert data[f"{prefix}prefill_seconds_per_window"] > 0 and data[f"{prefix}prefill_tokens_per_s"] > 0
        assert data[f"{prefix}peak_memory_bytes"] is None or data[f"{prefix}peak_memory_bytes"] >= 0
    assert "context prefill s" in result.output and "peak memory MB" in result.output
