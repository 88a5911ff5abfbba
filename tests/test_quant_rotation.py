"""``quant --kv-rotate`` folds the values' rotation into W_V and W_O (QuaRot's offline form): the model computes what
the source computes (independent reference: transformers' own model of the source), the stores keep values as they
arrive, and the checkpoint decodes as the same storage does when its stores rotate values themselves."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import assert_same_logits, convert, left_padded, load_converted, load_reference
from safetensors.torch import load_file, save_file

from kvconvert.arch import AttentionWeights
from kvconvert.methods.quant.rotation import fold_value_rotation
from kvconvert.runtime.kvconvert_codec import rotation

ROTATED_4BIT = ("--kv-bits", "4", "--kv-residual", "0", "--kv-sink", "4", "--kv-rotate")


@pytest.fixture(scope="module")
def folded(tokenized_model_dir, tmp_path_factory):
    src = tokenized_model_dir("llama_gqa")
    out = tmp_path_factory.mktemp("rotated") / "out"
    report = convert("quant", src, out, *ROTATED_4BIT)
    return src, out, report


def _generate(model):
    ids, mask = left_padded(200)
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2_gqa", "gemma3"])  # plain, q/k/v biases, QK-norm + local layers
@torch.no_grad()
def test_folded_weights_compute_what_the_source_computes(kind, tokenized_model_dir, tmp_path):
    """At storage that quantizes nothing yet (8 bits, every token recent) the converted model's logits are the
    source's; its W_V differs from the source's (the rotation is in it) and the spec says so."""
    src = tokenized_model_dir(kind)
    out = tmp_path / "exact"
    report = convert("quant", src, out, "--kv-bits", "8", "--kv-residual", "1000", "--kv-rotate")
    assert report["kv_storage"]["rotate_in_weights"] and report["plan"]["values_rotated_in_weights"]
    ids = torch.randint(3, 90, (2, 120), generator=torch.Generator().manual_seed(1))
    assert_same_logits(load_reference(src)(ids).logits, load_converted(out)(ids).logits, "folded, exact storage")
    ours, theirs = load_file(out / "model.safetensors"), load_file(src / "model.safetensors")
    v, q = "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(ours[v], theirs[v]) and torch.equal(ours[q], theirs[q])


@torch.no_grad()
def test_folded_checkpoint_decodes_as_stores_that_rotate_themselves(folded, tmp_path):
    """The same checkpoint with the source's W_V / W_O back and the spec's flag removed (what conversions wrote
    before: the stores rotate values in and out): the same tokens on a left-padded batch, logits within tolerance
    (the rotation is computed in another order, so a value on a rounding boundary may take the other code)."""
    src, out, _ = folded
    unfolded = tmp_path / "unfolded"
    shutil.copytree(out, unfolded)
    config = json.loads((unfolded / "config.json").read_text())
    del config["kvconvert"]["kv_quant"]["rotate_in_weights"]
    (unfolded / "config.json").write_text(json.dumps(config))
    tensors, source = load_file(unfolded / "model.safetensors"), load_file(src / "model.safetensors")
    tensors.update({k: source[k] for k in tensors if ".v_proj." in k or ".o_proj." in k})
    save_file(tensors, unfolded / "model.safetensors", metadata={"format": "pt"})
    a, b = _generate(load_converted(out)), _generate(load_converted(unfolded))
    assert torch.equal(a.sequences, b.sequences)
    for step, (x, y) in enumerate(zip(a.logits, b.logits, strict=True)):
        assert_same_logits(y, x, f"step {step}")


def test_fold_is_orthogonal_per_head_and_group():
    """W_O·(W_V x + b) per head is unchanged (each query head reads its KV head's values), for GQA and two groups."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, hidden = 4, 2, 16, 12
    w = AttentionWeights(q_weight=torch.randn(heads * head_dim, hidden, generator=g), k_weight=torch.randn(1, 1),
                         v_weight=torch.randn(kv_heads * head_dim, hidden, generator=g),
                         o_weight=torch.randn(hidden, heads * head_dim, generator=g),
                         v_bias=torch.randn(kv_heads * head_dim, generator=g))  # fmt: skip
    folded = fold_value_rotation(w, heads, kv_heads, head_dim, rotation(8))
    x = torch.randn(hidden, generator=g, dtype=torch.float64)

    def out(weights):
        v = (weights.v_weight.double() @ x + weights.v_bias.double()).view(kv_heads, head_dim)
        per_head = v.repeat_interleave(heads // kv_heads, dim=0).reshape(-1)
        return weights.o_weight.double() @ per_head, v

    (y, v), (y_folded, v_folded) = out(w), out(folded)
    torch.testing.assert_close(y_folded, y)
    torch.testing.assert_close(v_folded.view(kv_heads, 2, 8), v.view(kv_heads, 2, 8) @ rotation(8).double())


def test_a_fused_qkv_model_keeps_rotating_in_the_stores(tokenized_model_dir, tmp_path):
    out = tmp_path / "phi3"
    report = convert("quant", tokenized_model_dir("phi3"), out, *ROTATED_4BIT)
    assert "rotate_in_weights" not in report["kv_storage"] and report["kv_storage"]["rotate"]
    model = load_converted(out)
    model.generate(torch.randint(3, 90, (1, 90)), max_new_tokens=3, do_sample=False, pad_token_id=0)
