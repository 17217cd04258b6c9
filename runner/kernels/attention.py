"""Triton kernels for paged attention.

Layout (see ``runner/attention/base.py``): ``kv_cache[2, num_blocks, block_size, Hkv, D]``;
token ``t`` of a sequence is row ``t % block_size`` of block ``block_table[t // block_size]``.

* ``store_kv``: one program per new token writes its K and V rows through ``slot_mapping``
  (slot < 0: padding, skipped).
* ``paged_prefill``: programs over (query tile, KV head).  A tile holds ``BLOCK_M`` query tokens
  of one sequence times the ``G = Hq / Hkv`` query heads sharing the KV head (GQA packing: K/V
  are loaded once for the whole group), i.e. ``BLOCK_M * G`` rows, padded to ``ROWS`` (a power
  of two, as ``tl.arange`` needs; ``BLOCK_M = ROWS // G``, so the padding is fewer than ``G``
  rows, and none when ``G`` is a power of two).  K/V are read ``BLOCK_N``
  positions at a time, each row gathered through the block table (so any page size works with
  tensor-core tiles >= 16).  The loop covers only positions some query in the tile can see:
  ``[first_query_pos - window + 1, last_query_pos]``.  Online softmax in fp32.
* ``paged_decode``: one query per sequence, programs over (sequence, KV head, split): split-K
  (flash-decoding).  The visible range ``[seq_len - window, seq_len)`` is ``n`` tiles of
  ``BLOCK_N`` keys; split ``i`` of ``s`` takes tiles ``[i * n // s, (i + 1) * n // s)``, so the
  parts differ by at most one tile, a part ends wherever its last tile ends (inside a page when
  pages are larger than a tile, or at the window's unaligned start plus whole tiles), and with
  ``s > n`` some parts are empty.  Each part writes a partial output and its log-sum-exp and
  ``_combine`` merges them; with one split the kernel writes the output itself (no partials,
  no combine launch).  :func:`decode_splits` picks ``s`` from the device's SM count, the batch
  and the context, so that a small batch still fills the GPU.  The G query heads are rows of
  one tile (padded to a power of two, at least 16).

Any head dim works: tiles are ``BLOCK_D = next_power_of_2(head_dim)`` wide, masked beyond
``head_dim`` (loads fill 0, so the padded columns add nothing to QK^T and are never stored).

Logit soft-capping (Gemma-2): with ``softcap`` the scaled scores become
``softcap * tanh(scale * q.k / softcap)`` before masking and softmax.  It is a compile-time
switch (``SOFTCAP_LOG2 = softcap * log2(e)``, 0.0 = off), so kernels without it are unchanged.

fp32 inputs use IEEE fp32 dot products (no TF32) so results match the torch reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_vt, stride_c_kv, stride_c_block, stride_c_tok,
                     block_size, HD: tl.constexpr, BLOCK_HD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        row = slot % block_size
        offs = tl.arange(0, BLOCK_HD)
        mask = offs < HD
        dst = cache_ptr + block * stride_c_block + row * stride_c_tok + offs
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V ([T, Hkv, D]) to its slot; slots < 0 are skipped."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    hd = key.shape[1] * key.shape[2]
    if kv_cache.stride(3) != kv_cache.shape[4] or kv_cache.stride(4) != 1:
        raise ValueError("kv_cache's head and head_dim dimensions must be contiguous")
    key = key.reshape(num_tokens, hd)
    value = value.reshape(num_tokens, hd)
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), value.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), kv_cache.shape[2], HD=hd, BLOCK_HD=triton.next_power_of_2(hd))


@triton.jit
def _load_kv_tile(cache_ptr, table_ptr, pos, pos_mask, kvh, offs_d, d_mask,
                  stride_c_block, stride_c_tok, stride_c_head, block_size):
    """K or V rows for positions ``pos`` ([BLOCK_N]) of one sequence: [BLOCK_N, BLOCK_D]."""
    block_idx = pos // block_size
    block = tl.load(table_ptr + block_idx, mask=pos_mask, other=0).to(tl.int64)
    row = (pos % block_size).to(tl.int64)
    ptrs = (cache_ptr + block[:, None] * stride_c_block + row[:, None] * stride_c_tok
            + kvh * stride_c_head + offs_d[None, :])
    return tl.load(ptrs, mask=pos_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _attend_tile(q, k_base, v_base, table, pos, pos_mask, visible, kvh, offs_d, d_mask,
                 m_i, l_i, acc, scale_log2, stride_c_block, stride_c_tok, stride_c_head,
                 block_size, IEEE: tl.constexpr, SOFTCAP_LOG2: tl.constexpr):
    """One online-softmax step: fold the K/V rows at ``pos`` into (m_i, l_i, acc).

    Scores are kept in log2 units.  Without soft-capping ``scale_log2 = scale * log2(e)``; with
    it (``SOFTCAP_LOG2 = softcap * log2(e) > 0``) ``scale_log2 = 2 * log2(e) * scale / softcap``
    and ``tanh(x) = 1 - 2 / (exp(2x) + 1)`` (exact at both tails: exp2 -> inf gives 1, -> 0
    gives -1)."""
    k = _load_kv_tile(k_base, table, pos, pos_mask, kvh, offs_d, d_mask,
                      stride_c_block, stride_c_tok, stride_c_head, block_size)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP_LOG2 > 0:
        s = SOFTCAP_LOG2 * (1.0 - 2.0 / (tl.exp2(s * scale_log2) + 1.0))
        s = tl.where(visible, s, float("-inf"))
    else:
        s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_tile(v_base, table, pos, pos_mask, kvh, offs_d, d_mask,
                      stride_c_block, stride_c_tok, stride_c_head, block_size)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, table_ptr, cu_q_ptr, seq_lens_ptr, tile_seq_ptr,
                    tile_start_ptr, out_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_c_kv, stride_c_block, stride_c_tok, stride_c_head, stride_table,
                    scale_log2, block_size, window, head_dim,
                    G: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                    SOFTCAP_LOG2: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    q_start = tl.load(tile_start_ptr + tile)
    cu = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - cu
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, ROWS)  # BLOCK_M * G packed rows, padded to a power of two
    tok = q_start + rows // G  # query token index within the sequence's new tokens
    head = kvh * G + rows % G
    if ROWS > BLOCK_M * G:
        # Padding rows (only when G is not a power of two) fall on tokens of the next tile:
        # mask them (a scalar bound, so the row mask stays one comparison).
        row_mask = tok < tl.minimum(q_len, q_start + BLOCK_M)
    else:
        row_mask = tok < q_len
    q_pos = seq_len - q_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + (cu + tok)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    last = tl.minimum(seq_len - q_len + q_start + BLOCK_M, seq_len)  # exclusive
    visible_from = 0  # no query of the tile sees a key before this position
    if window > 0:
        visible_from = tl.maximum(seq_len - q_len + q_start - window + 1, 0)
    first = visible_from // BLOCK_N * BLOCK_N
    table = table_ptr + seq.to(tl.int64) * stride_table
    k_base = cache_ptr
    v_base = cache_ptr + stride_c_kv
    for start in range(first, last, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        # Positions left of the window are not even loaded: their pages may be the null block
        # or stale blocks, and 0 * NaN would still be NaN.
        pos_mask = (pos >= visible_from) & (pos < last)
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, k_base, v_base, table, pos, pos_mask, visible, kvh,
                                     offs_d, d_mask, m_i, l_i, acc, scale_log2, stride_c_block,
                                     stride_c_tok, stride_c_head, block_size, IEEE, SOFTCAP_LOG2)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (cu + tok)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
                   stride_qt, stride_qh, stride_c_kv, stride_c_block, stride_c_tok,
                   stride_c_head, stride_table, stride_po_s, stride_po_h, stride_po_split,
                   stride_pl_s, stride_pl_h,
                   scale_log2, block_size, window, head_dim, num_heads,
                   G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, IEEE: tl.constexpr, SOFTCAP_LOG2: tl.constexpr,
                   SPLIT: tl.constexpr):
    """One part of one sequence's context for the G query heads of one KV head.  ``SPLIT``:
    write the part's normalised output and log-sum-exp (log2 units) to the partial buffers;
    else (one split) the final output to ``part_out_ptr`` (then the output tensor, whose
    ``stride_po_s``/``stride_po_h`` are its token and head strides)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    # Whole tiles, spread evenly: part `split` takes tiles [t0, t1) of the n visible ones.
    n_tiles = tl.cdiv(seq_len - lo, BLOCK_N)
    t0 = split * n_tiles // num_splits
    t1 = (split + 1) * n_tiles // num_splits
    start0 = lo + t0 * BLOCK_N
    end = tl.minimum(lo + t1 * BLOCK_N, seq_len)
    h = tl.arange(0, BLOCK_H)
    h_mask = h < G
    head = kvh * G + h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_table
    for start in range(start0, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        m_i, l_i, acc = _attend_tile(q, cache_ptr, cache_ptr + stride_c_kv, table, pos, pos_mask,
                                     pos_mask[None, :], kvh, offs_d, d_mask, m_i, l_i, acc,
                                     scale_log2, stride_c_block, stride_c_tok, stride_c_head,
                                     block_size, IEEE, SOFTCAP_LOG2)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    store_mask = h_mask & (head < num_heads)
    dst = part_out_ptr + seq.to(tl.int64) * stride_po_s + head[:, None] * stride_po_h
    if SPLIT:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(dst + split * stride_po_split + offs_d[None, :], out,
                 mask=store_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + seq.to(tl.int64) * stride_pl_s + head * stride_pl_h + split,
                 lse, mask=store_mask)
    else:
        tl.store(dst + offs_d[None, :], out.to(part_out_ptr.dtype.element_ty),
                 mask=store_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr,
                    stride_po_s, stride_po_h, stride_po_split, stride_pl_s, stride_pl_h,
                    stride_ot, stride_oh, head_dim,
                    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    s_mask = sp < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    lse = tl.load(part_lse_ptr + seq.to(tl.int64) * stride_pl_s + head * stride_pl_h + sp,
                  mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(part_out_ptr + seq.to(tl.int64) * stride_po_s + head * stride_po_h
                    + sp[:, None] * stride_po_split + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache's head_dim dimension must be contiguous")


def _gqa(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head: any positive integer (not only powers of two)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split evenly over "
                         f"{num_kv_heads} KV heads")
    return num_heads // num_kv_heads


class PrefillTiles(NamedTuple):
    """Tile sizes of the prefill kernel."""

    block_m: int  # query tokens per tile
    rows: int  # tile rows: block_m * group padded to a power of two (>= 16, for tl.dot)
    block_n: int  # keys per loop step
    block_d: int  # head_dim padded to a power of two (>= 16)


def _score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(``scale_log2``, ``SOFTCAP_LOG2``) kernel arguments; see ``_attend_tile``."""
    if softcap is None or softcap == 0:
        return scale * _LOG2E, 0.0
    if not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")
    return 2.0 * _LOG2E * scale / softcap, float(softcap) * _LOG2E


def _tile_sizes(head_dim: int, group: int, dtype: torch.dtype) -> PrefillTiles:
    """Tile sizes for the prefill kernel.  A tile has ``rows`` (a power of two, at least 16
    for tl.dot; more when G is larger) packed rows holding ``block_m = rows // G`` whole query
    tokens; for a G that is not a power of two the last ``rows - block_m * G < G`` rows are
    padding (e.g. G = 3, 16-bit: 21 tokens in 64 rows, G = 7: 9 in 64).  fp32 tiles are smaller
    so they fit in registers without spilling (checked for sm_90 by
    ``python -m runner.kernels.aot_check``).  Power-of-two shapes get the sizes they always had."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    fp32 = dtype == torch.float32
    rows = 16 if fp32 and block_d >= 128 else 32 if fp32 else 64
    rows = max(rows, triton.next_power_of_2(group))
    block_n = 16 if fp32 and block_d >= 128 else 32 if fp32 or block_d > 64 else 64
    return PrefillTiles(rows // group, rows, block_n, block_d)


def _decode_block_n(block_d: int, dtype: torch.dtype) -> int:
    """Keys per loop step of the decode kernel.  16-bit: 64 up to head_dim 128 (an H100 sweep,
    BENCHMARKS.md: 32 -> 64 took batch 128 x 2k context from 89% to 95% of copy bandwidth)."""
    if dtype == torch.float32:
        return 16
    return 64 if block_d <= 128 else 32


def prefill_schedule(query_lens: list[int], head_dim: int, group: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """The prefill kernel's query tiles: ``[2, num_tiles]`` int32 (sequence, first token).

    Built with numpy and copied without blocking the host (pinned memory), so a step's layers
    can share one schedule and the host never waits for the GPU here."""
    block_m = _tile_sizes(head_dim, group, dtype).block_m
    q = np.asarray(query_lens, dtype=np.int64)
    per_seq = -(-q // block_m)
    num_tiles = int(per_seq.sum())
    first_tile = np.cumsum(per_seq) - per_seq
    tiles = np.empty((2, num_tiles), dtype=np.int32)
    tiles[0] = np.repeat(np.arange(len(q)), per_seq)
    tiles[1] = (np.arange(num_tiles) - np.repeat(first_tile, per_seq)) * block_m
    host = torch.from_numpy(tiles)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def paged_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, query_lens: list[int],
                  scale: float, sliding_window: int | None = None,
                  block_n: int | None = None, schedule: torch.Tensor | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """Attention for packed queries ([T, Hq, D]) over K/V already in the paged cache.
    ``schedule``: :func:`prefill_schedule` for these queries (built here if not given).
    ``softcap``: logit soft-capping of the scaled scores (None: off)."""
    _check_cache(kv_cache)
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = _gqa(num_heads, num_kv_heads)
    tiles = _tile_sizes(head_dim, group, query.dtype)
    block_n = block_n or tiles.block_n
    scale_log2, softcap_log2 = _score_scales(scale, softcap)
    if schedule is None:
        schedule = prefill_schedule(query_lens, head_dim, group, query.dtype, query.device)
    out = torch.empty_like(query)
    num_tiles = schedule.shape[1]
    if num_tiles == 0:
        return out
    _prefill_kernel[(num_tiles, num_kv_heads)](
        query, kv_cache, block_tables, cu_seqlens_q, seq_lens, schedule[0], schedule[1], out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), scale_log2, kv_cache.shape[2], sliding_window or 0, head_dim,
        G=group, BLOCK_M=tiles.block_m, ROWS=tiles.rows, BLOCK_N=block_n, BLOCK_D=tiles.block_d,
        IEEE=query.dtype == torch.float32, SOFTCAP_LOG2=softcap_log2)
    return out


# The split-count model (see decode_splits).  From the H100 sweep in BENCHMARKS.md
# (2026-11-22): the best points (batch 8: 8 splits at 8k and 32k, 9 = 576 programs was 13
# points slower; batch 32 x 8k: 2 splits; one 32k sequence: 64 splits) are where the grid just
# fits 4 resident programs per SM, i.e. one full wave.
PROGRAMS_PER_SM = 4
MAX_DECODE_SPLITS = 128
# "SMs" assumed off CUDA (the Triton interpreter): small, so interpreter grids stay small.
INTERPRETER_SMS = 4


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); :data:`INTERPRETER_SMS` elsewhere."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sm_count(device.index if device.index is not None
                          else torch.cuda.current_device())


def decode_splits(max_seqlen_k: int, num_seqs: int, num_kv_heads: int, window: int | None,
                  *, num_sms: int, block_n: int = 64,
                  programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """How many parts to cut each sequence's context into (split-K decode).

    A batch of ``num_seqs * num_kv_heads`` (sequence, KV head) pairs that already fills the
    GPU's ``num_sms * programs_per_sm`` resident program slots gets 1 (no partials, no combine
    launch).  A smaller batch gets as many parts as one wave of programs holds (at most the
    context's key tiles, and 128), then the fewest parts that keep the same tiles per part
    (equal time, fewer partials to merge).  One 32k sequence with 8 KV heads on 132 SMs: 64
    parts (512 programs of 528 slots, 8 tiles each); batch 8: 8 parts; batch 32: 2; batch
    >= 34: 1 (272 or more programs leave no room for a second part each).  A sliding window
    bounds the keys read, so it bounds the parts too.  (Several waves of short parts can fit
    the slots exactly too, but that bets on the exact residency, which the kernel's register
    use decides, so the choice stays within one wave.)"""
    if num_sms <= 0 or programs_per_sm <= 0 or block_n <= 0:
        raise ValueError(f"num_sms ({num_sms}), programs_per_sm ({programs_per_sm}) and "
                         f"block_n ({block_n}) must be positive")
    span = min(max_seqlen_k, window) if window else max_seqlen_k
    tiles = max(1, -(-span // block_n))
    work = max(1, num_seqs * num_kv_heads)
    most = min((num_sms * programs_per_sm) // work, tiles, MAX_DECODE_SPLITS)
    if most <= 1:
        return 1
    per_part = -(-tiles // most)
    return -(-tiles // per_part)


def split_ranges(seq_len: int, window: int | None, num_splits: int, block_n: int
                 ) -> list[tuple[int, int]]:
    """The key positions ``[start, end)`` each part of one sequence reads, exactly as the decode
    kernel cuts them (empty parts: ``start >= end``); for tests and tuning."""
    lo = max(seq_len - window, 0) if window else 0
    n_tiles = -(-(seq_len - lo) // block_n)
    out = []
    for i in range(num_splits):
        t0, t1 = i * n_tiles // num_splits, (i + 1) * n_tiles // num_splits
        out.append((lo + t0 * block_n, min(lo + t1 * block_n, seq_len)))
    return out


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seqlen_k: int, scale: float,
                 sliding_window: int | None = None, num_splits: int | None = None,
                 block_n: int | None = None, num_warps: int = 4,
                 num_stages: int | None = None, softcap: float | None = None,
                 num_sms: int | None = None) -> torch.Tensor:
    """One query token per sequence ([S, Hq, D]) over the paged cache, split-K.

    ``num_splits`` (else :func:`decode_splits` for this device's SM count, or ``num_sms``),
    ``block_n``, ``num_warps`` and ``num_stages`` override the tuned defaults (for tests and
    tuning sweeps).  ``softcap``: logit soft-capping (None: off).  Any G and head_dim: the G
    query heads are padded to ``BLOCK_H`` rows, head_dim to ``BLOCK_D``.  The launch depends
    only on shapes and ``max_seqlen_k``, never on tensor contents (CUDA-graph safe)."""
    _check_cache(kv_cache)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = _gqa(num_heads, num_kv_heads)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))
    block_n = block_n or _decode_block_n(block_d, query.dtype)
    splits = num_splits or decode_splits(
        max_seqlen_k, num_seqs, num_kv_heads, sliding_window, block_n=block_n,
        num_sms=num_sms or device_sm_count(query.device))
    scale_log2, softcap_log2 = _score_scales(scale, softcap)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    common = dict(G=group, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
                  IEEE=query.dtype == torch.float32, SOFTCAP_LOG2=softcap_log2,
                  num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}))
    args = (query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0))
    scalars = (scale_log2, kv_cache.shape[2], sliding_window or 0, head_dim, num_heads)
    if splits == 1:  # the batch fills the GPU: the kernel writes the output itself
        _decode_kernel[(num_seqs, num_kv_heads, 1)](
            query, kv_cache, block_tables, seq_lens, out, out, *args,
            out.stride(0), out.stride(1), 0, 0, 0, *scalars, SPLIT=False, **common)
        return out
    part_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32,
                           device=query.device)
    part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, kv_cache, block_tables, seq_lens, part_out, part_lse, *args,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), *scalars, SPLIT=True, **common)
    _combine_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), head_dim,
        NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out
