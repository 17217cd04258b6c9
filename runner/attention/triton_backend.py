"""Attention backend on our Triton kernels (``runner.kernels.attention``).

Decode-only steps use the split-K decode kernel, whose launch depends only on tensor shapes and
``max_seqlen_k`` (so it can be captured in a CUDA graph); anything else uses the prefill kernel,
which also handles single-token sequences mixed into a prefill batch.
"""

from __future__ import annotations

import torch

from runner.attention.base import AttentionMetadata
from runner.kernels.attention import paged_decode, paged_prefill, prefill_schedule, store_kv


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, group_id: int, scale: float,
                sliding_window: int | None = None, softcap: float | None = None
                ) -> torch.Tensor:
        group = meta.groups[group_id]
        store_kv(key, value, kv_cache, group.slot_mapping)
        if meta.is_decode_only:
            return paged_decode(query, kv_cache, group.block_tables, meta.seq_lens,
                                meta.max_seqlen_k, scale, sliding_window, softcap=softcap)
        head_dim, gqa = query.shape[2], query.shape[1] // kv_cache.shape[3]
        memo = ("triton_prefill_schedule", head_dim, gqa, query.dtype)
        schedule = meta.scratch.get(memo)
        if schedule is None:  # first layer of the step: build it once for all layers
            schedule = meta.scratch[memo] = prefill_schedule(
                meta.query_lens_cpu, head_dim, gqa, query.dtype, query.device)
        return paged_prefill(query, kv_cache, group.block_tables, meta.cu_seqlens_q,
                             meta.seq_lens, meta.query_lens_cpu, scale, sliding_window,
                             schedule=schedule, softcap=softcap)
