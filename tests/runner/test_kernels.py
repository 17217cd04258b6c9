"""Triton kernels against the torch reference backend on random paged inputs: ragged lengths,
partial last blocks, shuffled block ids, GQA 1/4/8, sliding windows, cached prefixes, split-K
decode, mixed batches, padding slots, head_dim 80.

Without a GPU the kernels run under TRITON_INTERPRET=1 in fp32 and fp16 only (the interpreter
computes bf16 dots wrongly); with CUDA they are compiled, run on the GPU, and bf16 is added."""

from __future__ import annotations

import random

import pytest
import torch

from runner.attention import AttentionMetadata, GroupMetadata, TorchAttentionBackend, get_backend
from runner.kernels.attention import (
    _tile_sizes,
    paged_decode,
    prefill_schedule,
    store_kv,
)

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Half-precision dtypes the kernels are checked in: the interpreter gets bf16 dots wrong.
HALF = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]


def scenario(seq_lens: list[int], q_lens: list[int], *, block_size: int, num_kv_heads: int,
             group: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
             padding: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q/k/v for the new tokens, a cache whose cached prefixes hold random K/V, and the
    metadata (shuffled block ids; block 0 reserved)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables, slots = [], []
    for s, ql in zip(seq_lens, q_lens):
        table = [ids.pop() for _ in range(-(-s // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s - ql, s)]
    slots += [-1] * padding
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    n = sum(q_lens) + padding
    heads = num_kv_heads * group
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(cu.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                             max(q_lens), max(seq_lens),
                             [GroupMetadata(torch.tensor(slots, device=DEVICE), bt.to(DEVICE))],
                             list(seq_lens), list(q_lens))
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE), meta


def compare(seq_lens: list[int], q_lens: list[int], window: int | None = None, **kw: object) -> None:
    q, k, v, cache, meta = scenario(seq_lens, q_lens, **kw)  # type: ignore[arg-type]
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5
    ref_cache, tri_cache = cache.clone(), cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0, scale, window)
    got = get_backend("triton").forward(q, k, v, tri_cache, meta, 0, scale, window)
    n = sum(q_lens)
    assert torch.equal(tri_cache, ref_cache), "store_kv wrote different cache contents"
    err = (got[:n].float() - want[:n].float()).abs().max().item()
    assert err <= TOL[dtype], f"max error {err}"


def test_prefill_from_scratch_fp32() -> None:
    compare([5, 9], [5, 9], block_size=4, num_kv_heads=2, group=1, head_dim=32,
            dtype=torch.float32)


@pytest.mark.parametrize("dtype", HALF)
def test_prefill_after_cached_prefix_half_gqa4(dtype: torch.dtype) -> None:
    compare([20, 13], [7, 13], block_size=8, num_kv_heads=1, group=4, head_dim=32,
            dtype=dtype, seed=1)


@pytest.mark.parametrize("window", [3, 5, 64])
def test_prefill_sliding_windows_gqa8(window: int) -> None:
    # 3: smaller than a block; 64: larger than every sequence.
    compare([11, 18], [11, 6], window=window, block_size=4, num_kv_heads=1, group=8,
            head_dim=16, dtype=torch.float32, seed=2)


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_prefill_and_single_token_sequences(dtype: torch.dtype) -> None:
    compare([9, 6, 14], [1, 6, 1], block_size=4, num_kv_heads=2, group=2, head_dim=32,
            dtype=dtype, seed=3)


def test_head_dim_80_and_padding_tokens_not_written() -> None:
    compare([7], [7], block_size=4, num_kv_heads=1, group=2, head_dim=80, dtype=torch.float32,
            seed=4, padding=3)


@pytest.mark.parametrize("dtype,group,window", [(torch.float32, 4, None), (torch.float32, 1, 20)]
                         + [(half, 8, 3) for half in HALF])
def test_decode_split_k(dtype: torch.dtype, group: int, window: int | None) -> None:
    seq_lens = [37, 5, 64]
    q, k, v, cache, meta = scenario(seq_lens, [1, 1, 1], block_size=8, num_kv_heads=1,
                                    group=group, head_dim=32, dtype=dtype, seed=5)
    scale = 32 ** -0.5
    ref_cache = cache.clone()
    want = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, 0, scale, window)
    store_kv(k, v, cache, meta.groups[0].slot_mapping)
    for splits in (1, 3):  # one pass, and more than one split with a reduction
        got = paged_decode(q, cache, meta.groups[0].block_tables, meta.seq_lens, 64, scale,
                           window, num_splits=splits, block_n=16)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= TOL[dtype], f"splits={splits}: {err}"


def test_decode_backend_path() -> None:
    compare([30, 3], [1, 1], block_size=4, num_kv_heads=2, group=4, head_dim=16,
            dtype=torch.float32, seed=6)


@pytest.mark.parametrize("dtype,group", [(torch.float32, 1), (torch.bfloat16, 2),
                                         (torch.float16, 8)])
def test_prefill_schedule_covers_every_query_once(dtype: torch.dtype, group: int) -> None:
    query_lens = [1, 0, 37, 16, 200, 3]
    block_m = _tile_sizes(128, group, dtype)[0]
    sched = prefill_schedule(query_lens, 128, group, dtype, DEVICE)
    want = [(s, start) for s, q in enumerate(query_lens) for start in range(0, q, block_m)]
    assert sched.dtype == torch.int32 and sched.device.type == DEVICE.type
    assert list(zip(*sched.cpu().tolist())) == want
    assert prefill_schedule([], 128, group, dtype, DEVICE).shape == (2, 0)


def test_flash_attn_backend_reports_missing_package() -> None:
    pytest.importorskip("triton")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="flash-attn"):
            get_backend("flash_attn")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_of_window_null_blocks_are_never_read(backend: str) -> None:
    """Sliding-window tables hold the null block where blocks left the window; whatever the null
    block holds (NaN here) must not reach the output."""
    bs, window = 4, 6
    seq_lens, q_lens = [21, 17], [5, 1]
    q, k, v, cache, meta = scenario(seq_lens, q_lens, block_size=bs, num_kv_heads=1, group=2,
                                    head_dim=16, dtype=torch.float32, seed=8)
    want = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, 0, 0.25, window)
    tables = meta.groups[0].block_tables
    for i, (s, ql) in enumerate(zip(seq_lens, q_lens)):
        first_visible = s - ql - window + 1
        tables[i, :first_visible // bs] = 0  # the manager's nulls for blocks out of the window
    cache[:, 0] = float("nan")
    got = get_backend(backend).forward(q, k, v, cache, meta, 0, 0.25, window)
    assert not torch.isnan(got).any()
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.skipif(not CUDA, reason="model-sized shapes are too slow for the Triton interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window", [None, 1000])
def test_model_sized_shapes_on_gpu(dtype: torch.dtype, window: int | None) -> None:
    """Qwen3-0.6B's attention shape (8 KV heads x 128, GQA 2, 16-token pages): a long prefill
    after a cached prefix next to decodes of long contexts (split-K), then a decode-only step."""
    compare([3000, 2500, 4100, 70], [700, 1, 1, 70], window=window, block_size=16,
            num_kv_heads=8, group=2, head_dim=128, dtype=dtype, seed=9)
    compare([5000, 17, 2048, 4100], [1, 1, 1, 1], window=window, block_size=16, num_kv_heads=8,
            group=2, head_dim=128, dtype=dtype, seed=10)
