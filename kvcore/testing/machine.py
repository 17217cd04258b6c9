"""A hypothesis state machine that drives *your* scheduler over a checked KV-cache manager
(needs ``hypothesis``: ``pip install kvcore[testing]``).

Subclass :class:`SchedulerMachine`, implement :meth:`~SchedulerMachine.make_scheduler`, and
expose the subclass's ``TestCase`` to pytest::

    class MySchedulerMachine(SchedulerMachine):
        specs = (full(16), swa(128, 16))      # kvcore.testing.setups helpers, or your specs
        def make_scheduler(self, manager):
            return MyScheduler(manager)

    TestMyScheduler = MySchedulerMachine.TestCase

The default adapter hooks speak the API of :class:`kvcore.scheduler.Scheduler`
(``add_request`` / ``schedule`` / ``update_from_output`` / ``abort_request`` /
``has_unfinished_requests``, and ``fail_step`` with ``fail_steps = True``); override
:meth:`submit`, :meth:`step`, :meth:`abort`, :meth:`unfinished` and :meth:`fail` if yours
differs.  Rules submit requests (shared prefixes, tenants, lengths near block boundaries), run
steps (the scheduler allocates; a fake engine samples one token per sampling request), abort
requests and, with ``fail_steps = True``, fail steps (the engine's forward raised: reported with
:func:`~kvcore.testing.checked.step_failed`, then the scheduler is told).  The manager is
:func:`~kvcore.testing.checked` with contents tracked, so after every call its invariants hold
and every adopted hit and running block table holds the request's own KV, and a failed step's
blocks must leave the prefix cache.

At teardown the remaining requests run to completion and no block may be held or leaked.  A
scheduler that stops making progress fails the example early: after ``max_idle_steps`` (50)
steps in a row in which no request finished and none computed a token beyond the most it had
computed before (a scheduler that schedules nothing, or preempts and recomputes in a loop), with
"no progress in N steps"; ``max_drain_steps`` (5,000) bounds the drain in any case.
"""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec
from kvcore.testing.checked import assert_no_leak, checked, step_failed
from kvcore.testing.setups import full
from kvcore.testing.strategies import RequestSpec, prompts


class SchedulerMachine(RuleBasedStateMachine):
    """Base class: see the module docstring."""

    specs: tuple[KVCacheSpec, ...] = (full(4),)
    num_blocks = 32
    max_model_len = 64
    max_drain_steps = 5000  # teardown: steps to finish the remaining requests, at most
    max_idle_steps = 50  # teardown: steps in a row without progress before giving up
    fail_steps = False  # add the failed-step rule (needs fail(): Scheduler.fail_step by default)

    def __init__(self) -> None:
        super().__init__()
        self.manager = self.make_manager()
        self.scheduler = self.make_scheduler(self.manager)
        self.block_size = max(s.block_size for s in self.specs)
        self._counter = 0

    # -- what a subclass provides -------------------------------------------------------------
    def make_scheduler(self, manager: KVCacheManager) -> Any:
        """Build the scheduler under test over ``manager``."""
        raise NotImplementedError("implement make_scheduler(manager)")

    def make_manager(self) -> KVCacheManager:
        groups = tuple(KVCacheGroup((f"layer{i}",), s) for i, s in enumerate(self.specs))
        return checked(KVCacheManager(KVCacheConfig(self.num_blocks, groups), self.max_model_len),
                       track_contents=True)

    # -- adapter hooks (kvcore.scheduler.Scheduler's API by default) ---------------------------
    def submit(self, request_id: str, spec: RequestSpec) -> None:
        from kvcore.scheduler import RequestRejectedError

        req = self.manager.make_request(request_id, spec.prompt, max_tokens=spec.max_tokens,
                                        cache_salt=spec.cache_salt, ignore_eos=True)
        with contextlib.suppress(RequestRejectedError):  # can never fit: refusing it is right
            self.scheduler.add_request(req)

    def step(self) -> None:
        out = self.scheduler.schedule()
        sampled = {s.request_id: self.sample(s.request) for s in out.scheduled if s.samples}
        self.scheduler.update_from_output(out, sampled)

    def sample(self, request: Request) -> int:
        """The fake engine's next token (deterministic: same requests, same outputs)."""
        return (request.num_tokens * 7 + len(request.request_id)) % 3

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def fail(self) -> None:
        """Schedule a step whose forward fails: report it to the checked manager, then to the
        scheduler (``Scheduler.fail_step`` by default)."""
        out = self.scheduler.schedule()
        step_failed(self.manager)
        self.scheduler.fail_step(out)

    def unfinished(self) -> list[str]:
        """Ids of the requests not finished yet."""
        return sorted(self.scheduler.requests)

    # -- rules ------------------------------------------------------------------------------------
    @rule(data=st.data(), max_tokens=st.integers(1, 6),
          salt=st.sampled_from((None, None, "tenant-a", "tenant-b")))
    def submit_request(self, data: st.DataObject, max_tokens: int, salt: str | None) -> None:
        prompt = data.draw(prompts(self.block_size, self.max_model_len - 8))
        self._counter += 1
        self.submit(f"req{self._counter}", RequestSpec(tuple(prompt), max_tokens, salt))

    @rule()
    def run_step(self) -> None:
        self.step()

    @precondition(lambda self: bool(self.unfinished()))
    @rule(data=st.data())
    def abort_request(self, data: st.DataObject) -> None:
        self.abort(data.draw(st.sampled_from(self.unfinished())))

    @precondition(lambda self: self.fail_steps)
    @rule()
    def run_failed_step(self) -> None:
        self.fail()

    @invariant()
    def kv_cache_consistent(self) -> None:
        self.manager.check_invariants()

    def teardown(self) -> None:
        steps = idle = 0
        most: dict[str, int] = {}  # request id -> most tokens it ever had computed
        left = self.unfinished()
        while left:
            self.step()
            steps += 1
            progress = False
            for rid, req in self.manager.requests().items():
                if req.num_computed_tokens > most.get(rid, 0):
                    most[rid] = req.num_computed_tokens
                    progress = True
            now = self.unfinished()
            idle = 0 if progress or len(now) < len(left) else idle + 1
            left = now
            if idle >= self.max_idle_steps:
                raise AssertionError(
                    f"no progress in {idle} steps: the scheduler finished no request and "
                    f"computed no new token of {left} (max_idle_steps={self.max_idle_steps})")
            if steps >= self.max_drain_steps and left:
                raise AssertionError(f"the scheduler did not finish {left} within "
                                     f"{self.max_drain_steps} steps (max_drain_steps)")
        assert_no_leak(self.manager)
