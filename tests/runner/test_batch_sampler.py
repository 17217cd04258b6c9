"""Batch preparation from scheduler output (stateless, and the engine's append-only
BatchBuilder), the sampler, and the byte tokenizer."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvcore.scheduler import Scheduler, SchedulerConfig
from runner.batch import BatchBuilder, PreparedBatch, StagingBuffer, prepare_batch
from runner.sampler import Sampler, SamplingParams
from runner.tokenizer import ByteTokenizer
from tests.factories import full_spec, make_manager, swa_spec


def test_prepare_batch_mixed_prefill_and_decode() -> None:
    m = make_manager(full_spec(4), swa_spec(8, 4), num_blocks=64, max_model_len=128)
    s = Scheduler(m, SchedulerConfig(max_num_batched_tokens=12))  # type: ignore[arg-type]
    a = m.make_request("a", list(range(100, 106)), max_tokens=5)  # type: ignore[attr-defined]
    b = m.make_request("b", list(range(200, 214)), max_tokens=5)  # type: ignore[attr-defined]
    s.add_request(a)
    out = s.schedule()
    s.update_from_output(out, {"a": 7})
    s.add_request(b)
    out = s.schedule()  # a decodes 1 token; b prefills 11 of 14
    batch = prepare_batch(out.scheduled, num_groups=2, block_size=4)
    assert batch.input_ids.tolist() == [7, *range(200, 211)]
    assert batch.positions.tolist() == [6, *range(11)]
    meta = batch.meta
    assert meta.cu_seqlens_q.tolist() == [0, 1, 12] and meta.seq_lens.tolist() == [7, 11]
    assert meta.query_lens_cpu == [1, 11] and meta.max_seqlen_q == 11
    for g in range(2):
        tables = [m.get_block_ids("a")[g], m.get_block_ids("b")[g]]  # type: ignore[attr-defined]
        want = [tables[0][6 // 4] * 4 + 6 % 4] + [tables[1][p // 4] * 4 + p % 4 for p in range(11)]
        assert meta.groups[g].slot_mapping.tolist() == want
        assert meta.groups[g].block_tables[1, :3].tolist() == tables[1]
    # Only `a` samples: b's chunk is not its last.
    assert [x.request_id for x in batch.sampling] == ["a"] and batch.sample_indices.tolist() == [0]


def assert_same_batch(got: PreparedBatch, want: PreparedBatch, window: dict[int, int]) -> None:
    """Equal model inputs; block tables of sliding-window groups (``window``: group -> tokens)
    may keep stale ids where the manager has the null block, but only left of the window."""
    for name in ("input_ids", "positions", "sample_indices"):
        assert getattr(got, name).cpu().tolist() == getattr(want, name).cpu().tolist(), name
    gm, wm = got.meta, want.meta
    assert gm.cu_seqlens_q.cpu().tolist() == wm.cu_seqlens_q.tolist()
    assert gm.seq_lens.cpu().tolist() == wm.seq_lens.tolist()
    assert (gm.seq_lens_cpu, gm.query_lens_cpu) == (wm.seq_lens_cpu, wm.query_lens_cpu)
    assert (gm.max_seqlen_q, gm.max_seqlen_k) == (wm.max_seqlen_q, wm.max_seqlen_k)
    assert [s.request_id for s in got.sampling] == [s.request_id for s in want.sampling]
    assert got.sample_all == (gm.is_decode_only and len(got.sampling) == len(gm.seq_lens_cpu))
    for g, (gg, wg) in enumerate(zip(gm.groups, wm.groups)):
        assert gg.slot_mapping.cpu().tolist() == wg.slot_mapping.tolist()
        gt, wt = gg.block_tables.cpu().tolist(), wg.block_tables.tolist()
        assert len(gt) == len(wt) and all(len(r) == len(wt[0]) for r in gt)
        for row, (a, b), seq_len, q_len in zip(range(len(gt)), zip(gt, wt), wm.seq_lens_cpu,
                                               wm.query_lens_cpu):
            used = -(-seq_len // 4)
            if g not in window:
                assert a[:used] == b[:used], (g, row)
                continue
            first = max(0, seq_len - q_len - window[g] + 1) // 4  # first block attention reads
            assert a[first:used] == b[first:used], (g, row)
            assert all(x == y or y == 0 for x, y in zip(a[:first], b[:first])), (g, row)


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused-buffer"])
@pytest.mark.parametrize("num_blocks", [36, 400])  # tight: preemption and recompute
def test_batch_builder_equals_prepare_batch(num_blocks: int, reuse: bool) -> None:
    """Append-only tables (new blocks only, full tables for new and resumed requests) give the
    manager's tables, through chunked prefill, prefix hits, preemption and finished requests."""
    m = make_manager(full_spec(4), swa_spec(8, 4), num_blocks=num_blocks, max_model_len=160)
    s = Scheduler(m, SchedulerConfig(max_num_seqs=6,  # type: ignore[arg-type]
                                     max_num_batched_tokens=24))
    # A reused staging buffer (as on CUDA, without pinned memory here), sized too small at
    # first: it grows.
    builder = BatchBuilder(2, 4, "cpu", max_num_batched_tokens=24 if not reuse else 2,
                           max_num_seqs=6 if not reuse else 1, max_model_len=160, reuse=reuse)
    assert builder.staging.reuse == reuse
    rng = random.Random(num_blocks)
    system = list(range(1, 21))
    for wave in range(3):  # later waves hit blocks the earlier ones cached
        reqs = [m.make_request(  # type: ignore[attr-defined]
            f"{wave}-{i}", system[:rng.randint(0, 20)] + [rng.randrange(500) for _ in
                                                         range(rng.randint(1, 40))],
            max_tokens=rng.randint(1, 30), ignore_eos=True) for i in range(8)]
        s.add_requests(reqs)
        while s.has_unfinished_requests():
            out = s.schedule()
            got = builder.prepare(out)
            assert_same_batch(got, prepare_batch(out.scheduled, 2, 4), {1: 8})
            s.update_from_output(out, {x.request_id: rng.randrange(500) for x in got.sampling})
    assert (s.stats.num_preemptions > 0) == (num_blocks == 36)
    builder.release_finished(s.schedule())  # the last finished requests: rows released
    assert all(not t.row_of for t in builder.tables)


def test_staging_buffer_without_pinned_memory_makes_private_tensors() -> None:
    st = StagingBuffer("cpu")
    assert not st.reuse and not st.pinned
    st.begin()
    a = st.array(3, "int64")
    a[:] = [1, 2, 3]
    b = st.array((2, 2), "int32")
    b[:] = 7
    ta, tb = st.upload()
    assert ta.tolist() == [1, 2, 3] and tb.dtype == torch.int32 and tb.tolist() == [[7, 7]] * 2
    st.begin()
    st.array(3, "int64")[:] = 0
    st.upload()
    assert ta.tolist() == [1, 2, 3]  # not overwritten by the next step


def test_reused_staging_buffer_packs_aligned_views_and_grows() -> None:
    st = StagingBuffer("cpu", nbytes=64, reuse=True)
    assert st.reuse and not st.pinned and st.capacity == 64
    st.begin(st.nbytes_for([np.zeros(3, np.int64), np.zeros((2, 5), np.int32)]))
    a, b, _ = st.array(3, np.int64), st.array((2, 5), np.int32), st.array(0, np.float32)
    a[:] = [4, 5, 6]
    b[:] = np.arange(10).reshape(2, 5)
    ta, tb, tc = st.upload()
    assert ta.tolist() == [4, 5, 6] and tb.tolist() == [list(range(5)), list(range(5, 10))]
    assert tc.shape == (0,) and tb.data_ptr() % 64 == 0
    st.begin()
    big = st.array(1000, np.int64)  # the first array of a step may grow the buffers
    big[:] = 1
    (tbig,) = st.upload()
    assert int(tbig.sum()) == 1000 and st.capacity >= 8000
    st.begin(8)
    st.array(1, np.int64)
    with pytest.raises(RuntimeError, match="too small a bound"):
        st.array(10_000, np.int64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staging_on_cuda_equals_prepare_batch() -> None:
    m = make_manager(full_spec(4), swa_spec(8, 4), num_blocks=200, max_model_len=128)
    s = Scheduler(m, SchedulerConfig(max_num_seqs=4,  # type: ignore[arg-type]
                                     max_num_batched_tokens=16))
    builder = BatchBuilder(2, 4, "cuda", max_num_batched_tokens=16, max_num_seqs=4,
                           max_model_len=128)
    assert builder.staging.pinned
    rng = random.Random(0)
    s.add_requests([m.make_request(str(i), [rng.randrange(100) for _ in  # type: ignore[attr-defined]
                                            range(rng.randint(1, 30))], max_tokens=12,
                                   ignore_eos=True) for i in range(6)])
    while s.has_unfinished_requests():
        out = s.schedule()
        got = builder.prepare(out)
        assert got.input_ids.device.type == "cuda"
        assert_same_batch(got, prepare_batch(out.scheduled, 2, 4), {1: 8})
        s.update_from_output(out, {x.request_id: 1 for x in got.sampling})


def test_greedy_and_seeded_sampling_are_reproducible() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = SamplingParams(temperature=0.0)
    s = Sampler(seed=1)
    assert s(logits, [greedy] * 3, ["a", "b", "c"]).tolist() == logits.argmax(-1).tolist()
    seeded = SamplingParams(temperature=1.0, seed=42)
    first = [Sampler(seed=i)(logits[:1], [seeded], ["x"]).item() for i in range(3)]
    assert len(set(first)) == 1  # the request's own seed decides, not the engine's
    # A seeded request samples the same token whatever else shares the batch.
    alone = Sampler(seed=5)(logits[1:2], [seeded], ["r"]).item()
    mixed = Sampler(seed=9)(logits, [SamplingParams(), seeded, greedy], ["p", "r", "q"])
    assert mixed[1].item() == alone and mixed[2].item() == logits[2].argmax().item()


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]]).repeat(200, 1)
    s = Sampler(seed=0)
    top1 = s(logits, [SamplingParams(top_k=1)] * 200, [f"r{i}" for i in range(200)])
    assert set(top1.tolist()) == {0}
    top2 = s(logits, [SamplingParams(top_k=2)] * 200, [f"r{i}" for i in range(200)])
    assert set(top2.tolist()) == {0, 1}
    nucleus = s(logits, [SamplingParams(top_p=0.7)] * 200, [f"r{i}" for i in range(200)])
    assert set(nucleus.tolist()) <= {0, 1} and 0 in nucleus.tolist()
    free = s(logits, [SamplingParams(temperature=5.0)] * 200, [f"r{i}" for i in range(200)])
    assert len(set(free.tolist())) >= 4


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2},
                                    {"max_tokens": 0}])
def test_bad_sampling_params(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_token_id and all(0 <= t < 256 for t in ids[1:])
    assert tok.decode(ids) == "héllo"
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=False) == "<s>héllo</s>"


@pytest.mark.parametrize("num_tokens,max_len", [(100, 32), (64, 64), (10, 1024)])
def test_warmup_batch_stays_within_max_model_len(num_tokens: int, max_len: int) -> None:
    """The GPU profiling forward: the whole token budget, no position beyond max_model_len, every
    token in its own slot of a real (non-null) block, and the torch backend can run it."""
    from runner.attention import TorchAttentionBackend
    from runner.model_runner import warmup_inputs

    inputs, num_blocks = warmup_inputs(num_tokens, max_len, 8, 2, torch.device("cpu"))
    meta = inputs.meta
    assert inputs.input_ids.shape[0] == num_tokens == sum(meta.query_lens_cpu)
    assert int(inputs.positions.max()) < max_len and meta.max_seqlen_k <= max_len
    for g in meta.groups:
        slots = g.slot_mapping.tolist()
        assert len(set(slots)) == num_tokens and min(slots) >= 8  # block 0 untouched
        assert max(slots) < num_blocks * 8
    cache = torch.zeros(2, num_blocks, 8, 1, 4)
    q = torch.randn(num_tokens, 2, 4)
    kv = torch.randn(num_tokens, 1, 4)
    out = TorchAttentionBackend().forward(q, kv, kv, cache, meta, 0, 0.5)
    assert out.shape == q.shape and not out.isnan().any()
