"""The benchmark's peer decode kernels read kvcore's pages correctly: FlexAttention over the
engine's KV tensor and block tables equals the torch reference backend (shuffled pages, partial
last pages, GQA).  FlashInfer is not installable here; its column runs only where it is."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from runner.attention import AttentionMetadata, GroupMetadata, get_backend
from runner.peer_kernels import build_peer, flex_decode


def paged_case(lens: list[int], kv_heads: int = 2, group: int = 3, head_dim: int = 16,
               block_size: int = 16, seed: int = 0, q_len: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3  # spare pages nobody owns
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g)[:len(lens) * width] + 1
    tables = perm.view(len(lens), width).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    n = len(lens) * q_len
    q = torch.randn(n, kv_heads * group, head_dim, generator=g)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32) * q_len, seq_lens,
                             q_len, max(lens), [GroupMetadata(torch.full((n,), -1), tables)],
                             list(lens), [q_len] * len(lens))
    k_new = torch.zeros(n, kv_heads, head_dim)  # slot -1: nothing is written
    want = get_backend("torch").forward(q, k_new, k_new, cache, meta, 0, head_dim ** -0.5)
    return cache, tables, seq_lens, q, want


def test_flex_eager_reads_exactly_each_sequences_pages() -> None:
    cache, tables, seq_lens, q, want = paged_case([40, 17, 1, 64, 33])
    got = flex_decode(cache, tables, seq_lens, 16 ** -0.5, compile=False)(q)
    assert (got - want).abs().max().item() < 1e-5


def test_flex_compiled_kernel_uses_the_block_mask() -> None:
    """The fused kernel visits only the pages the block mask lists (torch.compile on CPU)."""
    cache, tables, seq_lens, q, want = paged_case([40, 17, 33], group=2, seed=1)
    got = build_peer("flex", cache, tables, seq_lens, 16 ** -0.5, num_heads=q.shape[1])(q)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_causal_prefill_over_pages(compiled: bool) -> None:
    """Each sequence's last 20 tokens attend causally to its whole paged context."""
    cache, tables, seq_lens, q, want = paged_case([40, 20, 57], q_len=20, seed=2)
    got = flex_decode(cache, tables, seq_lens, 16 ** -0.5, compile=compiled, q_len=20)(q)
    assert (got - want).abs().max().item() < 1e-5


def test_unknown_or_missing_peer_is_refused() -> None:
    cache, tables, seq_lens, _, _ = paged_case([5])
    with pytest.raises(ValueError, match="unknown peer kernel"):
        build_peer("nope", cache, tables, seq_lens, 1.0, num_heads=6)
    if importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(ImportError):
            build_peer("flashinfer", cache, tables, seq_lens, 1.0, num_heads=6)


@pytest.mark.parametrize("lens,q_len", [([40, 40, 40], 1), ([40, 17, 1, 64], 1),
                                        ([24, 24], 24), ([40, 20, 57], 20)],
                         ids=["equal", "ragged", "causal", "causal-ragged"])
def test_sdpa_on_contiguous_kv_equals_the_reference(lens: list[int], q_len: int) -> None:
    """The no-paging peer: the same K/V gathered into contiguous tensors, masked only when the
    lengths differ (or the queries are not the whole context)."""
    cache, tables, seq_lens, q, want = paged_case(lens, q_len=q_len, seed=3)
    got = build_peer("sdpa", cache, tables, seq_lens, 16 ** -0.5, num_heads=q.shape[1],
                     q_len=q_len)(q)
    assert (got - want).abs().max().item() < 1e-5


def test_flex_compiles_each_shape_once_past_the_recompile_limit() -> None:
    """One compiled build per shape, more shapes than dynamo's recompile limit: every build
    still runs the compiled kernel (no fallback, no error) and matches the reference, and
    each compiled once (its own code object, so its own cache)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    shapes = [[9], [17, 4], [33, 2, 8], [40, 17, 33]]
    old = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 2  # fewer than the shapes
    try:
        torch._dynamo.reset()
        counters.clear()
        for i, lens in enumerate(shapes):
            cache, tables, seq_lens, q, want = paged_case(lens, group=2, seed=10 + i)
            decode = build_peer("flex", cache, tables, seq_lens, 16 ** -0.5,
                                num_heads=q.shape[1])
            for _ in range(2):  # a second call reuses the compiled kernel
                assert (decode(q) - want).abs().max().item() < 1e-5
        # One graph per shape (one shared compiled function stops at the limit, then runs
        # flex eagerly: 3 graphs here).
        assert counters["stats"]["unique_graphs"] == len(shapes)
    finally:
        torch._dynamo.config.cache_size_limit = old
        torch._dynamo.reset()
