"""Import a llama-architecture GGUF file as a float32 safetensors HF directory.

Dequantisation is transformers' own GGUF loader (it also undoes llama.cpp's Q/K row permutation);
we only drop the quantisation config and save plain weights, so the result loads anywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvconvert.errors import KVConvertError
from kvconvert.io.outdir import atomic_output_dir
from kvconvert.io.writer import ShardedSafetensorsWriter


def import_gguf(gguf_file: Path, out: Path, replace: bool = False) -> Path:
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise KVConvertError("importing GGUF needs the 'gguf' package: pip install 'kvconvert[gguf]'") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_file.parent), gguf_file.name
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:  # not GGUF, an architecture it lacks
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KVConvertError(f"cannot import {gguf_file} with transformers' GGUF loader: {reason}") from None
    config = model.config
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embedding; transformers re-ties on load
    with atomic_output_dir(out, replace, sources=[gguf_file], command="import-gguf") as tmp:
        # save_pretrained refuses GGUF-quantised models even though the weights are already
        # dequantised float32 tensors in memory; write them ourselves.
        config.save_pretrained(tmp)
        writer = ShardedSafetensorsWriter(tmp)
        for name in sorted(state):
            writer.add(name, state[name].to(torch.float32))
        writer.close()
        tokenizer.save_pretrained(tmp)
    return out
