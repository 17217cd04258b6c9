"""The engine publishes its KV events (LLM(kv_events=ENDPOINT)) through kvcore's publisher: what
a subscriber decodes are the cache's own events, stamped with the group's spec, in vLLM's wire
format."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from kvcore.errors import InvalidArgumentError
from kvcore.events import BlockStored, decode_event_batch
from kvcore.events.publisher import external_hash
from runner.engine import LLM
from runner.sampler import SamplingParams
from tests.runner.test_engine import save_hf


def test_the_engine_publishes_its_kv_events(tmp_path: Path) -> None:
    save_hf("llama", tmp_path)
    llm = LLM(tmp_path, block_size=4, num_blocks=64, kv_events="tcp://*:*")  # binds a free port
    endpoint = llm.kv_events_endpoint
    assert endpoint is not None
    port = int(endpoint.rsplit(":", 1)[1])
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        sub.poll(500)  # let the subscription reach the PUB before anything is sent
        shared = list(range(1, 13))
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outs = llm.generate([[*shared, 20, 21], [*shared, 30, 31]], params, use_tqdm=False)
        assert outs[1].num_cached_tokens == 12
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(stored) < 3:
            if sub.poll(200):
                frames = sub.recv_multipart()
                batch = decode_event_batch(frames[-1])
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
        hashes = {h for e in stored for h in e.block_hashes}
        # The shared prefix's three full blocks were stored (by the first request) and every
        # event names its group's kind, as vLLM publishes it.
        first = llm.manager.make_request("probe", [*shared, 20, 21])
        assert {external_hash(h, True) for h in first.block_hashes[:3]} <= hashes  # vLLM's ints
        assert {e.kv_cache_spec_kind for e in stored} == {"full_attention"}
        assert all(e.medium == "GPU" for e in stored)
    finally:
        sub.close(linger=0)
        llm.close()


def test_a_bad_endpoint_fails_before_the_model_loads(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="endpoint"):
        LLM(tmp_path / "missing", kv_events="not-an-endpoint")
