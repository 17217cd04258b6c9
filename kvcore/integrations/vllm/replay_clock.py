"""The vLLM replay's simulated clock: requests reach vLLM's scheduler when they arrive.

The cost model is kvcore's own replay's (:class:`kvcore.sim.clock.StepCost`): a request arrives
at its trace time times ``time_scale``; every scheduler step (``schedule()``) takes
``step_base_ms + step_ms_per_token * scheduled tokens``.  :class:`ArrivalClock` adds each
request to the scheduler before the first step that starts at or after its arrival, and when
nothing is running or in flight the clock jumps to the next arrival.  With ``--async`` a step is
charged when it is scheduled, so the clock is the end of the latest scheduled step (what vLLM's
overlapped engine would show a step later is not modelled).  ``time_scale`` 0 queues every
request before the first step, in arrival order (the replay before it had a clock).

Recorded per request: the simulated arrival, the start of the step that first scheduled it
(queueing delay), the end of the step that sampled its first token (time to first token), and
in scheduler steps, from the first step that saw it waiting to the step that first scheduled it
(``wait_steps``).  :func:`check_starvation` checks the one order guarantee the non-FCFS
schedule policies' starvation guard gives inside vLLM's scheduler (see there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvcore.sim.clock import StepCost, latency_summary

STARVATION_SLACK = 1
"""Steps beyond ``max_waiting_steps`` before :func:`check_starvation` holds a request to the
guard's order: the queue may count a request's wait from a step earlier or later than the
replay does (when it is added, or from the first ``schedule()`` that sees it) and compare with
``>`` or ``>=``; one step covers either convention."""


class ArrivalClock:
    """Adds ``requests`` (``(trace arrival ms, vLLM request)``, in arrival order) to a vLLM
    scheduler on the simulated clock of ``cost`` and records their times (module docstring)."""

    def __init__(self, requests: Sequence[tuple[float, Any]], cost: StepCost) -> None:
        self.cost = cost
        self.now = 0.0
        self._pending = deque((cost.arrival(ms), req) for ms, req in requests)
        self.order = [req.request_id for _, req in requests]
        self.arrival_ms: dict[str, float] = {}
        self.scheduled_ms: dict[str, float] = {}  # start of the first step that scheduled it
        self.first_token_ms: dict[str, float] = {}  # end of the step that sampled its first
        self.seen_step: dict[str, int] = {}  # the first step that saw it waiting
        self.scheduled_step: dict[str, int] = {}  # the first step that scheduled it

    @property
    def pending(self) -> bool:
        """Whether requests have yet to arrive."""
        return bool(self._pending)

    def add_arrived(self, sched: Any, step: int) -> None:
        """Add to ``sched`` every request that has arrived by now; the next step is ``step``."""
        pending = self._pending
        while pending and pending[0][0] <= self.now:
            at, req = pending.popleft()
            sched.add_request(req)
            self.arrival_ms[req.request_id] = at
            self.seen_step[req.request_id] = step

    def jump(self) -> None:
        """Nothing runs: the clock moves on to the next arrival."""
        if self._pending:
            self.now = max(self.now, self._pending[0][0])

    def step(self, so: Any, sampled: Iterable[str], step: int) -> list[str]:
        """Step ``step`` was scheduled (``so``, vLLM's ``SchedulerOutput``) and samples a token
        for ``sampled``: charge it; returns the requests it schedules for the first time."""
        first = [r.req_id for r in so.scheduled_new_reqs if r.req_id not in self.scheduled_step]
        for rid in first:
            self.scheduled_step[rid] = step
            self.scheduled_ms[rid] = self.now
        self.now += self.cost.step_ms(so.total_num_scheduled_tokens)
        for rid in sampled:
            self.first_token_ms.setdefault(rid, self.now)
        return first

    def wait_steps(self) -> dict[str, int]:
        """Per request scheduled: steps from the first that saw it waiting to the first that
        scheduled it (0: scheduled by the first step after it arrived)."""
        return {rid: s - self.seen_step[rid] for rid, s in self.scheduled_step.items()}

    def summary(self) -> dict[str, float]:
        """TTFT and queueing percentiles (ms, :func:`kvcore.sim.clock.latency_summary`), the
        simulated time at the end and the longest wait in steps."""
        return {**latency_summary(self.arrival_ms, self.first_token_ms, self.scheduled_ms),
                "sim_time_ms": self.now,
                "max_wait_steps": max(self.wait_steps().values(), default=0)}


def check_starvation(engine: str, order: Sequence[str], wait_steps: Mapping[str, int],
                     scheduled_step: Mapping[str, int], max_waiting_steps: int) -> None:
    """Raise :class:`RuntimeError` naming the request if a request past the starvation bound
    was admitted ahead of one that arrived earlier.

    What the guard guarantees inside vLLM's scheduler is an order, not a number of steps: a
    request that waited more than ``max_waiting_steps`` goes ahead of every fresh request that
    has not, and behind the older ones past the bound, but it still waits for the requests the
    queue pins at its head (preempted ones, which vLLM also resumes before any admission), for
    those older ones, and for a seat, tokens and blocks — as long as the running requests keep
    them, which no bound in steps limits (under FCFS neither).  vLLM admits its waiting queue
    in order, stopping at the first request that does not fit (it skips one only for a KV load,
    a structured-output grammar, a LoRA limit or a resumed request's stale output: none of
    them in this replay).  So when request B, ``STARVATION_SLACK`` steps past the bound, is
    first scheduled at step t, every request that arrived before B and was still waiting then
    was past the bound too and ahead of it: none may be first scheduled after t."""
    bound = max_waiting_steps + STARVATION_SLACK
    latest: tuple[int, str] | None = None  # the latest first scheduling among earlier arrivals
    for rid in order:
        step = scheduled_step.get(rid)
        if step is None:
            continue
        if wait_steps[rid] > bound and latest is not None and latest[0] > step:
            raise RuntimeError(
                f"{engine}: starvation guard broken: request {latest[1]!r} waited past the "
                f"bound ({max_waiting_steps} steps + {STARVATION_SLACK}) until step {latest[0]}, "
                f"while {rid!r}, which arrived after it and waited {wait_steps[rid]} steps, "
                f"was admitted ahead of it at step {step}")
        if latest is None or step > latest[0]:
            latest = (step, rid)
