"""Rotary position embedding: frequencies (default, linear, llama3, yarn), the cos / signed-sin
tables, and their application to query and key heads."""

from __future__ import annotations

import math

import torch
from torch import nn

from baton.models.model_config import RopeConfig
from baton.ops import rotary_


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rope, dim)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """What a yarn rope scales cos and sin by (1 for the other types)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's frequencies: interpolated below the beta_slow rotations, extrapolated above beta_fast
    (over the original context), a linear ramp between (transformers' _compute_yarn_parameters)."""
    base, old_len = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class Rotary(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        # A plain float32 attribute, not a buffer: built on the CPU even under a meta-device
        # context, and left alone by dtype casts (transformers also keeps it in float32).
        self.inv_freq = rope_inv_freq(rope, head_dim)
        self.attention_factor = rope_attention_factor(rope)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a signed sin, [tokens, head_dim]: the sign of rotate_half is folded into sin."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin[:, :half].neg_()
        cos = emb.cos()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] * cos + rotate_half(x) * sin, cos and sin [T, D], with rotate_half(x) * sin =
    cat(x2, x1) * cat(-sin1, sin2); in place where x is float32."""
    if x.dtype == torch.float32:
        rotary_(x, cos, signed_sin)
        return x
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin[:, None]
