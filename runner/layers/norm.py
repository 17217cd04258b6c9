"""RMSNorm, computed in fp32 like the reference implementations (float64 models: in float64).

Two flavours, matching their checkpoints:

* :class:`RMSNorm` (Llama, Mistral, Qwen): ``weight * normed`` with the product taken in the
  input dtype, weights initialised to 1.
* :class:`GemmaRMSNorm` (Gemma-2/3): ``normed * (1 + weight)`` entirely in fp32, cast back at the
  end; checkpoints store the offset from 1, so weights are initialised to 0.

``norm(x)`` returns the normed ``x``; ``norm(x, residual)`` adds the residual first and returns
``(normed, x + residual)`` (the decoder's residual stream, vLLM style).  Where
:func:`runner.kernels.use_fused` says so (CUDA tensors) both run as one Triton kernel
(:mod:`runner.kernels.fused`) with the same numerics; elsewhere :meth:`RMSNorm.torch_norm`.
"""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from runner.kernels import use_fused
from runner.layers.precision import upcast


class RMSNorm(nn.Module):
    gemma = False  # GemmaRMSNorm's (1 + weight) convention

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_fused(x):
            from runner.kernels import fused

            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps, gemma=self.gemma)
            return fused.add_rms_norm(x, residual, self.weight, self.eps, gemma=self.gemma)
        if residual is None:
            return self.torch_norm(x)
        x = x + residual
        return self.torch_norm(x), x

    def torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in plain torch (the reference of the fused kernel)."""
        dtype = x.dtype
        x = upcast(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    gemma = True

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        y = upcast(x)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + upcast(self.weight))).to(x.dtype)
