"""The simulated clock of the scheduler replays: kvcore's own (:mod:`kvcore.sim.replay`, and the
cluster replay) and vLLM's scheduler without a model (:mod:`kvcore.integrations.vllm.replay`).

One cost model, :class:`StepCost`: a request arrives at its trace time times ``time_scale``, and
each scheduler step takes ``step_base_ms + step_ms_per_token * batched tokens`` of simulated
time.  From the times a replay records per request, :func:`latency_summary` gives the reported
percentiles: time to first token (arrival to the end of the step that samples the request's
first token) and queueing delay (arrival to its first scheduling); :func:`quantile` is the
percentile both replays use.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Final, Protocol

from kvcore.errors import InvalidArgumentError

STEP_BASE_MS: Final = 5.0
"""Simulated cost of a scheduler step whatever it batches (ms)."""
STEP_MS_PER_TOKEN: Final = 0.02
"""Simulated cost of each token a step batches (ms)."""
TIME_SCALE: Final = 1.0
"""Trace arrival times are multiplied by this (< 1 loads the scheduler more; 0: all at once)."""


def finite_nonneg(x: object) -> bool:
    """Whether ``x`` is a real number (not a bool), finite and >= 0."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x) and float(x) >= 0
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True)
class StepCost:
    """The clock's cost model (see the module docstring); every field a finite number >= 0
    (else :class:`InvalidArgumentError` naming it: a NaN or negative time would stall a replay)."""

    step_base_ms: float = STEP_BASE_MS
    step_ms_per_token: float = STEP_MS_PER_TOKEN
    time_scale: float = TIME_SCALE

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not finite_nonneg(value):
                raise InvalidArgumentError(f"{f.name} must be a finite number >= 0, got {value!r}")

    def arrival(self, arrival_ms: float) -> float:
        """The simulated time a request of trace time ``arrival_ms`` arrives."""
        return arrival_ms * self.time_scale

    def step_ms(self, batched_tokens: int) -> float:
        """The simulated duration of a step batching ``batched_tokens`` tokens."""
        return self.step_base_ms + self.step_ms_per_token * batched_tokens


class Arrival(Protocol):
    """What :func:`check_arrivals` reads of a trace request."""

    @property
    def request_id(self) -> str: ...
    @property
    def arrival_ms(self) -> float: ...


def check_arrivals(requests: Iterable[Arrival]) -> None:
    """Refuse an arrival time that is NaN, infinite or negative (the clock would never reach it:
    a replay would loop forever), naming the request."""
    for r in requests:
        if not finite_nonneg(r.arrival_ms):
            raise InvalidArgumentError(f"request {r.request_id}: arrival_ms must be a finite "
                                       f"number >= 0, got {r.arrival_ms!r}")


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values (nearest rank below; 0 for none): the replays' p50 /
    p99."""
    return ordered[int(q * (len(ordered) - 1))] if ordered else 0.0


def latency_summary(arrival: Mapping[str, float], first_token: Mapping[str, float],
                    scheduled: Mapping[str, float]) -> dict[str, float]:
    """``ttft_ms_p50`` / ``_p99`` and ``queue_ms_p50`` / ``_p99`` / ``_mean`` from per-request
    simulated times (by request id): arrival, end of the step that sampled the first token, and
    start of the step that first scheduled the request (requests missing from one are left out
    of its figures)."""
    ttft = sorted(t - arrival[rid] for rid, t in first_token.items())
    queued = sorted(t - arrival[rid] for rid, t in scheduled.items())
    return {"ttft_ms_p50": quantile(ttft, 0.5), "ttft_ms_p99": quantile(ttft, 0.99),
            "queue_ms_p50": quantile(queued, 0.5), "queue_ms_p99": quantile(queued, 0.99),
            "queue_ms_mean": statistics.fmean(queued) if queued else 0.0}
