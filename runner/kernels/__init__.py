"""Triton kernels (paged attention, KV store, fused norms / activations / RoPE); tested on CPU
under TRITON_INTERPRET=1.

The layers call the fused kernels of :mod:`runner.kernels.fused` for a tensor when
:func:`use_fused` says so: by default for CUDA tensors when Triton is installed, so the CPU path
is the plain torch code.  :func:`fused_kernels` overrides that for a block of code (tests and
benchmarks: the torch path on a GPU, or the kernels on CPU under the Triton interpreter).  This
module imports no Triton, so the layers work without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch

_override: bool | None = None


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_fused(t: torch.Tensor) -> bool:
    """Whether the layers should run ``t`` through :mod:`runner.kernels.fused`."""
    enabled = t.is_cuda if _override is None else _override
    return enabled and triton_available()


@contextlib.contextmanager
def fused_kernels(enabled: bool | None) -> Iterator[None]:
    """Within the block the layers use the fused kernels for every tensor (``True``: CPU tensors
    need ``TRITON_INTERPRET=1``), never (``False``: the torch path, also on CUDA), or for CUDA
    tensors (``None``, the default).  Process-wide, not thread-local."""
    global _override
    saved, _override = _override, enabled
    try:
        yield
    finally:
        _override = saved
