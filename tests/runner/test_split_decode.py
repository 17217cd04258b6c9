"""Split-K decode: the split-count choice per device, how the kernel cuts a context into parts,
and the kernel against the torch reference wherever the cuts fall.

The choice (``decode_splits``) is a pure function of the SM count, the batch, the KV heads and
the context; it is checked for the SM counts of an H100/H200 SXM (132), an H100 PCIe (114) and
an A100 (108).  The kernel runs under the Triton interpreter on a CPU (fp32 and fp16; compiled
on a GPU, where bf16 is added) on small grids: parts that end inside a page, contexts shorter
than a part (empty parts), windows whose first key is not tile-aligned, GQA ratios that are
not powers of two, head sizes that pad, soft-capping, and the one-split path that writes the
output without partials.  A few seconds of CPU time in all."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from runner.attention import TorchAttentionBackend, get_backend
from runner.kernels.attention import (
    MAX_DECODE_SPLITS,
    PROGRAMS_PER_SM,
    _decode_block_n,
    decode_splits,
    paged_decode,
    split_ranges,
    store_kv,
)
from tests.runner.test_kernels import CUDA, HALF, TOL, scenario

SMS = {"H100/H200 SXM": 132, "H100 PCIe": 114, "A100": 108}
KV_HEADS = 8  # Qwen3-0.6B's shape, the benchmark's


@pytest.mark.parametrize("sms", SMS.values(), ids=SMS.keys())
def test_a_batch_that_fills_the_gpu_is_not_split(sms: int) -> None:
    for batch in (128, 256, 1024):
        for ctx in (1, 512, 2048, 8192, 32768):
            assert decode_splits(ctx, batch, KV_HEADS, None, num_sms=sms) == 1


@pytest.mark.parametrize("sms", SMS.values(), ids=SMS.keys())
def test_a_small_batch_is_split_to_fill_one_wave(sms: int) -> None:
    """A small batch: the grid fits one wave of resident programs, no count that also fits
    gives shorter parts, and no smaller count gives parts as short."""
    slots = sms * PROGRAMS_PER_SM
    for batch in (1, 2, 3, 8, 20):
        for ctx in (512, 2048, 8192, 32768):
            tiles = -(-ctx // 64)
            work = batch * KV_HEADS
            splits = decode_splits(ctx, batch, KV_HEADS, None, num_sms=sms)
            fitting = [s for s in range(1, MAX_DECODE_SPLITS + 1) if work * s <= slots]
            per_part = -(-tiles // splits)
            assert splits in fitting and splits <= tiles
            assert min(-(-tiles // s) for s in fitting) == per_part
            assert all(-(-tiles // s) > per_part for s in range(1, splits))
            if batch <= 8 and ctx >= 8192:
                assert work * splits >= 0.75 * slots  # a small batch fills the GPU
    # More sequences never need more parts each.
    for ctx in (512, 2048, 8192, 32768):
        got = [decode_splits(ctx, b, KV_HEADS, None, num_sms=sms) for b in range(1, 200)]
        assert all(a >= b for a, b in itertools.pairwise(got)), (ctx, got)
        assert got[0] > 1 and got[-1] == 1


def test_h100_choices_match_the_sweeps_best_points() -> None:
    """BENCHMARKS.md, H100 2026-11-22: the best settings found (one 32k sequence: 64 parts;
    batch 8: 8 parts at 8k and 32k; batch 32 x 8k: 2; batch >= 128: 1)."""
    pick = {(b, c): decode_splits(c, b, KV_HEADS, None, num_sms=132)
            for b, c in [(1, 32768), (8, 8192), (8, 32768), (32, 8192), (128, 2048)]}
    assert pick == {(1, 32768): 64, (8, 8192): 8, (8, 32768): 8, (32, 8192): 2,
                    (128, 2048): 1}


def test_short_contexts_and_windows_bound_the_parts() -> None:
    # Never more parts than key tiles: a 100-token context is two 64-key tiles.
    assert decode_splits(100, 1, KV_HEADS, None, num_sms=132) == 2
    assert decode_splits(1, 1, KV_HEADS, None, num_sms=132) == 1
    # A window bounds the keys read: one sequence, 32k context, 1,024-key window -> 16 tiles.
    assert decode_splits(32768, 1, KV_HEADS, 1024, num_sms=132) == 16
    assert decode_splits(32768, 1, KV_HEADS, 1024, num_sms=132, block_n=32) == 32
    with pytest.raises(ValueError, match="num_sms"):
        decode_splits(4096, 1, KV_HEADS, None, num_sms=0)


def test_split_ranges_cover_every_visible_key_once() -> None:
    rng = random.Random(0)
    for _ in range(500):
        seq_len = rng.randint(1, 3000)
        window = rng.choice([None, rng.randint(1, 4000)])
        splits, block_n = rng.randint(1, 130), rng.choice([16, 32, 64])
        parts = split_ranges(seq_len, window, splits, block_n)
        lo = max(seq_len - window, 0) if window else 0
        keys = [p for a, b in parts for p in range(a, b)]
        assert keys == list(range(lo, seq_len))  # in order, each once
        tiles = [-(-(b - a) // block_n) for a, b in parts if b > a]
        assert max(tiles) - min(tiles) <= 1  # balanced to one tile
        assert sum(b > a for a, b in parts) == min(splits, -(-(seq_len - lo) // block_n))


# (GQA, head_dim, page size, window, splits, context lengths).  Key tiles are 16 wide here.
CASES = [
    # 32-key pages, 16-key tiles: parts end in the middle of a page.
    (2, 64, 32, None, 3, [70, 45]),
    # Contexts shorter than a part: 8 parts over 1 or 2 tiles leave most of them empty.
    (4, 32, 8, None, 8, [9, 1, 20]),
    # A window whose first key is not tile- or page-aligned (57 = 70 - 13).
    (3, 80, 16, 13, 4, [70, 12]),
    # Pages that are not a power of two, GQA 7, a window wider than one context.
    (7, 96, 12, 40, 5, [61, 33]),
    # Many parts of one tile each, GQA 1 with two KV heads.
    (1, 128, 4, None, 6, [96, 17]),
]


def _check(group: int, head_dim: int, block_size: int, window: int | None,
           splits: int | None, seq_lens: list[int], dtype: torch.dtype,
           softcap: float | None = None, num_sms: int | None = None) -> None:
    kv_heads = 2 if group == 1 else 1
    q, k, v, cache, meta = scenario(seq_lens, [1] * len(seq_lens), block_size=block_size,
                                    num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                                    dtype=dtype, seed=group * 100 + head_dim)
    scale = head_dim ** -0.5
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0, scale, window,
                                           softcap=softcap)
    store_kv(k, v, cache, meta.groups[0].slot_mapping)
    got = paged_decode(q, cache, meta.groups[0].block_tables, meta.seq_lens, max(seq_lens),
                       scale, window, num_splits=splits, block_n=16, softcap=softcap,
                       num_sms=num_sms)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype], f"max error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("group,head_dim,block_size,window,splits,seq_lens", CASES)
def test_split_decode_matches_the_reference(group: int, head_dim: int, block_size: int,
                                            window: int | None, splits: int,
                                            seq_lens: list[int], dtype: torch.dtype) -> None:
    _check(group, head_dim, block_size, window, splits, seq_lens, dtype)


def test_the_cases_cut_where_they_claim() -> None:
    """The cases above do exercise what they are there for."""
    inside_page = empty_part = unaligned_start = False
    for _, _, block_size, window, splits, seq_lens in CASES:
        for n in seq_lens:
            parts = split_ranges(n, window, splits, 16)
            inside_page |= any(b < n and b % block_size for a, b in parts if b > a)
            empty_part |= any(b <= a for a, b in parts)
            unaligned_start |= parts[0][0] % 16 != 0
    assert inside_page and empty_part and unaligned_start


def test_one_split_writes_the_output_directly() -> None:
    """A batch that fills the (here: one-SM) device runs one part per sequence: the kernel's
    direct-output path, no partials or combine; equal to the reference and to a split run."""
    assert decode_splits(70, 4, 1, None, num_sms=1) == 1
    _check(2, 64, 16, None, None, [70, 3, 33, 16], torch.float32, num_sms=1)
    _check(2, 64, 16, 20, None, [70, 3, 33, 16], HALF[0], num_sms=1)


def test_soft_capping_across_parts() -> None:
    _check(2, 64, 8, None, 4, [50, 7], torch.float32, softcap=5.0)


def test_backend_uses_the_device_choice() -> None:
    """Through the backend: the split count comes from the device (the interpreter's stand-in
    SM count on a CPU), here more than one part for a lone sequence."""
    q, k, v, cache, meta = scenario([90], [1], block_size=8, num_kv_heads=1, group=2,
                                    head_dim=32, dtype=torch.float32, seed=3)
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0, 0.2)
    got = get_backend("triton").forward(q, k, v, cache, meta, 0, 0.2)
    assert (got - want).abs().max().item() <= TOL[torch.float32]
    if not CUDA:
        from runner.kernels.attention import INTERPRETER_SMS

        block_n = _decode_block_n(32, torch.float32)
        assert decode_splits(90, 1, 1, None, num_sms=INTERPRETER_SMS, block_n=block_n) > 1
