"""Batch preparation from scheduler output, the sampler, and the byte tokenizer."""

from __future__ import annotations

import pytest
import torch

from kvcore.scheduler import Scheduler, SchedulerConfig
from runner.batch import prepare_batch
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
