"""The engine on a CUDA device: decode steps replayed from CUDA graphs give the same tokens as
eager decoding and as the torch reference backend; KV memory sized by profiling; prefix caching
and a hybrid sliding-window model on the GPU.  Skipped without CUDA (CPU coverage of the same
engine is in test_engine.py)."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

from runner.engine import LLM
from runner.sampler import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(autouse=True)
def release_gpu_memory() -> Iterator[None]:
    """Engines of earlier tests must not count as used memory when a test profiles."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def qwen3(**kw: Any) -> Any:
    return transformers.Qwen3Config(**{
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
        "max_position_embeddings": 1024, **kw})


def prompts(n: int, seed: int, lo: int = 5, hi: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(cfg: Any, ps: list[list[int]], **kw: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(cfg, device="cuda", dtype=torch.float32, seed=7, block_size=16,
              max_model_len=512, **kw)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    llm.manager.check_invariants()
    return [o.token_ids for o in outs], llm


def count_replays(llm: LLM) -> list[int]:
    """Wrap the runner's graph replay so the test can see it was used."""
    calls = [0]
    replay = llm.runner._replay

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return replay(*args)

    llm.runner._replay = counted  # type: ignore[method-assign]
    return calls


def test_cuda_graph_decode_equals_eager_and_reference() -> None:
    ps = prompts(12, seed=0)
    graphs = LLM(qwen3(), device="cuda", dtype=torch.float32, seed=7, block_size=16,
                 max_model_len=512, backend="triton", num_blocks=2048, max_num_seqs=16)
    assert graphs.runner._graphs, "no decode graphs were captured"
    replays = count_replays(graphs)
    got = [o.token_ids for o in graphs.generate(ps, GREEDY, use_tqdm=False)]
    assert replays[0] >= GREEDY.max_tokens - 1  # decode steps really replayed graphs
    eager, _ = run(qwen3(), ps, backend="triton", num_blocks=2048, max_num_seqs=16,
                   enforce_eager=True)
    ref, _ = run(qwen3(), ps, backend="torch", num_blocks=2048, max_num_seqs=16)
    assert got == eager
    assert got == ref


def test_async_scheduling_on_gpu_equals_synchronous_with_graphs_and_preemption() -> None:
    """Placeholders filled on the device, CUDA-graph decode, a tight pool (preemption) and
    seeded sampling: the same tokens as the synchronous engine."""
    ps = prompts(24, seed=4, lo=20, hi=120)
    seeded = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i, max_tokens=24)
              for i in range(len(ps))]
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(qwen3(), device="cuda", dtype=torch.float32, seed=7, block_size=16,
                  max_model_len=512, backend="triton", num_blocks=48, max_num_seqs=16,
                  max_num_batched_tokens=256, async_scheduling=async_scheduling)
        assert llm.runner._graphs and llm.async_scheduling is async_scheduling
        replays = count_replays(llm)
        greedy = llm.generate(ps, GREEDY, use_tqdm=False)
        sampled = llm.generate(ps, seeded, use_tqdm=False)
        assert replays[0] > 0 and llm.scheduler.stats.num_preemptions > 0
        llm.manager.check_invariants()
        outs.append(([o.token_ids for o in greedy], [o.token_ids for o in sampled]))
    assert outs[0] == outs[1]


def test_profiled_kv_memory_respects_utilization() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    llm = LLM(qwen3(), device="cuda", backend="triton", gpu_memory_utilization=0.25,
              max_num_batched_tokens=1024, max_model_len=512, max_num_seqs=8)
    assert llm.runner.num_blocks > 1000
    kv_bytes = sum(c.numel() * c.element_size() for c in llm.runner.caches)
    assert kv_bytes == llm.runner.num_blocks * llm.runner.block_bytes()
    assert torch.cuda.memory_allocated() <= 0.25 * total
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_prefix_caching_on_gpu_hits_and_keeps_outputs() -> None:
    system = list(range(100, 260))
    ps = [system + p for p in prompts(6, seed=1, hi=40)]
    off, _ = run(qwen3(), ps, backend="triton", num_blocks=1024, enable_prefix_caching=False)
    llm = LLM(qwen3(), device="cuda", dtype=torch.float32, seed=7, block_size=16,
              max_model_len=512, backend="triton", num_blocks=1024)
    first = llm.generate(ps[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(ps[1:], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == off
    assert all(o.num_cached_tokens >= 160 for o in rest)


def test_hybrid_sliding_window_model_and_preemption_on_gpu() -> None:
    cfg = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2,
                                   vocab_size=1000, max_position_embeddings=1024,
                                   use_sliding_window=True, sliding_window=48,
                                   max_window_layers=2)
    ps = prompts(8, seed=2, lo=60, hi=150)
    ref, _ = run(cfg, ps, backend="torch", num_blocks=2048)
    got, llm = run(cfg, ps, backend="triton", num_blocks=2048)
    assert [type(g.spec).__name__ for g in llm.kv_config.groups] == [
        "FullAttentionSpec", "SlidingWindowSpec"]
    assert got == ref
    tight, tight_llm = run(cfg, ps, backend="triton", num_blocks=40, max_num_batched_tokens=256)
    assert tight_llm.scheduler.stats.num_preemptions > 0
    assert tight == ref


def test_bf16_engine_runs_graphs_and_stays_close_to_reference() -> None:
    """In bf16 the two backends round differently, so long greedy continuations may part after
    a near-tie: require the first sampled tokens to agree (allowing one near-tie), and that
    bf16 decoding replays graphs."""
    ps = prompts(4, seed=3)
    outs = []
    for backend in ("torch", "triton"):
        llm = LLM(qwen3(), device="cuda", dtype=torch.bfloat16, seed=7, block_size=16,
                  max_model_len=512, backend=backend, num_blocks=512)
        outs.append(llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=1),
                                 use_tqdm=False))
        if backend == "triton":
            assert llm.runner._graphs
            replays = count_replays(llm)
            llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
            assert replays[0] > 0
    agree = sum(a.token_ids == b.token_ids for a, b in zip(*outs))
    assert agree >= 3, "bf16 triton and torch backends disagree on most first tokens"
