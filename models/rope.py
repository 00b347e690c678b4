"""Rotary position embeddings with the scalings found in configs: default, linear, llama3, yarn
(DeepSeek-V3: its frequency blend and the "attention factor" that scales cos/sin).

The cos/sin table is computed once for every position up to the model's context and indexed by
position at run time, so a step with mixed prefill chunks and decodes needs one gather.
"""

from __future__ import annotations

import math

import torch

from pdkv.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Returns inv_freq: shape [head_dim // 2], float32, as transformers computes it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    if rope_type == "yarn":
        return _yarn_inv_frequencies(head_dim, theta, scaling)
    raise ModelLoadError(f"config.json: rope type '{rope_type}' is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(scaling: dict) -> float:
    if "factor" not in scaling or "original_max_position_embeddings" not in scaling:
        raise ModelLoadError("config.json: rope_scaling of type 'yarn' needs 'factor' and "
                             "'original_max_position_embeddings'")
    return float(scaling["factor"])


def _yarn_inv_frequencies(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers' _compute_yarn_parameters: high frequencies kept,
    low ones divided by ``factor``, a linear ramp between the beta_fast / beta_slow rotations."""
    factor = _yarn_factor(scaling)
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(scaling: dict) -> float:
    """What YaRN multiplies cos and sin by (1 for the other types): ``attention_factor`` if the
    config gives it, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    set (DeepSeek), else mscale(factor)."""
    if scaling.get("rope_type", "default") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all))
    return yarn_mscale(factor)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin cache over full head_dim: cos = [c, c], sin = [-s, s], each [max_positions, head_dim],
    float32, so that rope(x) = x * cos + swap_halves(x) * sin, three ops per call."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        af = attention_factor(scaling)
        if af != 1.0:
            cos, sin = cos * af, sin * af
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] → (cos, sin) each [T, 1, head_dim], broadcast over heads."""
        return (self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (rotate-half convention, as Hugging Face Llama); cos/sin: [T, 1, D] from
    RotaryEmbedding.table. Equals [x1 * c - x2 * s, x2 * c + x1 * s] for x = [x1, x2]."""
    # roll by half swaps the halves, [x2, x1]: one call where reshape/flip/reshape were three
    # (a decode step runs two ropes per layer).
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
