"""Triton attention kernels at every GQA ratio and head dim against the torch reference, and
logit soft-capping (Gemma-2) in every kernel and in the reference.

GQA ratios {1, 2, 3, 4, 5, 6, 7, 8, 12, 16} x head dims {64, 80, 96, 128, 256}: the prefill
kernel packs ``BLOCK_M`` tokens x G heads into a power-of-two tile, so ratios that are not powers
of two leave padding rows, and head dims 80 and 96 leave padding columns.  Prefill runs the full
cross product in the half dtype (fp16 under the interpreter, bf16 on a GPU) and the uneven
ratios in fp32 (smaller tiles), its query tiles in reverse order; decode (split-K) runs a
diagonal in fp32 (every ratio, every head dim) and the uneven ratios in the half dtype.  Sliding
windows are on for half of the pairs (a checkerboard).  Shapes are small (one or two KV heads,
tens of tokens) so the Triton interpreter stays fast on a CPU (about 15 s of CPU time)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import triton

from runner.attention import TorchAttentionBackend, get_backend
from runner.kernels.attention import (
    _tile_sizes,
    paged_decode,
    paged_prefill,
    prefill_schedule,
    store_kv,
)
from tests.runner.test_kernels import CUDA, TOL, scenario

GQA = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
HEAD_DIMS = [64, 80, 96, 128, 256]
# fp32 and one half dtype (fp16 under the interpreter, which computes bf16 dots wrongly).
DTYPES = [torch.float32, torch.bfloat16 if CUDA else torch.float16]
# A chunk of 22 new tokens after a 13-token cached prefix (more than one query tile for every
# ratio that is not a power of two, so padding rows that fall on the next tile's tokens would
# show), a full prompt and a single token mixed into the prefill batch; 8-token pages, partial
# last blocks.
PREFILL_SEQS = ([35, 9, 4], [22, 9, 1])
DECODE_SEQS = [37, 5]


def kv_heads(group: int) -> int:
    """Two KV heads without GQA (checks the KV-head offsets), else one (keeps tests fast)."""
    return 2 if group == 1 else 1


def windowed(group: int, head_dim: int) -> bool:
    """A checkerboard over (GQA, head dim): every ratio and every head dim runs with and
    without a sliding window."""
    return (GQA.index(group) + HEAD_DIMS.index(head_dim)) % 2 == 1


# The diagonal: each ratio once, the head dims cycling (twice over).  The second, shorter list
# covers the ratios that are not powers of two with other head dims.
DIAGONAL = list(zip(GQA, HEAD_DIMS * 2))
UNEVEN = [(3, 128), (5, 64), (6, 80), (7, 96), (12, 256)]


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def check_backend(seq_lens: list[int], q_lens: list[int], *, group: int, head_dim: int,
                  dtype: torch.dtype, window: int | None = None, softcap: float | None = None,
                  seed: int = 0, reverse_tiles: bool = False) -> None:
    """The Triton backend (store_kv + prefill or decode kernel) against the torch reference.

    ``reverse_tiles``: run the prefill kernel's query tiles last to first.  A GPU runs tiles in
    any order but the interpreter in schedule order, so a tile that wrongly wrote rows of the
    next tile (e.g. unmasked padding rows) would be overwritten by the correct values and go
    unnoticed; in reverse order it is not."""
    q, k, v, cache, meta = scenario(seq_lens, q_lens, block_size=8,
                                    num_kv_heads=kv_heads(group), group=group,
                                    head_dim=head_dim, dtype=dtype, seed=seed)
    scale = head_dim ** -0.5
    ref_cache, tri_cache = cache.clone(), cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0, scale, window,
                                           softcap=softcap)
    if reverse_tiles:
        assert not meta.is_decode_only
        schedule = prefill_schedule(q_lens, head_dim, group, dtype, q.device).flip(1)
        store_kv(k, v, tri_cache, meta.groups[0].slot_mapping)
        got = paged_prefill(q, tri_cache, meta.groups[0].block_tables, meta.cu_seqlens_q,
                            meta.seq_lens, q_lens, scale, window, schedule=schedule,
                            softcap=softcap)
    else:
        got = get_backend("triton").forward(q, k, v, tri_cache, meta, 0, scale, window,
                                            softcap=softcap)
    assert torch.equal(tri_cache, ref_cache), "store_kv wrote different cache contents"
    err = _max_err(got, want)
    assert err <= TOL[dtype], f"max error {err}"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GQA)
def test_prefill_every_gqa_and_head_dim_half(group: int, head_dim: int) -> None:
    # A window of 11 cuts into the first sequence's cached prefix and its first tiles.
    check_backend(*PREFILL_SEQS, group=group, head_dim=head_dim, dtype=DTYPES[1],
                  window=11 if windowed(group, head_dim) else None, seed=group * 1000 + head_dim,
                  reverse_tiles=True)


@pytest.mark.parametrize("group,head_dim", [*UNEVEN, (16, 128)])
def test_prefill_gqa_and_head_dim_fp32(group: int, head_dim: int) -> None:
    """fp32 tiles are smaller (16 or 32 rows: G = 12 leaves 4 padding rows of 16, G = 16 fills
    a 16-row tile with one token)."""
    check_backend(*PREFILL_SEQS, group=group, head_dim=head_dim, dtype=torch.float32,
                  window=11 if windowed(group, head_dim) else None, seed=group * 1000 + head_dim,
                  reverse_tiles=True)


def _decode_split_k(group: int, head_dim: int, dtype: torch.dtype, window: int | None,
                    softcap: float | None = None, seed: int = 0) -> None:
    """The decode kernel with its context cut in three parts (partials merged by the combine
    kernel; the 5-token sequence leaves two parts empty), against the reference.  One split
    (the heuristic's choice for short contexts) runs in the backend-path tests."""
    q, k, v, cache, meta = scenario(DECODE_SEQS, [1] * len(DECODE_SEQS), block_size=8,
                                    num_kv_heads=kv_heads(group), group=group,
                                    head_dim=head_dim, dtype=dtype, seed=seed)
    scale = head_dim ** -0.5
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0, scale, window,
                                           softcap=softcap)
    store_kv(k, v, cache, meta.groups[0].slot_mapping)
    got = paged_decode(q, cache, meta.groups[0].block_tables, meta.seq_lens, max(DECODE_SEQS),
                       scale, window, num_splits=3, block_n=16, softcap=softcap)
    err = _max_err(got, want)
    assert err <= TOL[dtype], f"max error {err}"


@pytest.mark.parametrize("dtype,group,head_dim",
                         [(torch.float32, g, d) for g, d in DIAGONAL]
                         + [(DTYPES[1], g, d) for g, d in UNEVEN], ids=str)
def test_decode_gqa_and_head_dim(dtype: torch.dtype, group: int, head_dim: int) -> None:
    _decode_split_k(group, head_dim, dtype, 9 if windowed(group, head_dim) else None,
                    seed=group * 1000 + head_dim)


@pytest.mark.parametrize("group", [3, 6])
def test_decode_backend_path(group: int) -> None:
    """Decode-only steps through the backend (store_kv + the default split heuristic)."""
    check_backend(DECODE_SEQS, [1] * len(DECODE_SEQS), group=group, head_dim=80,
                  dtype=torch.float32, seed=group)


def test_tile_sizes_pad_rows_to_a_power_of_two() -> None:
    for dtype, group, head_dim in itertools.product(
            (torch.float16, torch.bfloat16, torch.float32), [*range(1, 17), 24, 32], HEAD_DIMS):
        tiles = _tile_sizes(head_dim, group, dtype)
        assert tiles.rows & (tiles.rows - 1) == 0 and tiles.rows >= 16
        assert tiles.block_m >= 1 and 0 <= tiles.rows - tiles.block_m * group < group
        assert tiles.block_d == max(16, 1 << (head_dim - 1).bit_length()) >= head_dim


def test_powers_of_two_keep_their_tiles() -> None:
    """Power-of-two shapes keep the tiles they were tuned with: the sizes the kernel used before
    it accepted other ratios (formula copied from that version), and no padding rows."""
    def old_tiles(head_dim: int, group: int, dtype: torch.dtype) -> tuple[int, int, int]:
        block_d = max(16, triton.next_power_of_2(head_dim))
        fp32 = dtype == torch.float32
        rows = 16 if fp32 and block_d >= 128 else 32 if fp32 else 64
        block_m = max(1, rows // triton.next_power_of_2(group))
        block_m = triton.next_power_of_2(max(block_m, triton.cdiv(16, group)))
        block_n = 16 if fp32 and block_d >= 128 else 32 if fp32 or block_d > 64 else 64
        return block_m, block_n, block_d

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (16, 32, 64, 128, 256):
            for group in (1, 2, 4, 8, 16, 32):
                tiles = _tile_sizes(head_dim, group, dtype)
                assert (tiles.block_m, tiles.block_n, tiles.block_d) == old_tiles(
                    head_dim, group, dtype)
                assert tiles.rows == tiles.block_m * group


def test_uneven_head_split_is_rejected() -> None:
    q, _, _, cache, meta = scenario([5], [5], block_size=8, num_kv_heads=2, group=3,
                                    head_dim=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="split evenly"):
        paged_prefill(q[:, :5], cache, meta.groups[0].block_tables, meta.cu_seqlens_q,
                      meta.seq_lens, [5], 0.25)


# ---------------------------------------------------------------- logit soft-capping (Gemma-2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int | None, softcap: float | None) -> torch.Tensor:
    """One sequence, computed directly (float64) as transformers' eager attention does:
    q [q_len, H, D] at the last q_len of the seq_len positions of k, v [seq_len, Hkv, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(rep, dim=1)
    v = v.double().repeat_interleave(rep, dim=1)
    weights = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        weights = weights / softcap
        weights = torch.tanh(weights)
        weights = weights * softcap
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    weights = weights.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(weights, dim=-1), v)


@pytest.mark.parametrize("window", [None, 5])
def test_reference_softcap_matches_dense_computation(window: int | None) -> None:
    seq_lens, q_lens, group, head_dim, softcap, bs = [23, 9], [8, 9], 3, 32, 2.0, 4
    q, k, v, cache, meta = scenario(seq_lens, q_lens, block_size=bs, num_kv_heads=2,
                                    group=group, head_dim=head_dim, dtype=torch.float32,
                                    seed=11)
    q = q * 3  # scores of several units: the cap changes them substantially
    scale = head_dim ** -0.5
    ref = TorchAttentionBackend()
    got = ref.forward(q, k, v, cache, meta, 0, scale, window, softcap=softcap).cpu()
    uncapped = ref.forward(q, k, v, cache.clone(), meta, 0, scale, window).cpu()
    q, k, cache = q.cpu(), k.cpu(), cache.cpu()
    start = 0
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        table = meta.groups[0].block_tables[s].tolist()
        # K/V of every position, read slot by slot from the cache (the new ones were stored).
        full_k = torch.stack([cache[0, table[p // bs], p % bs] for p in range(seq_len)])
        full_v = torch.stack([cache[1, table[p // bs], p % bs] for p in range(seq_len)])
        assert torch.equal(full_k[seq_len - q_len:], k[start:start + q_len])
        rows = slice(start, start + q_len)
        want = dense_attention(q[rows], full_k, full_v, scale, window, softcap)
        assert _max_err(got[rows], want) <= 1e-5, f"sequence {s}"
        plain = dense_attention(q[rows], full_k, full_v, scale, window, None)
        assert _max_err(uncapped[rows], plain) <= 1e-5, f"sequence {s}, no softcap"
        start += q_len
    assert _max_err(got, uncapped) > 0.05, "soft-capping had no effect in this test"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # interpreter: exp2 -> inf
def test_softcap_bounds_scores() -> None:
    """With a tiny cap every score lies in (-cap, cap): the output tends to the mean of the
    visible values however large q.k is."""
    q, k, v, cache, meta = scenario([6], [6], block_size=4, num_kv_heads=1, group=1,
                                    head_dim=16, dtype=torch.float32, seed=12)
    cap = 1e-4
    for name in ("torch", "triton"):
        out = get_backend(name).forward(q * 1000, k, v, cache.clone(), meta, 0, 1.0,
                                        softcap=cap)
        mean = v[:, 0].cumsum(0) / torch.arange(1, 7, device=v.device)[:, None]
        assert _max_err(out[:, 0], mean) <= 1e-3, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,head_dim,window", [(2, 256, None), (3, 80, 11), (1, 64, 5)])
def test_prefill_softcap(group: int, head_dim: int, window: int | None,
                         dtype: torch.dtype) -> None:
    # Gemma-2 caps at 50; 3.0 makes the cap matter for these unit-variance scores.
    check_backend(*PREFILL_SEQS, group=group, head_dim=head_dim, dtype=dtype, window=window,
                  softcap=3.0, seed=group + head_dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,head_dim,window", [(2, 256, None), (6, 96, 9)])
def test_decode_softcap(group: int, head_dim: int, window: int | None,
                        dtype: torch.dtype) -> None:
    _decode_split_k(group, head_dim, dtype, window, softcap=3.0, seed=group + head_dim)
    check_backend(DECODE_SEQS, [1] * len(DECODE_SEQS), group=group, head_dim=head_dim, dtype=dtype,
                  window=window, softcap=3.0, seed=group)


def test_softcap_none_and_zero_are_off_and_negative_is_rejected() -> None:
    q, k, v, cache, meta = scenario([9], [9], block_size=4, num_kv_heads=1, group=2,
                                    head_dim=16, dtype=torch.float32, seed=13)
    args = (cache, meta.groups[0].block_tables, meta.cu_seqlens_q, meta.seq_lens, [9], 0.25)
    store_kv(k, v, cache, meta.groups[0].slot_mapping)
    plain = paged_prefill(q, *args)
    assert torch.equal(paged_prefill(q, *args, softcap=0.0), plain)
    assert not math.isclose(_max_err(paged_prefill(q * 8, *args, softcap=1.0),
                                     paged_prefill(q * 8, *args)), 0.0)
    with pytest.raises(ValueError, match="softcap"):
        paged_prefill(q, *args, softcap=-1.0)
