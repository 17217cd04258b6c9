"""The no-model replay through SGLang's scheduling pieces: its JSON (a ``results`` list, one
entry per engine with ``engine`` and ``hit_rate``), SGLang's and kvcore's engines side by side
on one workload, both schedule policies; admission is SGLang's ``PrefillAdder`` (every decision
its answer, its budget stopping admission where SGLang's rule says, the same decisions over
either cache while nothing is evicted), and pages are conserved through whole runs with both
engines, retractions included."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvcore.integrations.sglang import replay as replay_mod
from kvcore.integrations.sglang.replay import Replay, main, parser
from kvcore.sim.traces import TraceRequest

pytestmark = pytest.mark.usefixtures("sglang_context")


@pytest.mark.parametrize(("policy", "engines"), [
    ("fcfs", ["sglang:lru", "sglang:lfu", "kvcore:lru", "kvcore:recommended"]),
    ("lpm", ["sglang:lru", "kvcore:lru"]),
])
def test_replay_json(policy: str, engines: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shared-prefix", "--block-size", "16", "--num-blocks", "160",
                 "--max-requests", "40", "--schedule-policy", policy,
                 "--engines", ",".join(engines), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    results = {r["engine"]: r for r in out["results"]}
    assert list(results) == engines
    for r in results.values():
        assert 0.0 < r["hit_rate"] < 1.0
        assert r["finished"] == 40 and r["evicted_tokens"] > 0  # under memory pressure
        assert r["refused"] == r["aborted"] == 0
        assert r["hit_rate"] == pytest.approx(r["hit_tokens"] / r["prompt_tokens"])
    # Page-exact eviction keeps at least what SGLang's leaf eviction keeps, on this workload.
    assert results["kvcore:lru"]["hit_rate"] >= results["sglang:lru"]["hit_rate"] - 0.01


def test_replay_refuses_an_unknown_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shared-prefix", "--max-requests", "4", "--engines", "vllm"]) == 2
    assert "sglang:POLICY or kvcore:POLICY" in capsys.readouterr().err


def _requests(n: int, prompt: int, output: int, *, shared: int = 0,
              seed: int = 0) -> list[TraceRequest]:
    """``n`` requests of ``prompt`` tokens (the first ``shared`` common to all, the rest
    random) and ``output`` output tokens."""
    rng = random.Random(seed)
    head = tuple(rng.randrange(1, 30_000) for _ in range(shared))
    return [TraceRequest(f"r{i}", 0.0, prompt, output,
                         prompt=head + tuple(rng.randrange(1, 30_000)
                                             for _ in range(prompt - shared)))
            for i in range(n)]


def _replay(engine: str, requests: list[TraceRequest], *argv: str) -> Replay:
    return Replay(engine, requests, parser().parse_args(["unused", *argv]))


class _Recorder:
    """Records every PrefillAdder the replay builds and what each of its calls answered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from sglang.srt.managers import schedule_policy

        self.adders: list[Any] = []
        recorder = self

        class Recording(schedule_policy.PrefillAdder):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.calls: list[tuple[str, str, Any]] = []
                recorder.adders.append(self)

            def add_chunked_req(self, req: Any) -> Any:
                out = super().add_chunked_req(req)
                self.calls.append(("chunked", req.rid, out))
                return out

            def add_one_req(self, req: Any, has_chunked_req: bool,
                            truncation_align_size: int | None) -> Any:
                out = super().add_one_req(req, has_chunked_req, truncation_align_size)
                self.calls.append(("one", req.rid, out))
                return out

        monkeypatch.setattr(schedule_policy, "PrefillAdder", Recording)


@pytest.mark.parametrize("engine", ["sglang:lru", "kvcore:lru"])
def test_admission_is_prefill_adders(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's prefill batch is PrefillAdder's ``can_run_list``: the chunked request asked
    first, then the waiting requests in the policy's order, each admitted while the previous
    answer was CONTINUE, none asked after a stop."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    recorder = _Recorder(monkeypatch)
    rp = _replay(engine, _requests(24, 300, 40, shared=128), "--block-size", "16",
                 "--num-blocks", "120", "--chunk-size", "512", "--schedule-policy", "lpm")
    sorted_queues: list[list[str]] = []
    calc_priority = rp.policy.calc_priority

    def recording_calc_priority(waiting: list[Any], *args: Any, **kwargs: Any) -> None:
        calc_priority(waiting, *args, **kwargs)
        sorted_queues.append([r.rid for r in waiting])

    monkeypatch.setattr(rp.policy, "calc_priority", recording_calc_priority)
    chunked_steps = 0
    while rp.busy():
        before = len(recorder.adders)
        chunked = rp.chunked
        batch = rp.step()
        if len(recorder.adders) == before:
            assert not batch  # no adder, no prefill
            continue
        adder = recorder.adders[-1]
        assert [r.rid for r in batch] == [r.rid for r in adder.can_run_list]
        calls = adder.calls
        if chunked is not None:
            assert calls[0][:2] == ("chunked", chunked.rid)
            chunked_steps += 1
            calls = calls[1:]
        asked = [rid for _, rid, _ in calls]
        assert asked == sorted_queues[-1][:len(asked)]  # the policy's order, none skipped
        for _, _, answer in calls[:-1]:
            assert answer == AddReqResult.CONTINUE
        one = {r.rid for r in batch if chunked is None or r.rid != chunked.rid}
        assert one <= set(asked)
    assert chunked_steps > 0 and rp.finished == 24
    assert rp.hit_tokens > 0


@pytest.mark.parametrize("engine", ["sglang:lru", "kvcore:lru", "kvcore:s3fifo"])
def test_budget_stops_admission(engine: str) -> None:
    """SGLang's rule by hand: each admission of a 200-token prompt with 50 new tokens reserves
    208 (the paged prompt) + 16 (a page) + 50 tokens and needs 200 + 50 + 16 < what is left.
    A pool of 800 tokens fits two (266 < 800, 266 < 526, not 266 < 252); the third waits and
    the batch is full."""
    rp = _replay(engine, _requests(5, 200, 50), "--block-size", "16", "--num-blocks", "50")
    batch = rp.step()
    assert [r.rid for r in batch] == ["r0", "r1"]
    assert rp.batch.batch_is_full and len(rp.waiting) == 3
    assert rp.prompt_tokens == 400 and rp.hit_tokens == 0
    # The step's chunk budget stops it too: 300 tokens take r0 whole (208 paged) and the next
    # 80 tokens of r1 (92 left, whole pages), which becomes the chunked request; nothing more.
    rp = _replay(engine, _requests(5, 200, 50), "--block-size", "16", "--num-blocks", "400",
                 "--chunk-size", "300")
    batch = rp.step()
    assert [r.rid for r in batch] == ["r0", "r1"]
    assert rp.chunked is batch[1] and rp.chunked.extend_end == 80
    assert not rp.batch.batch_is_full and len(rp.waiting) == 3
    # Next step the chunked request continues first (its last 120 tokens, 128 paged), and the
    # 172 tokens left take whole pages of r2 (160), the new chunked request.
    batch = rp.step()
    assert [r.rid for r in batch] == ["r1", "r2"]
    assert [r.rid for r in rp.batch.reqs] == ["r0", "r1"]
    assert rp.chunked is batch[1] and rp.chunked.extend_end == 160


def _owned_pages(req: Any, page_size: int) -> int:
    """Pages of the request's row beyond its cached (protected) prefix: its own."""
    if not req.kv.holds_kv:
        return 0
    own = req.kv.kv_allocated_len - req.kv.cache_protected_len
    return -(-own // page_size)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("engine", ["sglang:lru", "kvcore:lru", "kvcore:recommended"])
def test_pages_are_conserved(engine: str, page_size: int) -> None:
    """After every step: free + evictable + protected + the requests' own pages = the pool
    (SGLang's leak check with requests running); at the end nothing is protected or owned.
    The pool is small enough to evict and to retract."""
    pages = 1800 // page_size
    rp = _replay(engine, _requests(16, 160, 220, shared=64, seed=3), "--block-size",
                 str(page_size), "--num-blocks", str(pages), "--chunk-size", "256",
                 "--max-running", "8")
    alloc, cache = rp.alloc, rp.cache
    while rp.busy():
        rp.step()
        running = list(rp.batch.reqs) + ([rp.chunked] if rp.chunked is not None else [])
        owned = sum(_owned_pages(r, page_size) for r in running) * page_size
        assert (alloc.available_size() + cache.evictable_size() + cache.protected_size()
                + owned) == pages * page_size
    assert rp.finished + rp.aborted == 16 and rp.retractions > 0 and rp.evicted > 0
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.evictable_size() == pages * page_size


def test_refuses_a_prompt_larger_than_the_pool(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    requests = _requests(3, 200, 10)
    requests.insert(1, TraceRequest("big", 0.0, 900, 10, prompt=tuple(range(1, 901))))
    monkeypatch.setattr(replay_mod, "_load", lambda source, limit: requests)
    assert main(["unused", "--block-size", "16", "--num-blocks", "50", "--json"]) == 0
    for r in json.loads(capsys.readouterr().out)["results"]:
        assert r["refused"] == 1 and r["finished"] == 3


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_same_admissions_without_eviction(policy: str) -> None:
    """With room for everything the two caches answer alike (test_identity.py), so
    PrefillAdder over either admits the same requests, with the same hits, at every step."""
    requests = _requests(30, 240, 30, shared=96, seed=5)
    argv = ("--block-size", "16", "--num-blocks", "2000", "--chunk-size", "400",
            "--max-running", "6", "--schedule-policy", policy)
    replays = [_replay(engine, requests, *argv) for engine in ("sglang:lru", "kvcore:lru")]
    steps = 0
    while replays[0].busy() or replays[1].busy():
        batches = [[(r.rid, r.prefix_len, r.extend_end) for r in rp.step()] for rp in replays]
        assert batches[0] == batches[1], steps
        assert [rp.hit_tokens for rp in replays] == [replays[0].hit_tokens] * 2
        steps += 1
    assert replays[0].hit_tokens > 0 and replays[0].evicted == replays[1].evicted == 0
    assert replays[0].finished == replays[1].finished == 30
