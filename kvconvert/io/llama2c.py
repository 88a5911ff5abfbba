"""Import Karpathy's llama2.c "v0" checkpoints (and tok*.bin vocabularies) as HF Llama directories.

Format (all little-endian): 7 int32 header (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len; a negative vocab_size means an untied classifier follows), then float32
tensors in a fixed order, row-major ``[out, in]``. llama2.c rotates interleaved pairs
(2i, 2i+1); transformers' Llama rotates halves, so W_Q and W_K rows are permuted on import.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import torch

from kvconvert.errors import KVConvertError
from kvconvert.io.outdir import atomic_output_dir
from kvconvert.io.writer import ShardedSafetensorsWriter


def interleaved_to_half_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute rows ``[n_heads·hd, d]`` so rotate-half RoPE equals llama2.c's pairwise RoPE."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def read_llama2c(path: Path) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Return (header, HF-named float32 tensors) of a llama2.c v0 checkpoint."""
    raw = path.read_bytes()
    if len(raw) < 28:
        raise KVConvertError(f"{path} is too small to be a llama2.c checkpoint")
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    # garbage makes any of these negative or zero, or heads that do not divide the width
    if min(dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len) < 1 or dim % n_heads or n_heads % n_kv:
        raise KVConvertError(
            f"{path} is not a llama2.c v0 checkpoint: its header reads {dim=}, {hidden=}, {n_layers=}, {n_heads=}, "
            f"{n_kv=}, {vocab=}, {seq_len=}"
        )
    head_dim = dim // n_heads
    floats = np.frombuffer(raw, dtype="<f4", offset=28)
    shapes = [
        ("embed", (vocab, dim)),
        ("rms_att", (n_layers, dim)),
        ("wq", (n_layers, dim, dim)),
        ("wk", (n_layers, n_kv * head_dim, dim)),
        ("wv", (n_layers, n_kv * head_dim, dim)),
        ("wo", (n_layers, dim, dim)),
        ("rms_ffn", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis", (seq_len, head_dim)),  # real and imaginary halves; unused (recomputed)
    ]
    if not shared:
        shapes.append(("classifier", (vocab, dim)))
    expected = sum(int(np.prod(s)) for _, s in shapes)
    if floats.size != expected:
        raise KVConvertError(
            f"{path}: expected {expected} float32 values for header {dim=}, {n_layers=}, {n_heads=}, got {floats.size}"
        )
    parts, offset = {}, 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        parts[name] = torch.from_numpy(floats[offset : offset + size].copy()).view(shape)
        offset += size

    tensors = {"model.embed_tokens.weight": parts["embed"], "model.norm.weight": parts["rms_final"]}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = parts["rms_att"][i]
        tensors[p + "self_attn.q_proj.weight"] = interleaved_to_half_rotary(parts["wq"][i], n_heads)
        tensors[p + "self_attn.k_proj.weight"] = interleaved_to_half_rotary(parts["wk"][i], n_kv)
        tensors[p + "self_attn.v_proj.weight"] = parts["wv"][i]
        tensors[p + "self_attn.o_proj.weight"] = parts["wo"][i]
        tensors[p + "post_attention_layernorm.weight"] = parts["rms_ffn"][i]
        tensors[p + "mlp.gate_proj.weight"] = parts["w1"][i]
        tensors[p + "mlp.down_proj.weight"] = parts["w2"][i]
        tensors[p + "mlp.up_proj.weight"] = parts["w3"][i]
    if not shared:
        tensors["lm_head.weight"] = parts["classifier"]
    header = dict(
        dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab,
        seq_len=seq_len, shared_classifier=int(shared),
    )  # fmt: skip
    return header, {k: v.contiguous() for k, v in tensors.items()}


def read_vocab(path: Path, size: int | None = None) -> tuple[list[str], list[float]]:
    """Pieces and scores of a llama2.c tokenizer file (llama2.c stores '▁' as a plain space); with
    ``size``, the file must hold exactly that many pieces (the model's vocabulary)."""
    raw = path.read_bytes()
    offset, pieces, scores = 4, list[str](), list[float]()
    while offset < len(raw):
        if offset + 8 > len(raw):
            raise KVConvertError(f"{path} is not a llama2.c tokenizer file: it ends inside piece {len(pieces)}")
        score, length = struct.unpack_from("<fi", raw, offset)
        offset += 8
        if length < 0 or offset + length > len(raw) or not math.isfinite(score):
            raise KVConvertError(f"{path} is not a llama2.c tokenizer file: piece {len(pieces)} is malformed")
        pieces.append(raw[offset : offset + length].decode("utf-8", errors="replace"))
        scores.append(score)
        offset += length
    if size is not None and len(pieces) != size:
        raise KVConvertError(
            f"{path} holds {len(pieces)} tokenizer pieces but the model has a vocabulary of {size}; is it the "
            "model's own tok*.bin?"
        )
    return pieces, scores


def build_tokenizer(path: Path, size: int | None = None):  # -> PreTrainedTokenizerFast
    """A sentencepiece-style byte-fallback BPE tokenizer equivalent to llama2.c's encoder.

    Merges are recovered from the vocabulary the way sentencepiece BPE ranks them: a piece is
    the merge of two shorter pieces, ranked by the merged piece's score.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces, scores = read_vocab(path, size)
    names = []
    for i, piece in enumerate(pieces):
        if i == 1:
            names.append("<s>")
        elif i == 2:
            names.append("</s>")
        else:
            names.append(piece.replace(" ", "\u2581"))
    vocab = {name: i for i, name in enumerate(names)}
    merges = []
    for i, name in enumerate(names):
        if i < 3 or name.startswith("<0x") or len(name) < 2:
            continue
        for cut in range(1, len(name)):
            left, right = name[:cut], name[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], i, vocab[left], vocab[right], left, right))
    merges.sort()
    bpe = models.BPE(
        vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token="<unk>", byte_fallback=True, fuse_unk=True
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )


def import_llama2c(checkpoint: Path, out: Path, tokenizer: Path | None = None, replace: bool = False) -> Path:
    """Write ``out`` as an HF Llama directory (config.json, model.safetensors, tokenizer files)."""
    from transformers import LlamaConfig

    header, tensors = read_llama2c(checkpoint)
    built = None if tokenizer is None else build_tokenizer(tokenizer, header["vocab_size"])  # checked before writing
    config = LlamaConfig(
        vocab_size=header["vocab_size"],
        hidden_size=header["dim"],
        intermediate_size=header["hidden_dim"],
        num_hidden_layers=header["n_layers"],
        num_attention_heads=header["n_heads"],
        num_key_value_heads=header["n_kv_heads"],
        max_position_embeddings=header["seq_len"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=bool(header["shared_classifier"]),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        dtype="float32",
    )
    with atomic_output_dir(
        out, replace, sources=[checkpoint, *([tokenizer] if tokenizer else [])], command="import-llama2c"
    ) as tmp:
        config.save_pretrained(tmp)
        writer = ShardedSafetensorsWriter(tmp)
        for name in sorted(tensors):
            writer.add(name, tensors[name])
        writer.close()
        if built is not None:
            built.save_pretrained(tmp)
    return out
