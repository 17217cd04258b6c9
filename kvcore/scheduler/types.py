"""The data of one scheduling step: the scheduler's limits (:class:`SchedulerConfig`), each
request's share of a step (:class:`ScheduledRequest`), what ``schedule()`` decided
(:class:`SchedulerOutput`, with the KV connector's message for the step, a
:class:`~kvcore.connector.base.KVConnectorMetadata`), counters, and the rejection error.  The
scheduler (:mod:`kvcore.scheduler.core`) and engines read these; connectors read a step through
their own protocol (:class:`~kvcore.connector.base.StepOutput`), so they import nothing from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.connector.base import KVConnectorMetadata
from kvcore.errors import InvalidArgumentError, KVCoreError
from kvcore.manager import KVCacheManager
from kvcore.request import Request
from kvcore.scheduler.admission import resolve as resolve_schedule_policy
from kvcore.validation import check_flag


class RequestRejectedError(KVCoreError, ValueError):
    """The request can never be served with this KV cache (too long, or needs more blocks than
    the pool has)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and admission policy."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    full_sequence_must_fit: bool = False
    """Admit a request only if its whole prompt fits (not just the first chunk)."""
    retain_sessions: bool = False
    """Free a finished request that has a ``session_id`` with the retention hint
    (``KVCacheManager.free(..., retain=True)``): its conversation is expected back.  Off by
    default: the hint pays only when it tells traffic apart (sessions sharing the cache with
    one-time prompts, at caches large enough to hold the sessions); when every request is in a
    session, retaining all of them turns ``slru`` into LRU (measured in BENCHMARKS.md)."""
    async_scheduling: bool = False
    """Let the engine schedule the next step before reporting the current one's tokens
    (placeholders; see the module docstring).  Not with a KV connector."""
    schedule_policy: str = "fcfs"
    """Admission order of fresh waiting requests: ``fcfs`` (arrival), ``lpm`` (longest cached
    prefix first), ``dfs-weight`` (grouped by shared prefix), or ``recommended``; see
    :mod:`kvcore.scheduler.admission`."""
    max_waiting_steps: int = 256
    """Starvation guard of the non-FCFS policies: a request waiting more than this many steps
    is admitted before every fresh request that has not."""
    lpm_lookups_per_step: int = 32
    """``lpm``: at most this many prefix lookups per step refresh the hit estimates."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule_policy",
                           resolve_schedule_policy(self.schedule_policy))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_steps",
                     "lpm_lookups_per_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        check_flag("retain_sessions", self.retain_sessions)
        check_flag("async_scheduling", self.async_scheduling)


class ScheduledRequest:
    """One request's share of a step.

    ``new_block_ids`` are the blocks allocated this step (an engine can keep append-only block
    tables from them, as vLLM's workers do: positions that left a sliding window keep stale ids
    that attention never reads).  ``block_ids`` fetches the request's current full table.
    """

    __slots__ = ("_kv", "is_new", "new_block_ids", "num_computed_tokens", "num_new_tokens",
                 "request", "samples")

    def __init__(self, kv: KVCacheManager, request: Request, num_computed_tokens: int,
                 num_new_tokens: int, new_block_ids: tuple[list[int], ...], is_new: bool) -> None:
        self._kv = kv
        self.request = request
        self.num_computed_tokens = num_computed_tokens  # in the KV cache before this step
        self.num_new_tokens = num_new_tokens  # computed this step, from num_computed_tokens on
        self.new_block_ids = new_block_ids
        self.is_new = is_new  # admitted this step (the engine has no state for it yet)
        # This step reaches the end of the request's tokens (with the ones in flight), so a token
        # is sampled (false for a prefill chunk that is not the last one).  Fixed now: the
        # request grows afterwards.
        self.samples = (num_computed_tokens + num_new_tokens
                        >= request.num_tokens + request.num_output_placeholders)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        """The request's full block table now, one list per group (null block = 0)."""
        return self._kv.get_block_ids(self.request.request_id)

    @property
    def token_ids(self) -> list[int]:
        """The step's known token ids: all ``num_new_tokens`` of them, except under async
        scheduling, where the last one may still be in flight (not listed)."""
        start = self.num_computed_tokens
        return self.request.all_token_ids[start:start + self.num_new_tokens]

    def __repr__(self) -> str:
        return (f"ScheduledRequest({self.request_id!r}, computed={self.num_computed_tokens}, "
                f"new={self.num_new_tokens}, is_new={self.is_new})")


@dataclass
class SchedulerOutput:
    """What ``schedule()`` decided for one step."""

    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str]
    finished_request_ids: list[str]  # finished or aborted since the previous step
    num_batched_tokens: int
    step: int
    kv_connector_metadata: KVConnectorMetadata | None = None  # the connector's work, if any

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    steps: int = 0
    scheduled_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_rejected: int = 0
    external_hit_tokens: int = 0  # prompt tokens loaded by the connector at admission
    load_failures: int = 0  # connector loads that failed (their tokens were recomputed)
    finish_reasons: dict[str, int] = field(default_factory=dict)
