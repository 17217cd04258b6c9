"""Attention backend on flash-attn (optional: imported only when this backend is chosen).

Prefill uses ``flash_attn_varlen_func`` with the paged cache as K/V (``block_table``), decode
``flash_attn_with_kvcache``; sliding windows map to ``window_size=(w - 1, 0)`` and logit
soft-capping to ``softcap=`` (flash-attn >= 2.6; 0.0 = off; like Gemma-2 it caps the scaled
scores).  flash-attn needs a page size that is a multiple of 256 for paged K/V in most builds.
"""

from __future__ import annotations

from typing import Any

import torch

from runner.attention.base import AttentionMetadata
from runner.attention.torch_ref import store_kv


class FlashAttnUnavailableError(ImportError):
    """flash-attn is not installed (it cannot be installed on CPU-only machines)."""


def _import_flash_attn() -> Any:
    try:
        import flash_attn
    except ImportError as exc:
        raise FlashAttnUnavailableError(
            "the flash_attn backend needs the 'flash-attn' package (CUDA only): "
            "pip install flash-attn, or use backend='triton' / 'torch'") from exc
    return flash_attn


class FlashAttnBackend:
    name = "flash_attn"
    supports_cuda_graphs = False

    def __init__(self) -> None:
        fa = _import_flash_attn()
        self._varlen = fa.flash_attn_varlen_func
        self._with_kvcache = fa.flash_attn_with_kvcache

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, group_id: int, scale: float,
                sliding_window: int | None = None, softcap: float | None = None
                ) -> torch.Tensor:
        group = meta.groups[group_id]
        store_kv(key, value, kv_cache, group.slot_mapping)
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        cap = float(softcap) if softcap else 0.0
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.is_decode_only:
            out = self._with_kvcache(query.unsqueeze(1), k_cache, v_cache,
                                     cache_seqlens=meta.seq_lens, block_table=group.block_tables,
                                     softmax_scale=scale, causal=True, window_size=window,
                                     softcap=cap)
            return out.squeeze(1)
        return self._varlen(query, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                            cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                            max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                            window_size=window, softcap=cap, block_table=group.block_tables)
