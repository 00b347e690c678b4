"""Rope frequencies equal transformers' for every rope type we support."""

from __future__ import annotations

import pytest
import torch

from pdkv.models.rope import RotaryEmbedding, apply_rope, inv_frequencies
from pdkv.errors import ModelLoadError

SCALINGS = [
    {},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
def test_inv_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 500000.0, **scaling}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024, rope_parameters=params)
    if scaling:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    else:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    ours = inv_frequencies(64, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_apply_rope_is_rotate_half():
    rope = RotaryEmbedding(8, 32, 10000.0, {})
    x = torch.randn(5, 3, 8)
    pos = torch.tensor([0, 1, 7, 20, 31])
    cos, sin = rope.table(pos, torch.float32)
    freqs = torch.outer(pos.float(), inv_frequencies(8, 10000.0, {}))
    c, s = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None], torch.cat((freqs.sin(), freqs.sin()), -1)[:, None]
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), -1)
    torch.testing.assert_close(apply_rope(x, cos, sin), x * c + rotate_half * s)


def test_unknown_rope_type_is_named():
    with pytest.raises(ModelLoadError, match="longrope.*default, linear, llama3, yarn"):
        inv_frequencies(64, 10000.0, {"rope_type": "longrope", "factor": 2.0})
