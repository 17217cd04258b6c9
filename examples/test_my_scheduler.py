"""Testing your own scheduler against kvcore — a runnable example.

    pip install 'kvcore[testing]'
    pytest --kvcore-check examples/test_my_scheduler.py

``TinyScheduler`` below is a small scheduler of the kind people write on top of kvcore's
``KVCacheManager``: first come, first served, the whole prompt in one step, then one token per
step, recompute preemption when the pool is full.  The tests

* drive it with random request streams through ``SchedulerMachine`` (kvcore's invariants and the
  content oracle after every call, no leak at the end);
* use the ``kv_manager`` fixture (a checked manager, leak-checked when the test ends);
* plant three classic bugs — a double free, a forgotten free, a wrong ``num_computed_tokens`` —
  and show each is caught with a readable message.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from kvcore import KVCacheManager, Request
from kvcore.errors import InvariantError, RequestStateError, UnknownRequestError
from kvcore.testing.checked import assert_no_leak
from kvcore.testing.machine import SchedulerMachine
from kvcore.testing.setups import full, swa
from kvcore.testing.strategies import RequestSpec


class TinyScheduler:
    """FCFS; a request's whole prompt in its first step, then one token per step."""

    def __init__(self, kv: KVCacheManager, max_running: int = 4) -> None:
        self.kv = kv
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request)
        else:
            self.waiting.remove(request)

    def schedule(self) -> list[Request]:
        """The requests that compute this step (their KV slots allocated)."""
        self.kv.new_step()
        batch = []
        for request in list(self.running):
            new = request.num_tokens - request.num_computed_tokens
            if self.kv.allocate_slots(request, new) is None:  # pool full: preempt it
                self.running.remove(request)
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.num_preemptions += 1
                self.waiting.appendleft(request)
                continue
            batch.append(request)
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            blocks, hit = self.kv.get_computed_blocks(request)
            if self.kv.allocate_slots(request, request.num_tokens - hit, hit, blocks) is None:
                break
            self.kv.record_prefix_cache_stats(request, hit)
            self.waiting.popleft()
            request.num_computed_tokens = hit
            self.running.append(request)
            batch.append(request)
        return batch

    def finish_step(self, batch: list[Request], tokens: list[int]) -> None:
        """The step ran: every scheduled token is computed, and each request sampled one."""
        for request, token in zip(batch, tokens):
            self.computed(request)
            request.append_output_token_ids(token)
            if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
                self.running.remove(request)
                del self.requests[request.request_id]
                self.release(request)

    def computed(self, request: Request) -> None:
        request.num_computed_tokens = request.num_tokens

    def release(self, request: Request) -> None:
        self.kv.free(request)


class TinySchedulerMachine(SchedulerMachine):
    """kvcore's state machine, adapted to TinyScheduler's API."""

    specs = (full(4), swa(8, 4))
    num_blocks = 48

    def make_scheduler(self, manager: KVCacheManager) -> Any:
        return TinyScheduler(manager)

    def submit(self, request_id: str, spec: RequestSpec) -> None:
        self.scheduler.add(self.manager.make_request(
            request_id, spec.prompt, max_tokens=spec.max_tokens, cache_salt=spec.cache_salt))

    def step(self) -> None:
        batch = self.scheduler.schedule()
        self.scheduler.finish_step(batch, [self.sample(r) for r in batch])

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def unfinished(self) -> list[str]:
        return sorted(self.scheduler.requests)


TestTinySchedulerRandomly = TinySchedulerMachine.TestCase


def run(scheduler: TinyScheduler, prompts: list[list[int]], max_tokens: int = 3) -> None:
    for i, prompt in enumerate(prompts):
        scheduler.add(scheduler.kv.make_request(f"r{i}", prompt, max_tokens=max_tokens))
    for _ in range(200):
        if not scheduler.requests:
            return
        batch = scheduler.schedule()
        scheduler.finish_step(batch, [1] * len(batch))
    raise AssertionError("did not finish")


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10], [5, 5, 5, 5, 5]]


def test_tiny_scheduler_with_the_kv_manager_fixture(kv_manager: Any) -> None:
    scheduler = TinyScheduler(kv_manager("hybrid", num_blocks=32, block_size=4))
    run(scheduler, PROMPTS)  # the fixture checks at teardown that every block came back


# -- planted bugs, each caught with a readable message -------------------------------------------

class DoubleFree(TinyScheduler):
    def release(self, request: Request) -> None:
        self.kv.free(request)
        self.kv.free(request)


class ForgottenFree(TinyScheduler):
    def release(self, request: Request) -> None:
        pass


class OverCountsComputed(TinyScheduler):
    def computed(self, request: Request) -> None:
        request.num_computed_tokens = request.num_tokens + 1  # one token too many


# Each planted bug stops its scheduler half-way, so these tests opt out of the fixture's
# end-of-test leak check (kvcore_unchecked) and check what they expect themselves.

@pytest.mark.kvcore_unchecked
def test_a_double_free_is_caught(kv_manager: Any) -> None:
    with pytest.raises(UnknownRequestError, match="already freed"):
        run(DoubleFree(kv_manager("full", num_blocks=32, block_size=4)), PROMPTS)


@pytest.mark.kvcore_unchecked
def test_a_forgotten_free_is_caught(kv_manager: Any) -> None:
    manager = kv_manager("full", num_blocks=32, block_size=4)
    run(ForgottenFree(manager), PROMPTS)
    with pytest.raises(AssertionError, match=r"still hold KV-cache blocks: \['r0', 'r1', 'r2'\]"):
        assert_no_leak(manager)


@pytest.mark.kvcore_unchecked
def test_a_wrong_num_computed_tokens_is_caught(kv_manager: Any) -> None:
    # The content oracle sees it at the next call: token 9 of r0 is claimed computed, never
    # written.  (Without contents tracked, kvcore refuses the next allocate_slots instead:
    # RequestStateError "slots for only 9".)
    with pytest.raises(InvariantError, match=r"r0.* token 9 was never written"):
        run(OverCountsComputed(kv_manager("full", num_blocks=32, block_size=4)), PROMPTS)


@pytest.mark.kvcore_unchecked
def test_a_wrong_num_computed_tokens_is_refused_by_kvcore_itself() -> None:
    from kvcore.testing.setups import Setup

    manager = Setup("plain", (full(4),)).build()  # not checked: kvcore's own refusal
    with pytest.raises(RequestStateError, match="slots for only 9"):
        run(OverCountsComputed(manager), PROMPTS)
