"""Reference attention backend in plain torch: exact, simple, CPU and GPU.

It scatters the new K/V through ``slot_mapping``, then for each sequence gathers its pages through
the block table and runs masked softmax attention in fp32 (in float64 for a float64 model).  It is
the oracle the Triton and flash-attn backends are tested against.
"""

from __future__ import annotations

import torch

from runner.attention.base import AttentionMetadata
from runner.layers.precision import upcast


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V to its slot; slots < 0 (padding) are skipped."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``seq_len`` tokens of one sequence: [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    ids = block_table[:num_blocks].long()
    k = kv_cache[0, ids].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, ids].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def causal_window_mask(q_len: int, seq_len: int, sliding_window: int | None,
                       device: torch.device) -> torch.Tensor:
    """[q_len, seq_len] bool: True where query j (at position seq_len - q_len + j) sees key t."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


class TorchAttentionBackend:
    """Exact reference: per-sequence gather + masked softmax in fp32."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, group_id: int, scale: float,
                sliding_window: int | None = None, softcap: float | None = None
                ) -> torch.Tensor:
        group = meta.groups[group_id]
        store_kv(key, value, kv_cache, group.slot_mapping)
        out = torch.empty_like(query)
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        rep = num_heads // num_kv_heads
        start = 0
        for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 0:
                continue
            q = upcast(query[start:start + q_len])  # [q, H, D]
            k, v = gather_kv(kv_cache, group.block_tables[s], seq_len)
            mask = causal_window_mask(q_len, seq_len, sliding_window, query.device)
            if sliding_window is not None:
                # Keys left of the first query's window may lie in the null block, whose contents
                # are arbitrary (0 * NaN = NaN even under a zero softmax weight): never read them.
                first = max(0, seq_len - q_len - sliding_window + 1)
                k, v, mask = k[first:], v[first:], mask[:, first:]
            k = k.to(q.dtype).repeat_interleave(rep, dim=1)  # [S, H, D]
            v = v.to(q.dtype).repeat_interleave(rep, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            if softcap:  # logit soft-capping (Gemma-2), on the scaled scores, before the mask
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
            start += q_len
        return out
