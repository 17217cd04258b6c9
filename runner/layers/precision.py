"""The precision the reference (torch) paths compute in.

Norms, RoPE and the torch attention backend upcast half-precision inputs to fp32, as the
reference implementations do; a float64 model stays in float64, so it can serve as the
high-precision reference that fp32 results are judged against (an fp32 round trip there would
make it no better than the fp32 model it is meant to judge).
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`compute_dtype` (no copy when it already is)."""
    return x.to(compute_dtype(x.dtype))
