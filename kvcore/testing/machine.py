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
``has_unfinished_requests``); override :meth:`submit`, :meth:`step`, :meth:`abort` and
:meth:`unfinished` if yours differs.  Rules submit requests (shared prefixes, tenants, lengths
near block boundaries), run steps (the scheduler allocates; a fake engine samples one token per
sampling request) and abort requests.  The manager is :func:`~kvcore.testing.checked` with
contents tracked, so after every call its invariants hold and every adopted hit and running
block table holds the request's own KV; at teardown the remaining requests run to completion and
no block may be held or leaked.
"""

from __future__ import annotations

import contextlib
from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec
from kvcore.testing.checked import assert_no_leak, checked
from kvcore.testing.setups import full
from kvcore.testing.strategies import RequestSpec, prompts


class SchedulerMachine(RuleBasedStateMachine):
    """Base class: see the module docstring."""

    specs: tuple[KVCacheSpec, ...] = (full(4),)
    num_blocks = 32
    max_model_len = 64
    max_drain_steps = 5000

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

    @invariant()
    def kv_cache_consistent(self) -> None:
        self.manager.check_invariants()

    def teardown(self) -> None:
        steps = 0
        while self.unfinished():
            self.step()
            steps += 1
            if steps > self.max_drain_steps:
                raise AssertionError(f"the scheduler did not finish {self.unfinished()} within "
                                     f"{self.max_drain_steps} steps")
        assert_no_leak(self.manager)
