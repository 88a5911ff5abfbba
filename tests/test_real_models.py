"""Real llama2.c models from ../shared (skipped cleanly when ../shared is absent)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import SHARED
from tests.helpers import assert_equivalent, convert_slim, kv_budget, load_converted, load_reference, run_cli

pytestmark = pytest.mark.slow  # real models from ../shared


def test_aidreams_slim_is_equivalent(aidreams_dir, tmp_path):
    from transformers import AutoTokenizer

    dst = tmp_path / "slim"
    convert_slim(aidreams_dir, dst)
    reference, converted = load_reference(aidreams_dir), load_converted(dst)
    tokenizer = AutoTokenizer.from_pretrained(aidreams_dir)
    batch = tokenizer(
        ["I dreamed of a quiet network", "In the dream, whispers of data drift across"],
        return_tensors="pt", padding=True, padding_side="left",
    )  # fmt: skip
    out = assert_equivalent(reference, converted, batch.input_ids, batch.attention_mask)
    assert all(layer.values is None for layer in out.past_key_values.layers)
    assert kv_budget(reference, converted, torch.randint(3, 500, (2, 96))) == pytest.approx(0.5, abs=0.01)

    report = json.loads((dst / "kvconvert.json").read_text())
    kappas = [round(r["kappa_k"], 1) for r in report["layers"]]
    print(f"aidreams260K κ(W_K) per layer: {kappas}")
    assert len(kappas) == 4 and all(k > 1 for k in kappas)


def test_stories260k_is_gqa_and_refused(tmp_path):
    checkpoint = SHARED / "models" / "stories260K" / "stories260K.bin"
    if not checkpoint.exists():
        pytest.skip("../shared/models/stories260K is not present")
    src = tmp_path / "stories"
    assert run_cli("import-llama2c", str(checkpoint), "--out", str(src)).exit_code == 0
    result = run_cli("slim", "--model", str(src), "--out", str(tmp_path / "slim"))
    assert result.exit_code == 2 and "GQA" in result.stderr


@torch.no_grad()
def test_llama2c_import_reproduces_reported_perplexity(tmp_path):
    """SOURCES.md reports ppl ≈ 3.9–4.1 for stories260K on TinyStories validation; a wrong RoPE
    permutation or tokenizer gives hundreds."""
    checkpoint = SHARED / "models" / "stories260K" / "stories260K.bin"
    text_file = SHARED / "data" / "tinystories" / "tinystories_validation_head.txt"
    if not checkpoint.exists() or not text_file.exists():
        pytest.skip("../shared models/data are not present")
    from transformers import AutoTokenizer, LlamaForCausalLM

    src = tmp_path / "stories"
    run_cli("import-llama2c", str(checkpoint), "--tokenizer", str(checkpoint.parent / "tok512.bin"), "--out", str(src))
    model, tokenizer = LlamaForCausalLM.from_pretrained(src).eval(), AutoTokenizer.from_pretrained(src)
    stories = text_file.read_text().split("\n\n")[:40]
    nll, count = 0.0, 0
    for story in stories:
        ids = tokenizer(story.strip(), return_tensors="pt").input_ids[:, :256]
        loss = model(ids, labels=ids).loss
        nll += loss.item() * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    ppl = math.exp(nll / count)
    print(f"stories260K TinyStories-val ppl over {count} tokens: {ppl:.2f}")
    assert ppl < 6.0


@torch.no_grad()
def test_aidreams_minicache_generates_with_a_smaller_cache(aidreams_dir, tmp_path):
    """The paper's default plan on a real MHA model: loads, generates (left-padded batch), holds
    fewer bytes per token, and at γ = 1 (nothing merged in effect) decodes exactly like the source."""
    from transformers import AutoTokenizer

    from kvconvert.eval.quality import evaluate_quality

    result = run_cli("minicache", "--model", str(aidreams_dir), "--out", str(tmp_path / "mc"), "--calib",
                     "--calib-tokens", "2048", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "mc" / "kvconvert.json").read_text())["plan"]
    assert plan["pairs"] == [[2, 3]] and len(plan["layer_similarity"]["pairs"]) == 3
    reference, converted = load_reference(aidreams_dir), load_converted(tmp_path / "mc")
    tokenizer = AutoTokenizer.from_pretrained(aidreams_dir)
    batch = tokenizer(["I dreamed of a quiet network", "In the dream, whispers of data drift"], return_tensors="pt",
                      padding=True, padding_side="left")  # fmt: skip
    out = converted.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out.shape[1] == batch.input_ids.shape[1] + 12
    budget = kv_budget(reference, converted, torch.randint(3, 500, (2, 96)))
    assert 0.75 < budget < 0.85  # one of four layers' K and V gone, plus norms and retained tokens

    assert run_cli("minicache", "--model", str(aidreams_dir), "--out", str(tmp_path / "exact"), "--gamma", "1",
                   "--quiet").exit_code == 0  # fmt: skip
    ids = torch.tensor(tokenizer((SHARED / "data" / "tinystories" / "tinystories_validation_head.txt").read_text()
                                 [:3000]).input_ids[:200])  # fmt: skip
    exact = evaluate_quality(load_converted(tmp_path / "exact"), ids, 128, reference, chunk=1)
    assert exact.kl_mean < 1e-9 and exact.top1_agreement == 1.0
    merged = evaluate_quality(converted, ids, 128, reference, chunk=1)
    assert math.isfinite(merged.ppl) and merged.kl_mean > exact.kl_mean
