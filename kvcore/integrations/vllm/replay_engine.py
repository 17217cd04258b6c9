"""The engines of the vLLM replay (:mod:`kvcore.integrations.vllm.replay`), named as on its
command line (``--engines``)::

    vllm                                   vLLM's own KV-cache manager
    kvcore                                 kvcore's, LRU (vLLM's eviction order)
    kvcore:POLICY                          kvcore's with an eviction policy: recommended, learned,
                                           slru, slru:protected_share=0.7, s3fifo, arc
    kvcore:POLICY+hints=N                  ... with queue hints of depth N (``recommended``
                                           brings its own; ``+hints=0`` turns them off)
    kvcore[:POLICY]@SCHEDULE               ... and a schedule policy for vLLM's waiting queue:
                                           fcfs, lpm, dfs-weight, recommended
    kvcore[...]+no-memo[@SCHEDULE]         ... without the head-of-line retry memo
                                           (``retry_memo`` off: the A/B of its cost)
    kvcore:belady, kvcore:reuse_oracle     offline bounds (arrival order only: no @SCHEDULE)

Every kvcore engine's settings are parsed as ``additional_config["kvcore"]`` is
(:func:`~kvcore.integrations.vllm.settings.parse_settings`), so a bad name is refused with the
same message.  The offline bounds are not settings (vLLM's configuration refuses them): the
engine names one of :data:`~kvcore.sim.oracle.REPLAY_ORACLES`, which the replay alone builds
into the adapter's pool (:mod:`~kvcore.integrations.vllm.replay_oracle`); its settings are LRU's.
This module does not import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.errors import InvalidArgumentError
from kvcore.integrations.vllm.settings import KvcoreSettings, parse_settings
from kvcore.scheduler.admission import FCFS
from kvcore.sim.oracle import REPLAY_ORACLES


@dataclass(frozen=True)
class Engine:
    """``vllm`` (``settings`` None: vLLM's own manager) or a kvcore engine with ``settings``;
    ``oracle``: the offline bound its pool runs instead of the settings' policy (see the module
    docstring)."""

    name: str
    settings: KvcoreSettings | None
    oracle: str | None = None

    @staticmethod
    def parse(text: str, max_waiting_steps: int | None = None) -> Engine:
        """The engine ``text`` names (see the module docstring); ``max_waiting_steps`` goes into
        every kvcore engine's settings.  Raises :class:`InvalidArgumentError` (a ``ValueError``)
        naming the engine and what is wrong with it."""
        name = text.strip()
        base, at, schedule = name.partition("@")  # eviction options never hold an "@"
        no_memo = base.endswith("+no-memo")
        if no_memo:
            base = base[:-len("+no-memo")]
        if base == "vllm":
            if at:
                raise InvalidArgumentError(
                    f"engine {text!r}: vLLM's own manager runs vLLM's queue; a schedule policy "
                    "(@NAME) is for kvcore engines (kvcore@NAME, kvcore:POLICY@NAME)")
            return Engine(name, None)
        base, plus, hints = base.partition("+hints=")
        if plus and not hints.isdigit():
            raise InvalidArgumentError(f"engine {text!r}: +hints= takes a count, got {hints!r}")
        kind, colon, policy = base.partition(":")
        if kind != "kvcore" or (colon and not policy) or (at and not schedule):
            raise InvalidArgumentError(
                f"unknown engine {text!r}: vllm, kvcore, kvcore:POLICY, kvcore[:POLICY]@SCHEDULE "
                f"or kvcore:{'/'.join(REPLAY_ORACLES)}")
        oracle = policy if policy in REPLAY_ORACLES else None
        if oracle is None and policy.partition(":")[0] in REPLAY_ORACLES:
            raise InvalidArgumentError(f"engine {text!r}: the offline bound "
                                       f"{policy.partition(':')[0]} takes no options")
        raw: dict[str, Any] = {"eviction_policy": "lru" if oracle or not policy else policy}
        if plus:
            raw["queue_hints"] = int(hints)
        if at:
            raw["schedule_policy"] = schedule
        if no_memo:
            raw["retry_memo"] = False
        if max_waiting_steps is not None:
            raw["max_waiting_steps"] = max_waiting_steps
        try:
            settings = parse_settings(raw)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"engine {text!r}: {exc}") from None
        if oracle is not None and settings.schedule_policy != FCFS:
            raise InvalidArgumentError(
                f"engine {text!r}: {oracle} is a bound for arrival order: replay it with "
                f"schedule policy {FCFS}, not {schedule!r}")
        return Engine(name, settings, oracle)

    @property
    def lru(self) -> bool:
        """Whether the engine must give vLLM's exact schedule: vLLM's, or kvcore's with LRU, no
        queue hints and vLLM's FCFS queue (compared step by step by the replay)."""
        s = self.settings
        return s is None or (self.oracle is None and s.eviction_policy == "lru"
                             and not s.queue_hints and s.schedule_policy == FCFS)

    @property
    def reorders(self) -> bool:
        """Whether a schedule policy other than FCFS reorders vLLM's waiting queue (the replay
        then checks its starvation guard)."""
        return self.settings is not None and self.settings.schedule_policy != FCFS
