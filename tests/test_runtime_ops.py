"""Runtime building blocks against plain-torch / transformers references."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from kvconvert.runtime.kvconvert_common import additive_mask, apply_rotary


@pytest.mark.parametrize("rotary_dim", [16, 4])  # full and partial (GPT-NeoX style) rotary
def test_apply_rotary_matches_transformers(rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16)
    angles = torch.randn(2, 5, rotary_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    reference = (llama_rope if rotary_dim == 16 else neox_rope)(x, x, cos, sin)[0]
    torch.testing.assert_close(apply_rotary(x, cos, sin), reference)


@pytest.mark.parametrize("head_major", [False, True])
def test_apply_rotary_on_a_token_major_cache(head_major):
    """LoRC and slim rotate their rebuilt keys as ``[b, n, h, dk]`` viewed per head: the same rotation either way,
    laid out per head (contiguous, what a score product reads without copying) when asked."""
    torch.manual_seed(0)
    tokens = torch.randn(2, 7, 3, 16)  # [b, n, h, dk]
    angles = torch.randn(2, 7, 8)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = tokens.transpose(1, 2)
    got = apply_rotary(x, cos, sin, head_major=head_major)
    torch.testing.assert_close(got, llama_rope(x.contiguous(), x.contiguous(), cos, sin)[0])
    assert got.is_contiguous() == head_major


def test_additive_mask_forms_agree():
    causal = additive_mask(None, 3, 5, torch.float32, torch.device("cpu"))
    allowed = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    from_bool = additive_mask(allowed[None, None], 3, 5, torch.float32, torch.device("cpu"))
    assert torch.equal(causal, from_bool)
    assert torch.isfinite(from_bool).all(), "fully masked rows must not produce -inf (NaN after softmax)"
    assert additive_mask(None, 1, 5, torch.float32, torch.device("cpu")) is None
