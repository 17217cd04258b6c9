"""The device-side sampler (bounded candidates + Gumbel-max, no vocabulary sort) is exact.

Over many draws on a small vocabulary, each path's empirical distribution matches
``softmax(logits / T)`` restricted to top-k / top-p, computed independently in float64: the
unrestricted full-vocabulary path, the candidate path (top-k, top-p, both), the exact fallback
when the candidates hold less than top-p of the mass, and mixed batches that route rows to all
of them at once.  Greedy rows (and temperatures below 1e-5) are argmax; seeded rows are
reproducible and do not depend on the batch; ``top_p=1, top_k=0`` is unrestricted.  Runs on the
CPU, and on the GPU too where there is one.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from runner.batch import StagingBuffer
from runner.sampler import Sampler, SamplingParams, sample_exact

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.7, 0.5, 0.0, -0.3, -1.0, -1.2, -2.0, -3.0])
DRAWS = 30_000


def expected(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """The target distribution in float64, by the definition (sort, top-k, renormalise, keep
    ranks while the mass strictly before them is below top_p, renormalise)."""
    x = logits.double().numpy()
    if p.temperature < 1e-5:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    order = np.argsort(-x, kind="stable")
    probs = np.exp((x[order] - x.max()) / p.temperature)
    k = p.top_k if 0 < p.top_k < len(x) else len(x)
    probs[k:] = 0.0
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    if p.top_p < 1.0:
        probs[1:][before[1:] >= p.top_p] = 0.0
    probs /= probs.sum()
    out = np.zeros_like(x)
    out[order] = probs
    return out


def assert_matches(tokens: torch.Tensor, want: np.ndarray, what: str) -> None:
    counts = np.bincount(tokens.cpu().numpy(), minlength=len(want)).astype(np.float64)
    n = counts.sum()
    freq = counts / n
    outside = counts[want == 0].sum()
    assert outside == 0, f"{what}: {int(outside)} draws outside the support {np.nonzero(want)}"
    # Five standard deviations per token (plus a little slack): a false alarm is ~1e-6 per token.
    tol = 5 * np.sqrt(want * (1 - want) / n) + 2e-3
    bad = np.abs(freq - want) > tol
    assert not bad.any(), f"{what}: freq {np.round(freq, 4)} vs want {np.round(want, 4)}"


def draw(sampler: Sampler, p: SamplingParams, device: str, n: int = DRAWS,
         logits: torch.Tensor = LOGITS) -> torch.Tensor:
    rows = logits.to(device).repeat(n, 1)
    return sampler(rows, [p] * n, [f"r{i}" for i in range(n)])


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.5),
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.5, top_k=6, top_p=0.75),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.05),  # only the best token
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_distribution_matches_restricted_softmax(device: str, p: SamplingParams) -> None:
    tokens = draw(Sampler(seed=1, device=device), p, device)
    assert tokens.device.type == "cpu" and tokens.dtype == torch.int64
    assert_matches(tokens, expected(LOGITS, p), str(p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.97])
def test_top_p_beyond_the_candidates_falls_back_to_the_exact_path(device: str,
                                                                   top_p: float) -> None:
    """With 2 candidates only, a nucleus of more than 2 tokens needs the exact path: still the
    right distribution, and rows whose 2 best tokens hold top_p stay on the fast path."""
    sampler = Sampler(seed=2, device=device, candidates=2)
    p = SamplingParams(temperature=1.2, top_p=top_p)
    tokens = draw(sampler, p, device)
    assert_matches(tokens, expected(LOGITS, p), str(p))
    two_best = expected(LOGITS, SamplingParams(temperature=1.2))[:2].sum()
    assert (sampler.num_exact_rows == DRAWS) == (two_best < top_p)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_routes_every_row_correctly(device: str) -> None:
    """Greedy, tiny-temperature, unrestricted (two temperatures), top-k, top-p (some beyond the
    candidates) and seeded rows interleaved in one batch: each kind keeps its distribution.
    (The per-row parameters go through a reused staging buffer, as on CUDA.)"""
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7),
             SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
             SamplingParams(temperature=0.9, top_k=4), SamplingParams(top_p=0.7),
             SamplingParams(temperature=1.4, top_p=0.95),
             SamplingParams(temperature=1.1, top_k=5, top_p=0.8),
             SamplingParams(temperature=0.9, top_k=3, seed=5)]
    reps = 4_000
    logits = torch.stack([LOGITS + 0.01 * i for i in range(len(kinds))])  # distinct rows
    batch = logits.to(device).repeat(reps, 1)
    # Seeded rows: one seed each (rows with the same seed and logits draw the same token).
    params = [SamplingParams(temperature=0.9, top_k=3, seed=r) if p.seed is not None else p
              for r in range(reps) for p in kinds]
    sampler = Sampler(seed=3, device=device, candidates=3)
    sampler._staging = StagingBuffer(device, 64, reuse=True)  # tiny: it grows
    tokens = sampler(batch, params, [f"r{i}" for i in range(len(params))])
    for j, p in enumerate(kinds):
        assert_matches(tokens[j::len(kinds)], expected(logits[j], p), f"row kind {j}: {p}")
    assert sampler.num_exact_rows > 0  # top_p=0.95 needs more than 3 candidates


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_are_argmax_even_at_tiny_temperatures(device: str) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(64, 1000) * 30).to(device)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-6, 9e-6, 0.0)] * 16
    tokens = Sampler(seed=0, device=device)(logits, params, [str(i) for i in range(64)])
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy
    # The smallest temperature that samples: no overflow, no NaN, a valid token.
    hot = Sampler(seed=0, device=device)(logits, [SamplingParams(temperature=1e-5)] * 64,
                                         [str(i) for i in range(64)])
    assert hot.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_are_reproducible_and_batch_independent(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 500).to(device)
    seeded = [SamplingParams(temperature=1.0, seed=7), SamplingParams(top_k=20, seed=8),
              SamplingParams(top_p=0.9, seed=9), SamplingParams(top_p=0.999, seed=10)]

    def run(engine_seed: int, companions: list[SamplingParams], steps: int = 5,
            candidates: int = 64) -> list[list[int]]:
        s = Sampler(seed=engine_seed, device=device, candidates=candidates)
        out = []
        for _ in range(steps):
            rows = [logits[:4]] + [logits[4:5]] * len(companions)
            params = seeded + companions
            rids = ["a", "b", "c", "d"] + [f"x{i}" for i in range(len(companions))]
            out.append(s(torch.cat(rows), params, rids)[:4].tolist())
        return out

    alone = run(0, [])
    assert run(0, []) == alone
    # Other engine seeds and companions with other kinds and larger candidate sets (top_k=300).
    assert run(5, [SamplingParams(top_k=300), SamplingParams(temperature=0.0)]) == alone
    assert run(9, [SamplingParams(top_p=0.5), SamplingParams(temperature=2.0, top_k=2)]) == alone
    assert len({tuple(step) for step in alone}) > 1  # the generators advance step to step


@pytest.mark.parametrize("device", DEVICES)
def test_unrestricted_means_top_p_1_and_top_k_0_or_vocab(device: str) -> None:
    for p in (SamplingParams(temperature=1.7), SamplingParams(temperature=1.7, top_k=-1),
              SamplingParams(temperature=1.7, top_k=VOCAB), SamplingParams(temperature=1.7,
                                                                        top_k=10 * VOCAB)):
        tokens = draw(Sampler(seed=4, device=device), p, device)
        assert_matches(tokens, expected(LOGITS, SamplingParams(temperature=1.7)), str(p))
        assert set(tokens.tolist()) == set(range(VOCAB))


@pytest.mark.parametrize("device", DEVICES)
def test_exact_reference_path_matches_the_definition(device: str) -> None:
    p = SamplingParams(temperature=0.9, top_k=8, top_p=0.85)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    rows = LOGITS.to(device).repeat(DRAWS, 1)
    assert_matches(sample_exact(rows, [p] * DRAWS, gen), expected(LOGITS, p), "sample_exact")


def test_results_do_not_alias_between_calls() -> None:
    s = Sampler(seed=0)
    logits = torch.randn(4, 50)
    first = s(logits, [SamplingParams(temperature=0.0)] * 4, list("abcd"))
    keep = first.clone()
    s(-logits, [SamplingParams(temperature=0.0)] * 4, list("abcd"))
    assert torch.equal(first, keep)


def test_sample_marks_rows_for_the_exact_path_without_waiting() -> None:
    """``sample`` leaves -1 where the candidates hold too little mass; ``__call__`` fills them."""
    flat = torch.zeros(3, 40)  # uniform: 4 candidates hold 10% of the mass
    s = Sampler(seed=0, candidates=4)
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.05), SamplingParams(top_k=4)]
    marked = s.sample(flat, params, ["a", "b", "c"])
    assert marked[0].item() == -1 and marked[1].item() >= 0 and marked[2].item() >= 0
    tokens = s(flat, params, ["a", "b", "c"])
    assert (tokens >= 0).all() and s.num_exact_rows == 1


@pytest.fixture
def no_sync_warnings() -> Iterator[list[warnings.WarningMessage]]:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_sampling_does_not_synchronise(
        no_sync_warnings: list[warnings.WarningMessage]) -> None:
    logits = torch.randn(32, 5000, device="cuda")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(top_k=50), SamplingParams(top_p=0.9, seed=3)] * 8
    s = Sampler(seed=0, device="cuda")
    s.sample(logits, params, [str(i) for i in range(32)])  # warm-up (allocations)
    torch.cuda.synchronize()  # (outside the checked region) the warm-up's copies are done
    no_sync_warnings.clear()
    s.sample(logits, params, [str(i) for i in range(32)])
    syncs = [str(w.message) for w in no_sync_warnings if "synchroniz" in str(w.message)]
    assert not syncs, syncs


def test_candidate_cap_is_checked() -> None:
    with pytest.raises(ValueError):
        Sampler(candidates=0)
    assert math.isclose(expected(LOGITS, SamplingParams(top_p=0.3)).sum(), 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_waits_for_the_gpu_at_most_once_per_step(
        no_sync_warnings: list[warnings.WarningMessage]) -> None:
    """Prefill and graph-replayed decode steps, several sampling kinds: the host waits once a
    step, when the sampled tokens come back (torch's sync debug mode lists every wait)."""
    import transformers

    from runner.engine import LLM

    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   vocab_size=1000, max_position_embeddings=1024)
    torch.cuda.set_sync_debug_mode("default")
    llm = LLM(cfg, device="cuda", backend="triton", num_blocks=512, max_model_len=512, seed=0,
              max_num_seqs=16)
    ps = [[(7 * i + j) % 1000 for j in range(20 + 9 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(top_k=40, top_p=0.95, max_tokens=16, ignore_eos=True, seed=1)] * 4
    llm.generate(ps, params, use_tqdm=False)  # warm-up: kernels, buffers, graphs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    no_sync_warnings.clear()
    steps0 = llm.scheduler.stats.steps
    llm.generate([p[::-1] for p in ps], params, use_tqdm=False)
    steps = llm.scheduler.stats.steps - steps0
    syncs = [str(w.message) for w in no_sync_warnings if "synchroniz" in str(w.message)]
    assert len(syncs) <= steps, (steps, syncs[:5])
