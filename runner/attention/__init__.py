"""Attention backends behind one interface (see ``runner.attention.base``), chosen by name."""

from __future__ import annotations

from kvcore.errors import InvalidArgumentError
from runner.attention.base import AttentionBackend, AttentionMetadata, GroupMetadata
from runner.attention.torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "GroupMetadata", "TorchAttentionBackend",
           "get_backend"]


def get_backend(name: str) -> AttentionBackend:
    """``"torch"`` (reference), ``"triton"`` (own kernels), ``"flash_attn"`` (if importable)."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from runner.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash_attn":
        from runner.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    raise InvalidArgumentError(
        f"unknown attention backend {name!r}; choose torch, triton or flash_attn")
