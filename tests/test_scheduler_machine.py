"""kvcore's own scheduler, tested through kvcore.testing.machine.SchedulerMachine — the same base
class a user subclasses for theirs (dogfooding)."""

from __future__ import annotations

from typing import Any, ClassVar

from kvcore.manager import KVCacheManager
from kvcore.scheduler import Scheduler, SchedulerConfig
from kvcore.testing.machine import SchedulerMachine
from kvcore.testing.setups import chunked, full, mamba, swa


class KvcoreSchedulerMachine(SchedulerMachine):
    order: ClassVar[dict[str, Any]] = {}  # schedule_policy and its starvation bound (default: FCFS)

    def make_scheduler(self, manager: KVCacheManager) -> Any:
        return Scheduler(manager, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                  **self.order))


def _machine(name: str, specs: tuple[Any, ...], **attrs: Any) -> type[SchedulerMachine]:
    return type(name, (KvcoreSchedulerMachine,), {"specs": specs, **attrs})


TestFullAttention = _machine("Full", (full(4),)).TestCase
TestHybridSlidingWindow = _machine("Hybrid", (full(4), swa(6, 4)), num_blocks=48).TestCase
TestChunkedOddChunk = _machine("Chunked", (full(4), chunked(13, 4)), num_blocks=48).TestCase
TestHybridMamba = _machine("Mamba", (full(4), mamba(4)), num_blocks=48).TestCase
# Failed steps too (reported to the checked manager, then Scheduler.fail_step): their blocks must
# leave the prefix cache and no later hit may serve them.
TestFullAttentionFailedSteps = _machine("FullFailing", (full(4),), fail_steps=True).TestCase
TestHybridFailedSteps = _machine("HybridFailing", (full(4), swa(6, 4)), num_blocks=48,
                                 fail_steps=True).TestCase
# Non-FCFS admission orders (kvcore.scheduler.admission) under the same hostile machine, with a
# short starvation bound so that the guard reorders too: invariants, hit contents, every request
# done.
_LPM = {"schedule_policy": "lpm", "max_waiting_steps": 3, "lpm_lookups_per_step": 2}
_DFS = {"schedule_policy": "dfs-weight", "max_waiting_steps": 3}
TestFullAttentionLpm = _machine("FullLpm", (full(4),), order=_LPM).TestCase
TestHybridDfsWeight = _machine("HybridDfs", (full(4), swa(6, 4)), num_blocks=48,
                               order=_DFS).TestCase
TestFullAttentionDfsFailedSteps = _machine("FullDfsFailing", (full(4),), fail_steps=True,
                                           order=_DFS).TestCase
TestHybridLpmFailedSteps = _machine("HybridLpmFailing", (full(4), swa(6, 4)), num_blocks=48,
                                    fail_steps=True, order=_LPM).TestCase
