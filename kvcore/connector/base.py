"""The KV connector interface, in the shape of vLLM v1's ``KVConnectorBase_V1``.

A connector moves KV between the device cache and somewhere else (a host-memory tier, another
instance, a store).  One class, two roles: the **scheduler** side decides what to load and
store and tells the workers through per-step metadata; the **worker** side copies the bytes.

Scheduler side, called by :class:`kvcore.scheduler.Scheduler`:

* ``get_num_new_matched_tokens(request, num_computed_tokens) -> (int | None, bool)``: how many
  tokens beyond the local prefix hit the connector can supply, and whether it loads them
  asynchronously (the request then waits, holding its blocks, without blocking the batch).
  ``None`` means "not known yet, ask again next step".  The request's last token is never
  supplied (its logits must be computed): the scheduler takes at most
  ``request.num_tokens - num_computed_tokens - 1`` of the tokens offered, and treats a load
  that this leaves empty as no load (vLLM's connectors keep the same rule).
* ``update_state_after_alloc(request, blocks, num_external_tokens)``: the blocks were allocated
  (``allocate_slots(num_external_computed_tokens=..., delay_cache_blocks=<async>)``).
* ``build_connector_meta(scheduler_output) -> KVConnectorMetadata``: this step's work.
* ``update_connector_output(output)``: what the workers finished.
* ``request_finished(request, block_ids) -> (delay_free, params)``: ``delay_free`` keeps the
  blocks until the workers report the request in ``finished_sending``.
* ``take_events()``: KV events of the tier (``medium="CPU"`` for a host tier).

Worker side, called by an engine around each forward: ``register_kv_caches``,
``bind_connector_metadata``, ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``clear_connector_metadata``; :meth:`KVConnectorBase.connector_output` gathers what
``update_connector_output`` needs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvcore.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvcore.events import KVCacheEvent
    from kvcore.request import Request
    from kvcore.types import KVCacheBlocks


class KVConnectorMetadata:
    """Base of the per-step message from the scheduler side to the workers."""


class ScheduledStep(Protocol):
    """What a connector reads of one request's share of a step (the scheduler's
    ``ScheduledRequest``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def request(self) -> Request: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def block_ids(self) -> tuple[list[int], ...]: ...


class StepOutput(Protocol):
    """What a connector reads of a step's schedule (the scheduler's ``SchedulerOutput``)."""

    @property
    def scheduled(self) -> Sequence[ScheduledStep]: ...


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorOutput:
    """What the workers report after a step: requests whose stores (``finished_sending``) or
    loads (``finished_recving``) completed, device blocks whose load failed, and the
    connector's own data (``worker_meta``)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    worker_meta: Any = None

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.worker_meta)


class KVConnectorBase:
    """Base class; subclasses override the calls of the roles they serve."""

    def __init__(self, role: KVConnectorRole) -> None:
        if not isinstance(role, KVConnectorRole):
            raise InvalidArgumentError(f"role must be a KVConnectorRole, got {role!r}")
        self.role = role
        self._metadata: KVConnectorMetadata | None = None

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the connector can supply (``None``: not known
        yet) and whether it loads them asynchronously.  At most ``request.num_tokens -
        num_computed_tokens - 1`` are taken: the last token is always computed."""
        raise NotImplementedError

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output: StepOutput) -> KVConnectorMetadata:
        raise NotImplementedError

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Default: nothing to track."""

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def take_events(self) -> list[KVCacheEvent]:
        return []

    def failed_step_output(self, metadata: KVConnectorMetadata | None) -> KVConnectorOutput:
        """The engine could not run the step that carried ``metadata``: what the scheduler
        should treat as its outcome (loads it started reported finished and failed).
        Default: nothing was in flight."""
        return KVConnectorOutput()

    # -- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """The device KV tensors, by name."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def metadata(self) -> KVConnectorMetadata | None:
        return self._metadata

    def start_load_kv(self, **kwargs: Any) -> None:
        """Start this step's loads (before the forward)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (called before its attention)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Start saving ``layer_name``'s KV (called after its attention)."""

    def wait_for_save(self) -> None:
        """Called after the forward: saves are issued (or done) when it returns."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                  set[str] | None]:
        """Requests whose sends and whose receives completed since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_worker_meta(self) -> Any:
        return None

    def connector_output(self, finished_req_ids: set[str] | None = None) -> KVConnectorOutput:
        """``get_finished`` + load errors + worker data, as the scheduler side reads them."""
        sending, recving = self.get_finished(finished_req_ids or set())
        return KVConnectorOutput(sending or set(), recving or set(),
                                 self.get_block_ids_with_load_errors(), self.get_worker_meta())
