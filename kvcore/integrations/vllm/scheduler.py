"""vLLM's own schedulers, with kvcore as their KV-cache manager.

``LLM(..., scheduler_cls="kvcore.integrations.vllm.Scheduler")`` (or ``AsyncScheduler``) runs
vLLM's ``Scheduler`` / ``AsyncScheduler`` unchanged except for ``self.kv_cache_manager``: a
:class:`~kvcore.integrations.vllm.manager.KVCacheManagerAdapter` built, with the settings of
``additional_config["kvcore"]``, where vLLM builds its own manager.  Everything else — queues,
preemption, chunked prefill, speculative decoding, connectors, KV-event publishing, metrics —
is vLLM's code.  The ``kvcore`` general plugin (:mod:`kvcore.integrations.vllm.plugin`) puts the
same mix-in under whatever scheduler class vLLM chose.

vLLM's ``Scheduler.__init__`` constructs its ``KVCacheManager`` inline by module-level name, so
the mix-in rebinds that one name for the duration of its own ``super().__init__()`` (under a
lock, restored on exit, error or not): nothing else of vLLM is patched.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from itertools import chain, islice
from typing import Any, ClassVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.core.sched import scheduler as vllm_scheduler_module
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import RequestStatus

from kvcore.errors import UnsupportedFeatureError
from kvcore.integrations.vllm.config import refuse
from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
from kvcore.integrations.vllm.queue import CacheAwareQueue, make_queue
from kvcore.integrations.vllm.settings import KvcoreSettings, settings_from_additional_config
from kvcore.integrations.vllm.version import installed as installed_vllm
from kvcore.scheduler.admission import hint_key

_CONSTRUCTION_LOCK = threading.Lock()


def _connectors(connector: Any) -> Iterator[Any]:
    yield connector
    for child in getattr(connector, "_connectors", ()) or ():  # MultiConnector's
        yield from _connectors(child)


def _binds_through_views(cls: Any) -> bool:
    """Whether a connector class that binds vLLM's block pool or manager uses only what kvcore's
    views (:mod:`~kvcore.integrations.vllm.views`) implement with vLLM's semantics: vLLM's
    ``SimpleCPUOffloadConnector`` (native CPU offloading, ``--kv-offloading-size``) and
    ``OffloadingConnector`` (whose bind, in vLLM versions that override it, retains the
    full-attention groups' longer hits and looks hits up through the coordinator), or a
    subclass that keeps their binds.  Anything such a bind reaches that a view does not
    provide raises :class:`~kvcore.errors.ViewAttributeError` at engine start."""
    bases = []
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
            SimpleCPUOffloadConnector,
        )
        bases.append(SimpleCPUOffloadConnector)
    except ImportError:  # pragma: no cover - both supported versions ship it
        pass
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        bases.append(OffloadingConnector)
    except ImportError:  # pragma: no cover - both supported versions ship it
        pass
    return any(issubclass(cls, base)
               and cls.bind_gpu_block_pool is base.bind_gpu_block_pool
               and cls.bind_kv_cache_manager is base.bind_kv_cache_manager for base in bases)


def _check_connector(connector: Any) -> None:
    """Refuse a KV connector that binds vLLM's block pool or cache manager (overrides
    ``bind_gpu_block_pool`` / ``bind_kv_cache_manager``: it reads and changes vLLM's pool
    internals), except ``SimpleCPUOffloadConnector`` and ``OffloadingConnector``, whose every
    call on the pool, coordinator and managers kvcore's views answer with vLLM's semantics
    (``touch`` / ``free_blocks`` as withheld references, the free-queue walk, the cached-block
    lookups; the retained longer hits and the coordinator's lookups).  A connector that only
    uses the ``KVConnectorBase_V1`` scheduler interface is accepted, NixlConnector
    included (NixlConnector's ``supports_divergent_local_hybrid_hits``
    asks the manager for a per-group lookup, which for every model kvcore accepts is the plain
    one)."""
    if connector is None:
        return
    for c in _connectors(connector):
        cls = type(c)
        if c is connector and getattr(c, "_connectors", None) is not None:
            continue  # MultiConnector forwards the binds to its children, checked next
        if ((cls.bind_gpu_block_pool is not KVConnectorBase_V1.bind_gpu_block_pool
                or cls.bind_kv_cache_manager is not KVConnectorBase_V1.bind_kv_cache_manager)
                and not _binds_through_views(cls)):
            raise refuse(f"the KV connector {cls.__name__}, which binds vLLM's own block pool "
                         "or cache manager", "use a connector that only uses the "
                         "KVConnectorBase_V1 scheduler interface (e.g. NixlConnector), "
                         "SimpleCPUOffloadConnector or OffloadingConnector")


class KvcoreSchedulerMixin:
    """Mixed in before a vLLM ``Scheduler`` class: kvcore manages its KV cache.

    ``kvcore_required`` (the ``scheduler_cls`` route): kvcore always, with defaults when
    ``additional_config`` has no ``"kvcore"`` entry.  The general plugin's classes set it to
    ``False``: kvcore only when that entry is present (the opt-in), vLLM's manager otherwise.
    """

    kvcore_required: ClassVar[bool] = True
    kvcore_settings: KvcoreSettings | None
    kvcore_queue: CacheAwareQueue | None
    kv_cache_manager: Any
    policy: Any
    waiting: Any
    kv_holding_waiting: Any
    running: Any

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any,
                 **kwargs: Any) -> None:
        settings = settings_from_additional_config(vllm_config.additional_config)
        if settings is None and self.kvcore_required:
            settings = KvcoreSettings()
        self.kvcore_settings = settings
        self.kvcore_queue = None
        self._kvcore_declared: tuple[tuple[int, object, bool], ...] = ()
        vllm_init = cast(Any, super()).__init__  # the vLLM scheduler class mixed in after
        if settings is None:
            vllm_init(vllm_config, kv_cache_config, *args, **kwargs)
            return
        # A vLLM version kvcore was not checked against is refused (or probed) here, once: the
        # adapter is handed the result.
        version = installed_vllm(allow_unreleased=settings.allow_unreleased_vllm)
        factory = functools.partial(self.kvcore_manager_factory(settings), vllm_version=version)
        with _CONSTRUCTION_LOCK:
            # The one name vLLM's __init__ constructs its manager by, restored right after.
            vllm_class = vllm_scheduler_module.KVCacheManager
            vllm_scheduler_module.KVCacheManager = factory
            try:
                vllm_init(vllm_config, kv_cache_config, *args, **kwargs)
            finally:
                vllm_scheduler_module.KVCacheManager = vllm_class
        _check_connector(getattr(self, "connector", None))
        queue = make_queue(self.kv_cache_manager, settings)
        if queue is not None:
            if self.policy.value != "fcfs":
                raise UnsupportedFeatureError(
                    f"kvcore's schedule_policy {settings.schedule_policy!r} reorders vLLM's "
                    f"FCFS waiting queue; vLLM's scheduling policy is {self.policy.value!r}: "
                    "use one or the other")
            self.waiting = self.kvcore_queue = queue  # empty yet: nothing was added

    def kvcore_manager_factory(self, settings: KvcoreSettings) -> Callable[..., Any]:
        """What vLLM's ``__init__`` constructs in place of its ``KVCacheManager`` (called with
        vLLM's arguments): the adapter with ``settings``.  The vLLM replay's offline bounds
        override it (:mod:`~kvcore.integrations.vllm.replay_oracle`)."""
        return functools.partial(KVCacheManagerAdapter, settings=settings)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``schedule``, after putting the waiting queue in kvcore's admission order
        (``schedule_policy``) and declaring the head of the waiting queues to kvcore's pool
        (``queue_hints``) when it changed."""
        if self.kvcore_queue is not None:
            self.kvcore_queue.reorder()
        settings = self.kvcore_settings
        if settings is not None and settings.queue_hints:
            head = list(islice(chain(self.kv_holding_waiting, self.waiting), settings.queue_hints))
            key = hint_key(head)
            if key != self._kvcore_declared:
                self.kv_cache_manager.declare_upcoming(head)
                self._kvcore_declared = key
        return cast(Any, super()).schedule(*args, **kwargs)

    def _update_requests_with_invalid_blocks(self, requests: Any, *args: Any,
                                             **kwargs: Any) -> Any:
        """vLLM's rollback of the requests whose KV a connector failed to load, to their first
        failed block; then, under vLLM's ``recompute`` policy, a request whose kvcore tables
        cannot go on from there (``KVCacheManagerAdapter.rewind_after_failed_load``: a sliding
        window, a chunk, a Mamba state) starts over instead: a running one is preempted (it
        recomputes from its valid cached prefix; what it held from the failed block on left the
        cache), a loading one is set to nothing computed (vLLM then frees it when its load is
        reported, as any failed load).  Before, it went on from the failed block with null
        blocks where its window or chunk reads.  Full attention is never affected."""
        requests = list(requests)  # (vLLM passes the loading requests as a generator)
        result = cast(Any, super())._update_requests_with_invalid_blocks(requests, *args,
                                                                          **kwargs)
        if (self.kvcore_settings is None
                or not getattr(self, "recompute_kv_load_failures", True)):
            return result
        affected = result[0]
        manager = self.kv_cache_manager
        for request in requests:
            if (request.request_id not in affected
                    or manager.rewind_after_failed_load(request)):
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                cast(Any, self)._preempt_request(request, time.monotonic(),
                                                 drop_stale_output=True)
            else:
                request.num_computed_tokens = 0
        return result


class Scheduler(KvcoreSchedulerMixin, VllmScheduler):
    """vLLM's synchronous ``Scheduler`` with kvcore as its KV-cache manager."""


class AsyncScheduler(KvcoreSchedulerMixin, VllmAsyncScheduler):
    """vLLM's ``AsyncScheduler`` with kvcore as its KV-cache manager."""


@functools.cache
def with_kvcore(scheduler_cls: type) -> type:
    """``scheduler_cls`` with kvcore as its KV-cache manager when ``additional_config`` has a
    ``"kvcore"`` entry (the general plugin's route); a class that already mixes kvcore in is
    returned as it is."""
    if issubclass(scheduler_cls, KvcoreSchedulerMixin):
        return scheduler_cls
    return type(f"Kvcore{scheduler_cls.__name__}", (KvcoreSchedulerMixin, scheduler_cls),
                {"kvcore_required": False, "__module__": __name__,
                 "__doc__": f"{scheduler_cls.__qualname__} with kvcore as its KV-cache manager "
                            "when additional_config has a 'kvcore' entry."})
