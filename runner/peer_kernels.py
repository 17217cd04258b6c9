"""Other libraries' paged decode attention over kvcore's KV layout, for ``runner.bench``.

Each builder takes the engine's KV tensor (``[2, num_blocks, block_size, num_kv_heads,
head_dim]``, 0 = K, 1 = V), block tables (``[batch, width]`` int32, physical block ids) and
sequence lengths, does its planning once (as a serving engine would, outside the timed call) and
returns ``decode(q)``: ``q`` ``[batch, num_heads, head_dim]`` (one query token per sequence, at
the end of its context) -> ``[batch, num_heads, head_dim]``.  The paged peers (FlexAttention,
FlashInfer) copy nothing: they read the same pages the Triton kernel reads.  The prefill
builders (``prefill=True``) take ``q_len`` query tokens per sequence, the last ``q_len`` of its
context, causal: ``q`` ``[batch * q_len, num_heads, head_dim]`` packed by sequence, as the
engine packs a prefill step.

* ``flex``: torch's FlexAttention.  K/V are strided views ``[1, kv_heads, num_blocks *
  block_size, head_dim]`` of the pages; a ``BlockMask`` built from the block tables
  (``from_kv_blocks``, one KV block per page) makes the kernel visit only each sequence's pages,
  and its ``mask_mod`` keeps a sequence to its own pages and the valid part of its last page
  (its lookup tables are int32, like the indices flex passes it).  ``compile=True`` (the
  default) compiles the fused kernel with static shapes, once per build: each build compiles
  its own copy of a small wrapper (its own code object, so its own dynamo cache), so a
  benchmark that builds one peer per shape never meets dynamo's recompile limit.  Eager mode
  materialises all scores (a correctness reference only).
* ``sdpa``: PyTorch's fused ``scaled_dot_product_attention`` over the same K/V gathered once
  (outside the timed call) into contiguous ``[batch, kv_heads, length, head_dim]`` tensors:
  the same attention with no paging, so the gap to it is what reading through pages costs.
  Sequences of one length need no mask (the fused flash kernel is eligible); ragged ones get a
  boolean mask.
* ``flashinfer``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` in the NHD layout, which is
  kvcore's page layout; ``plan`` takes the CSR page table (indptr, indices, last page length).

A builder raises ``ImportError`` when its library is missing.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Decode = Callable[[torch.Tensor], torch.Tensor]


def _pages(tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence: its page count, its last page's id, how many tokens that page holds, and
    which entries of its table row are its pages ([batch, width] bool)."""
    pages = (seq_lens.long() + block_size - 1) // block_size
    last = tables.long().gather(1, (pages - 1)[:, None]).squeeze(1)
    tail = seq_lens.long() - (pages - 1) * block_size
    valid = torch.arange(tables.shape[1], device=tables.device)[None, :] < pages[:, None]
    return pages, last, tail, valid


def flex_decode(cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                scale: float, *, compile: bool = True, q_len: int = 1) -> Decode:
    """FlexAttention paged attention (see the module docstring); ``q_len`` > 1: causal
    prefill of each sequence's last ``q_len`` tokens."""
    from torch.nn.attention.flex_attention import BlockMask

    _, num_blocks, block_size, kv_heads, head_dim = cache.shape
    batch, width = tables.shape
    dev = cache.device
    pages, last, tail, valid = _pages(tables, seq_lens, block_size)
    i32 = torch.int32
    owner = torch.full((num_blocks,), -1, dtype=i32, device=dev)
    owner[tables.long()[valid]] = torch.arange(batch, dtype=i32, device=dev)[:, None].expand(
        batch, width)[valid]
    logical = torch.zeros(num_blocks, dtype=i32, device=dev)  # a page's index in its table
    logical[tables.long()[valid]] = torch.arange(width, dtype=i32, device=dev)[None, :].expand(
        batch, width)[valid]
    last, tail = last.to(i32), tail.to(i32)
    first_q = (seq_lens.long() - q_len).to(i32)  # position of each sequence's first query token
    q_blocks = -(-q_len // 128)
    kv_indices = torch.zeros(batch, 1, q_blocks, num_blocks, dtype=torch.int32, device=dev)
    kv_indices[:, 0, :, :width] = tables.int()[:, None, :]

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        page = kv_idx // block_size
        mine = (owner[page] == b) & ((page != last[b]) | (kv_idx % block_size < tail[b]))
        if q_len == 1:
            return mine
        pos = logical[page] * block_size + kv_idx % block_size
        return mine & (pos <= first_q[b] + q_idx)

    block_mask = BlockMask.from_kv_blocks(
        pages.int()[:, None, None].expand(batch, 1, q_blocks).contiguous(), kv_indices,
        BLOCK_SIZE=(128, block_size), mask_mod=mask_mod,
        seq_lengths=(q_len, num_blocks * block_size))
    k = cache[0].view(num_blocks * block_size, kv_heads, head_dim).permute(1, 0, 2)[None]
    v = cache[1].view(num_blocks * block_size, kv_heads, head_dim).permute(1, 0, 2)[None]
    k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
    attend = _flex_compiled() if compile else _flex_call

    def decode(q: torch.Tensor) -> torch.Tensor:
        heads = q.shape[1]
        qb = q.view(batch, q_len, heads, head_dim).transpose(1, 2)  # [B, H, q_len, D]
        out = attend(qb, k, v, block_mask, scale)
        return out.transpose(1, 2).reshape(batch * q_len, heads, head_dim)

    return decode


def _flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
               scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    out: torch.Tensor = flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                       enable_gqa=True)
    return out


def _flex_compiled() -> Callable[..., torch.Tensor]:
    """``torch.compile`` (static shapes, one graph) of a private copy of :func:`_flex_call`.
    Dynamo keeps its compiled variants, and counts recompilations against its limit, per code
    object; a copy per build gives each build (one shape) its own."""
    copy = functools.update_wrapper(
        types.FunctionType(_flex_call.__code__.replace(), _flex_call.__globals__), _flex_call)
    return torch.compile(copy, dynamic=False, fullgraph=True)


@functools.cache
def _sdpa_has_gqa() -> bool:
    """``scaled_dot_product_attention(enable_gqa=...)`` exists (torch >= 2.5)."""
    x = torch.zeros(1, 2, 1, 8)
    try:
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


def sdpa_decode(cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                scale: float, q_len: int = 1) -> Decode:
    """PyTorch SDPA over contiguous copies of the sequences' K/V (see the module docstring);
    ``q_len`` > 1: causal, each sequence's last ``q_len`` tokens as queries."""
    _, _, block_size, kv_heads, head_dim = cache.shape
    batch = tables.shape[0]
    dev = cache.device
    lens = seq_lens.long()
    length = int(lens.max())
    pos = torch.arange(length, device=dev)
    blocks = tables.long().gather(1, (pos // block_size)[None, :].expand(batch, -1))
    rows = (pos % block_size)[None, :]
    # [batch, kv_heads, length, head_dim], contiguous; positions past a sequence's end are
    # whatever its table's padding page holds, and masked.
    k = cache[0][blocks, rows].permute(0, 2, 1, 3).contiguous()
    v = cache[1][blocks, rows].permute(0, 2, 1, 3).contiguous()
    ragged = bool((lens != length).any())
    causal = q_len > 1 and not ragged and q_len == length
    mask = None
    if ragged or (q_len > 1 and not causal):
        q_pos = lens[:, None] - q_len + torch.arange(q_len, device=dev)[None, :]
        mask = ((pos[None, None, :] <= q_pos[:, :, None])
                & (pos[None, None, :] < lens[:, None, None]))[:, None]  # [B, 1, q_len, L]
    gqa = _sdpa_has_gqa()

    def decode(q: torch.Tensor) -> torch.Tensor:
        heads = q.shape[1]
        qb = q.view(batch, q_len, heads, head_dim).transpose(1, 2)  # [B, H, q_len, D]
        if gqa:
            out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=causal,
                                                 scale=scale, enable_gqa=True)
        else:  # torch < 2.5: repeat the KV heads (reads them once per query head)
            g = heads // kv_heads
            out = F.scaled_dot_product_attention(
                qb, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask,
                is_causal=causal, scale=scale)
        return out.transpose(1, 2).reshape(batch * q_len, heads, head_dim)

    return decode


def flashinfer_decode(cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, num_heads: int, q_len: int = 1) -> Decode:
    """FlashInfer paged decode, or for ``q_len`` > 1 its causal paged prefill
    (``BatchPrefillWithPagedKVCacheWrapper``) (see the module docstring)."""
    import flashinfer

    _, _, block_size, kv_heads, head_dim = cache.shape
    dev = cache.device
    pages, _, tail, valid = _pages(tables, seq_lens, block_size)
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32, device=dev)
    indptr[1:] = pages.cumsum(0)
    indices = tables.int()[valid]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrapper: Any
    if q_len == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, tail.int(), num_heads, kv_heads, head_dim, block_size,
                     pos_encoding_mode="NONE", sm_scale=scale, q_data_type=cache.dtype,
                     kv_data_type=cache.dtype)
    else:
        qo_indptr = torch.arange(len(pages) + 1, dtype=torch.int32, device=dev) * q_len
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(qo_indptr, indptr, indices, tail.int(), num_heads, kv_heads, head_dim,
                     block_size, causal=True, sm_scale=scale, q_data_type=cache.dtype,
                     kv_data_type=cache.dtype)
    k_cache, v_cache = cache[0], cache[1]

    def decode(q: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = wrapper.run(q, (k_cache, v_cache))
        return out

    return decode


PEERS: dict[str, str] = {
    "flex": "torch FlexAttention (compiled, block mask from the block tables)",
    "flashinfer": "FlashInfer BatchDecodeWithPagedKVCacheWrapper (NHD)",
    "sdpa": "torch scaled_dot_product_attention on contiguous K/V (no paging)",
}


def build_peer(name: str, cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, num_heads: int, q_len: int = 1) -> Decode:
    """The attention function of peer ``name`` (a key of :data:`PEERS`) for ``q_len`` query
    tokens per sequence."""
    if name == "flex":
        return flex_decode(cache, tables, seq_lens, scale, q_len=q_len)
    if name == "flashinfer":
        return flashinfer_decode(cache, tables, seq_lens, scale, num_heads, q_len)
    if name == "sdpa":
        return sdpa_decode(cache, tables, seq_lens, scale, q_len)
    raise ValueError(f"unknown peer kernel {name!r}; choose from {sorted(PEERS)}")


__all__ = ["PEERS", "build_peer", "flashinfer_decode", "flex_decode", "sdpa_decode"]
