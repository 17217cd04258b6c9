"""Rotary position embeddings (the rotate-half layout of Llama-family checkpoints) with the common
scaling types: ``default``, ``linear``, ``dynamic`` (NTK), ``llama3`` and ``yarn``.

``rope_parameters`` is transformers' dict (``rope_theta``, ``rope_type``, ``factor``, ...).  A
cos/sin table is precomputed for ``max_positions`` positions; ``apply`` looks rows up by position.
Dynamic NTK recomputes frequencies from the sequence length in transformers; in a KV-cached
engine a position's rotation must not change, so positions within ``max_position_embeddings``
use the unscaled frequencies (identical to transformers there) and the table beyond uses the
frequencies for ``factor * max_position_embeddings`` (vLLM's choice).

Where :func:`runner.kernels.use_fused` says so (CUDA tensors) the rotation runs as one Triton
kernel for q and k (:func:`runner.kernels.fused.rotary_embedding`, same fp32 math); elsewhere
:func:`_rotate` in torch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from runner.kernels import use_fused
from runner.layers.precision import upcast


def inv_freq_and_scaling(params: dict[str, Any], dim: int,
                         max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (``dim // 2``) and the cos/sin scale for a RoPE configuration."""
    base = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    if kind == "default":
        return inv_freq, 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        return inv_freq, 1.0  # see the module docstring
    if kind == "llama3":
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        original = float(params["original_max_position_embeddings"])
        beta_fast = float(params.get("beta_fast") or 32)
        beta_slow = float(params.get("beta_slow") or 1)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = params.get("attention_factor")
        if attention is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp
        pos = base ** exponents
        inv = (1.0 / (factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate
        return inv, float(attention)
    raise ValueError(f"unsupported rope_type {kind!r}")


def dynamic_ntk_inv_freq(params: dict[str, Any], dim: int, max_position_embeddings: int,
                         seq_len: int) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    factor = float(params["factor"])
    seq_len = max(seq_len, max_position_embeddings)
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class RotaryEmbedding(nn.Module):
    """Applies RoPE to the first ``rotary_dim`` dims of each head of q and k."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, params: dict[str, Any], max_position_embeddings: int,
                 max_positions: int, partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        inv_freq, scale = inv_freq_and_scaling(params, self.rotary_dim, max_position_embeddings)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        kind = params.get("rope_type", "default")
        if kind == "dynamic" and max_positions > max_position_embeddings:
            far = dynamic_ntk_inv_freq(params, self.rotary_dim, max_position_embeddings,
                                       int(float(params["factor"]) * max_position_embeddings))
            freqs[max_position_embeddings:] = positions[max_position_embeddings:, None] * far
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; returns new tensors (the inputs are not modified)."""
        if use_fused(q):
            from runner.kernels.fused import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos, self.sin, self.rotary_dim)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = (upcast(x_rot) * cos + upcast(rotated) * sin).to(x.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
