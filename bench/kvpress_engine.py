"""kvpress side of ``make bench-longctx``: runs inside ``bench/.cache/venv-kvpress`` (kvpress 0.5.5, transformers
< 5.3) and imports nothing from kvconvert.

``python kvpress_engine.py JOB.json OUT.json``. The job: ``{"model": DIR, "samples": [{"context": [ids],
"question": [ids], "answers": [str], "new_tokens": N}], "presses": [[name, compression_ratio], ...]}``. Each press
answers every sample the way kvpress's own pipeline does (``KVPressTextGenerationPipeline._forward``): the context
goes through the model in one forward inside the press's context manager (which compresses the cache as it is
filled; on Gemma 3 only its global layers, as kvpress does for the multimodal class: ``gemma3_global_layers_only``),
then the question is read through the compressed cache and the answer generated greedily, stopping at
end of sequence or once every expected string is in it (containment: the score cannot change after that, the
same rule kvconvert's side uses). Writes ``{"answers": {"name@ratio": [str, ...]}, "seconds": {...}, "unsupported":
{"name@ratio": reason}}``: a press that refuses the model (kvpress raises ``ValueError`` as it is applied, e.g.
KVzip on Gemma 3) or fails on it is recorded there and the others still run (ExpectedAttention calls Gemma 3's rotary
embedding without the layer type it needs: ``gemma3_rotary_of_global_layers`` supplies the global layers').
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import kvpress
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES = {
    "StreamingLLM": lambda r: kvpress.StreamingLLMPress(compression_ratio=r),
    "SnapKV": lambda r: kvpress.SnapKVPress(compression_ratio=r),
    "ExpectedAttention": lambda r: kvpress.ExpectedAttentionPress(compression_ratio=r),
    "TOVA": lambda r: kvpress.TOVAPress(compression_ratio=r),
    "KVzip": lambda r: kvpress.KVzipPress(compression_ratio=r),
    "AdaKV + ExpectedAttention": lambda r: kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=r)),
}


@torch.no_grad()
def answer(model, tokenizer, press, sample) -> str:
    context = torch.tensor([sample["context"]])
    question = torch.tensor([sample["question"]])
    cache = DynamicCache(config=model.config)  # as generate builds it: sliding-window layers keep their window
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=context, past_key_values=cache)
    length = context.shape[1]  # positions continue after the whole context, as kvpress's pipeline does
    positions = torch.arange(length, length + question.shape[1])[None]
    logits = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits
    position = length + question.shape[1]
    generated: list[int] = []
    for _ in range(sample["new_tokens"]):
        token = int(logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True).lower()
        if all(a.lower() in text for a in sample["answers"]):
            break
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                       position_ids=torch.tensor([[position]])).logits  # fmt: skip
        position += 1
    return tokenizer.decode(generated, skip_special_tokens=True)


def gemma3_global_layers_only(model) -> None:
    """kvpress compresses only the global layers of a Gemma 3 (``BasePress.__call__``: its sliding-window layers are
    skipped) but checks for the multimodal class alone, so a text-only ``Gemma3ForCausalLM`` got every layer pressed
    (0.5.5; its answers were incoherent text). Its own rule extended to the text-only class: both are "Gemma3"."""
    from kvpress.presses import base_press
    from transformers.models.gemma3 import modeling_gemma3

    if isinstance(model, modeling_gemma3.Gemma3ForCausalLM):
        base_press.Gemma3ForConditionalGeneration = (modeling_gemma3.Gemma3ForConditionalGeneration,
                                                     modeling_gemma3.Gemma3ForCausalLM)  # fmt: skip


def gemma3_rotary_of_global_layers(model) -> None:
    """kvpress 0.5.5's ExpectedAttention (``apply_avg_rope``) calls the model's rotary embedding as Llama's takes it,
    ``rotary_emb(x, position_ids)``, but Gemma 3's has one table per layer type and needs the type (without it:
    ``AttributeError: ... 'None_inv_freq'``). The layers it presses on Gemma 3 are the global ones
    (``gemma3_global_layers_only``), so a call without a type gets theirs; the model's own calls name their type."""
    from transformers.models.gemma3 import modeling_gemma3

    if not isinstance(model, modeling_gemma3.Gemma3ForCausalLM):
        return
    rotary = model.model.rotary_emb
    forward = rotary.forward

    def with_global_default(x, position_ids, layer_type=None):
        return forward(x, position_ids, layer_type or "full_attention")

    rotary.forward = with_global_default


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    gemma3_global_layers_only(model)
    gemma3_rotary_of_global_layers(model)
    answers, seconds, unsupported = {}, {}, {}
    for name, ratio in job["presses"]:
        press = None if name == "none" else PRESSES[name](ratio)
        started = time.perf_counter()
        key = f"{name}@{ratio}"
        try:
            answers[key] = [answer(model, tokenizer, press, s) for s in job["samples"]]
        except Exception as error:  # the press refuses this model or breaks on it: say so, run the others
            unsupported[key] = f"{type(error).__name__}: {error}"
            print(f"{key}: {error}", file=sys.stderr, flush=True)
            continue
        seconds[key] = time.perf_counter() - started
        print(f"{key}: {seconds[key]:.0f} s", file=sys.stderr, flush=True)
    Path(sys.argv[2]).write_text(json.dumps({"answers": answers, "seconds": seconds, "unsupported": unsupported,
                                             "transformers": __import__("transformers").__version__}))  # fmt: skip


if __name__ == "__main__":
    main()
