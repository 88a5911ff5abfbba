"""Load a kvconvert output directory the way users do (trust_remote_code) and generate.

Usage: python examples/generate.py DST "prompt"
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvconvert.eval.memory import cache_nbytes


def main() -> None:
    directory, prompt = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "Once upon a time"
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, config=model.config)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=48, do_sample=True, top_k=40, return_dict_in_generate=True)
    cache = out.past_key_values
    print(tokenizer.decode(out.sequences[0], skip_special_tokens=True))
    print(f"[{type(model).__name__}: cache {type(cache).__name__} holds {cache_nbytes(cache)} bytes "
          f"for {out.sequences.shape[1] - 1} tokens]")  # fmt: skip


if __name__ == "__main__":
    main()
