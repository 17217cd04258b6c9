"""An offloading connector: a host-memory tier behind the device prefix cache (vLLM's
``OffloadingConnector`` shape).

Scheduler side (:class:`~kvcore.connector.host_tier.HostOffloadingManager` bookkeeping):

* **store, write-through**: every block a step computes is offered to the host tier once the step
  has run (``prepare_store`` → a store job in the metadata; ``complete_store`` when the worker
  reports the job done).  A request that finishes with stores in flight keeps its blocks
  (``request_finished`` → ``delay_free``) until they are copied.
* **load**: on admission, after the device hit, the leading blocks the host tier holds are
  external tokens: ``allocate_slots(num_external_computed_tokens=n, delay_cache_blocks=True)``,
  ``prepare_load`` pins their host slots, and the request waits for the copy (``load_async``,
  the default) or is computed in the same step after a synchronous load.  A failed load (the
  worker reports its device block ids) falls back to recomputing those tokens.

Worker side: a :class:`TransferHandler` copies between device blocks and host slots
(:class:`InstantTransfer` models it without data for replays; ``runner.offload.HostKVTransfer``
copies real tensors, on a side CUDA stream on GPU).

Supported KV-cache configurations: every group full attention with one block size (a sliding
window or Mamba group would need per-group load rules).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcore.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    StepOutput,
)
from kvcore.connector.host_tier import HostOffloadingManager, OffloadKey
from kvcore.errors import InvalidArgumentError
from kvcore.events import MEDIUM_CPU, EventRecorder
from kvcore.specs import FullAttentionSpec, KVCacheConfig
from kvcore.types import BlockHash

if TYPE_CHECKING:
    from kvcore.events import KVCacheEvent
    from kvcore.request import Request
    from kvcore.types import KVCacheBlocks


@dataclass(frozen=True)
class TransferSpec:
    """Copy device blocks ``device_block_ids[i]`` ↔ host slots ``host_slots[i]``."""

    device_block_ids: tuple[int, ...]
    host_slots: tuple[int, ...]


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """One step's transfers: loads per request, stores as ``job id -> (request id, spec)``."""

    loads: dict[str, TransferSpec] = field(default_factory=dict)
    stores: dict[int, tuple[str, TransferSpec]] = field(default_factory=dict)


class TransferHandler:
    """Worker-side copies.  ``load``/``store`` start a transfer; ``poll`` returns what finished
    since the last poll: store job ids, request ids whose load finished, and device block ids
    whose load failed."""

    def load(self, request_id: str, spec: TransferSpec) -> None:
        raise NotImplementedError

    def store(self, job_id: int, spec: TransferSpec) -> None:
        raise NotImplementedError

    def wait_loads(self, request_ids: Sequence[str]) -> None:
        """Block until these requests' loads are done (synchronous loads)."""

    def poll(self) -> tuple[set[int], set[str], set[int]]:
        raise NotImplementedError


class InstantTransfer(TransferHandler):
    """No data: every transfer completes at the next ``poll``.  ``fail_loads`` names requests
    whose next load fails (fault injection for tests and replays)."""

    def __init__(self) -> None:
        self.fail_loads: set[str] = set()
        self._stores: set[int] = set()
        self._loads: set[str] = set()
        self._failed: set[int] = set()
        self.num_loaded_blocks = 0
        self.num_stored_blocks = 0

    def load(self, request_id: str, spec: TransferSpec) -> None:
        self._loads.add(request_id)
        if request_id in self.fail_loads:
            self.fail_loads.discard(request_id)
            self._failed.update(spec.device_block_ids)
        else:
            self.num_loaded_blocks += len(spec.device_block_ids)

    def store(self, job_id: int, spec: TransferSpec) -> None:
        self._stores.add(job_id)
        self.num_stored_blocks += len(spec.device_block_ids)

    def poll(self) -> tuple[set[int], set[str], set[int]]:
        out = (self._stores, self._loads, self._failed)
        self._stores, self._loads, self._failed = set(), set(), set()
        return out


class OffloadingConnector(KVConnectorBase):
    """See the module docstring.

    Args:
        role: scheduler or worker side.
        kv_config: the device cache's configuration (scheduler side).
        num_host_blocks: host slots (scheduler side).
        eviction_policy, admit_after: the host tier's policy and admission filter.
        load_async: loads complete in a later step (the request waits) rather than before this
            step's forward.
        transfer: the worker side's copier (worker side; default :class:`InstantTransfer`).
    """

    def __init__(self, role: KVConnectorRole, kv_config: KVCacheConfig | None = None, *,
                 num_host_blocks: int = 0, eviction_policy: str = "lru", admit_after: int = 1,
                 load_async: bool = True, transfer: TransferHandler | None = None) -> None:
        super().__init__(role)
        self.load_async = bool(load_async)
        # scheduler side
        self.host: HostOffloadingManager | None = None
        self.block_size = 0
        self.num_groups = 0
        self._match: dict[str, tuple[int, int]] = {}  # rid -> (first block, blocks) to load
        self._pending_loads: dict[str, TransferSpec] = {}
        self._loading: dict[str, list[OffloadKey]] = {}
        self._stored_upto: dict[str, int] = {}  # rid -> blocks offered to the tier so far
        self._store_jobs: dict[int, tuple[str, list[OffloadKey]]] = {}
        self._next_job = 0
        if role is KVConnectorRole.SCHEDULER:
            if kv_config is None:
                raise InvalidArgumentError("the scheduler side needs the KV-cache config")
            specs = [g.spec for g in kv_config.groups]
            if not all(type(s) is FullAttentionSpec for s in specs) or \
                    len({s.block_size for s in specs}) != 1:
                raise InvalidArgumentError(
                    "the offloading connector supports full-attention groups of one block "
                    f"size, got {[type(s).__name__ for s in specs]}")
            if kv_config.hash_block_size != specs[0].block_size:
                raise InvalidArgumentError("the offloading connector needs the hash block size "
                                           "to equal the block size")
            self.block_size = specs[0].block_size
            self.num_groups = len(specs)
            self.host = HostOffloadingManager(
                num_host_blocks, self.block_size, eviction_policy=eviction_policy,
                admit_after=admit_after, events=EventRecorder.for_config(kv_config, MEDIUM_CPU))
        # worker side
        self.transfer = transfer if transfer is not None else InstantTransfer()
        self._finished_stores: set[int] = set()
        self._worker_pending: dict[str, int] = {}  # rid -> store jobs in flight (worker)
        self._job_owner: dict[int, str] = {}
        self._recving_done: set[str] = set()
        self._load_errors: set[int] = set()

    def _host(self) -> HostOffloadingManager:
        if self.host is None:
            raise InvalidArgumentError("a scheduler-side call on a worker-side connector")
        return self.host

    def _keys(self, hashes: Sequence[BlockHash]) -> list[OffloadKey]:
        return [(g, h) for g in range(self.num_groups) for h in hashes]

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        host = self._host()
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # the last token is always computed
        hashes = request.block_hashes[start:end]
        if not hashes:
            return 0, False
        n = min(host.lookup([(g, h) for h in hashes]) for g in range(self.num_groups))
        self._match[request.request_id] = (start, n)
        if n == 0:
            return 0, False
        return n * bs, self.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        host = self._host()
        rid = request.request_id
        start, n = self._match.pop(rid, (0, 0))
        if num_external_tokens == 0:
            return
        if num_external_tokens != n * self.block_size:
            raise InvalidArgumentError(
                f"request {rid!r}: {num_external_tokens} external tokens, but the connector "
                f"matched {n * self.block_size}")
        hashes = request.block_hashes[start:start + n]
        keys = self._keys(hashes)
        table = blocks.get_block_ids()
        device = tuple(bid for g in range(self.num_groups) for bid in table[g][start:start + n])
        spec = host.prepare_load(keys)
        self._pending_loads[rid] = TransferSpec(device, spec.slots)
        self._loading[rid] = keys

    def build_connector_meta(self, scheduler_output: StepOutput) -> OffloadingMetadata:
        host = self._host()
        meta = OffloadingMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        bs = self.block_size
        for s in scheduler_output.scheduled:
            rid = s.request_id
            end = (s.num_computed_tokens + s.num_new_tokens) // bs
            start = self._stored_upto.get(rid, 0)
            if end <= start:
                continue
            self._stored_upto[rid] = end
            hashes = s.request.block_hashes[start:end]
            table = s.block_ids
            device = {(g, h): table[g][start + i] for g in range(self.num_groups)
                      for i, h in enumerate(hashes)}
            sources = {(g, h): (s.request, start + i) for g in range(self.num_groups)
                       for i, h in enumerate(hashes)}
            out = host.prepare_store(list(device), sources)
            if out is None:
                continue
            job = self._next_job
            self._next_job += 1
            self._store_jobs[job] = (rid, out.keys_to_store)
            meta.stores[job] = (rid, TransferSpec(tuple(device[k] for k in out.keys_to_store),
                                                  out.store_spec.slots))
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        host = self._host()
        for rid in sorted(output.finished_recving):
            keys = self._loading.pop(rid, None)
            if keys is not None:
                host.complete_load(keys)
        for job in sorted(output.worker_meta or ()):  # in issue order
            entry = self._store_jobs.pop(job, None)
            if entry is not None:
                host.complete_store(entry[1])

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._stored_upto.pop(rid, None)
        self._match.pop(rid, None)
        # The request used its full blocks (device hits, host loads or computed): the copies
        # the tier holds are refreshed in its policy, group by group from the head, as vLLM's
        # offloading manager does when a request finishes.
        self._host().touch(self._keys(request.block_hashes))
        return any(owner == rid for owner, _ in self._store_jobs.values()), None

    def take_events(self) -> list[KVCacheEvent]:
        return self._host().take_events()

    def failed_step_output(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput:
        """The step that carried ``metadata`` never ran: its stores are given up (slots back to
        the tier) and its loads reported finished and failed, so their requests recompute."""
        host = self._host()
        if not isinstance(metadata, OffloadingMetadata):
            return KVConnectorOutput()
        for job in metadata.stores:
            entry = self._store_jobs.pop(job, None)
            if entry is not None:
                host.complete_store(entry[1], success=False)
        failed = {b for spec in metadata.loads.values() for b in spec.device_block_ids}
        return KVConnectorOutput(finished_recving=set(metadata.loads), invalid_block_ids=failed)

    # -- worker side ----------------------------------------------------------------------------
    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self.metadata
        if not isinstance(meta, OffloadingMetadata) or not meta.loads:
            return
        for rid, spec in meta.loads.items():
            self.transfer.load(rid, spec)
        if not self.load_async:
            self.transfer.wait_loads(list(meta.loads))

    def wait_for_save(self) -> None:
        meta = self.metadata
        if not isinstance(meta, OffloadingMetadata):
            return
        for job, (rid, spec) in meta.stores.items():
            self.transfer.store(job, spec)
            self._job_owner[job] = rid
            self._worker_pending[rid] = self._worker_pending.get(rid, 0) + 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                  set[str] | None]:
        stores, loads, failed = self.transfer.poll()
        self._load_errors |= failed
        self._finished_stores |= stores
        sending: set[str] = set()
        for job in stores:
            rid = self._job_owner.pop(job)
            left = self._worker_pending[rid] - 1
            if left:
                self._worker_pending[rid] = left
            else:
                del self._worker_pending[rid]
                sending.add(rid)
        return sending, loads

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_worker_meta(self) -> set[int]:
        done, self._finished_stores = self._finished_stores, set()
        return done
