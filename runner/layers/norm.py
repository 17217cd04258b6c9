"""RMSNorm, computed in fp32 like the reference implementations.

Two flavours, matching their checkpoints:

* :class:`RMSNorm` (Llama, Mistral, Qwen): ``weight * normed`` with the product taken in the
  input dtype, weights initialised to 1.
* :class:`GemmaRMSNorm` (Gemma-2/3): ``normed * (1 + weight)`` entirely in fp32, cast back at the
  end; checkpoints store the offset from 1, so weights are initialised to 0.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)
