"""``checked(manager)``: a KVCacheManager that checks itself after its public calls.

The manager keeps its identity and stays an instance of its class (it gets a class of its own: a
subclass of its class, with :class:`CheckedKVCacheManager` on top, whose public methods run the
checks after the call; see :mod:`kvcore.testing._layers`), so a scheduler that already holds it
is checked without any change, in the pure-Python and the compiled build alike.  After every
``every``-th call — successful or refused — ``check_invariants()`` runs; a broken rule raises
:class:`~kvcore.errors.InvariantError` naming the call, its arguments and the rule.

With ``track_contents=True`` a :class:`~kvcore.testing.oracle.ContentOracle` follows what every KV
slot holds, as kvcore's contract defines it: the tokens an ``allocate_slots`` call schedules are
written by that step (external tokens when loaded: at the call, or at ``cache_blocks`` when the
load was delayed), ``uncache_blocks`` marks a failed step's slots unwritten, ``new_step`` ends a
step.  Every hit a request adopts, and every running request's table, must then hold that
request's own KV: a scheduler that serves a request KV computed for other tokens (passing another
request's hits, changing a prompt after admission, ...) is caught with rule ``wrong-kv``.

A failed step is invisible to the manager (the calls around it are those of a step that ran), so
the code playing the engine says so: :func:`step_failed` right after the step fails, before the
scheduler is told.  Its slots then hold garbage whatever the scheduler does, and at the next
``new_step`` every block the step wrote must have left the prefix cache: a scheduler that forgets
``uncache_blocks`` after a failed step is caught there (rule ``wrong-kv``), and a request that
would hit such a block meanwhile is caught at the hit.  ``uncache_blocks`` says the request's KV
from that token on was never written: the requests sharing those blocks (a hit on them, e.g.
on blocks a failed KV load was to fill) are checked again from the next ``new_step`` too, by
when the scheduler must have set them back.  Not checked: the table of a request whose delayed
load is not reported yet (it is built for the load's end), and that of a finished request whose
blocks a KV connector still holds (no next token reads it).

A hit passed to ``allocate_slots`` whose blocks are cached under another prefix's hash is refused
by the manager.  When the hit was found for this very request and the pool evicted its block
since (it went stale between lookup and allocation), the manager's
:class:`~kvcore.errors.StaleHitError` says so and passes through unchanged; otherwise (another
request's ``get_computed_blocks`` result) the checked manager's
:class:`~kvcore.errors.InvalidHitError` says that the blocks belong to a different prefix.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar

from kvcore.errors import InvalidArgumentError, InvalidHitError, InvariantError
from kvcore.hashing import hashes_at
from kvcore.manager import KVCacheManager, evictions_since_lookup
from kvcore.request import RequestStatus
from kvcore.testing._layers import add_layer, remove_layer
from kvcore.testing.oracle import ContentOracle, WrongKVError
from kvcore.types import KVCacheBlock, KVRequest

_M = TypeVar("_M", bound=KVCacheManager)

# The calls that are checked (the manager's public API that reads or changes state).
CHECKED_CALLS = ("get_computed_blocks", "allocate_slots", "free", "pop_blocks_for_free",
                 "free_withheld", "cache_blocks", "uncache_blocks", "remove_skipped_blocks",
                 "reset_prefix_cache", "evict_blocks", "new_step", "record_prefix_cache_stats",
                 "take_events", "make_prefix_cache_stats", "set_num_free_blocks")


class _CheckState:
    __slots__ = ("calls", "every", "oracle", "pending_loads", "step_writers", "suspended",
                 "written_upto")

    def __init__(self, manager: KVCacheManager, every: int, track_contents: bool) -> None:
        self.every = every
        self.calls = 0
        self.oracle = ContentOracle(manager) if track_contents else None
        self.pending_loads: dict[str, int] = {}  # request id -> first position of a delayed load
        self.written_upto: dict[str, int] = {}  # request id -> end of what its steps wrote
        self.step_writers: set[str] = set()  # requests that wrote KV in the current step
        # Requests whose table lost KV this step (a failed step, uncache_blocks): the scheduler
        # resets or aborts them next; their tables are checked again from the next new_step.
        self.suspended: set[str] = set()

    def wrote(self, request_id: str, end: int) -> None:
        self.written_upto[request_id] = max(end, self.written_upto.get(request_id, 0))
        self.step_writers.add(request_id)


def _describe(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    parts = [_short(a) for a in args] + [f"{k}={_short(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _short(value: Any) -> str:
    rid = getattr(value, "request_id", None)
    if isinstance(rid, str):
        return f"<request {rid!r}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


if TYPE_CHECKING:
    _Layer = KVCacheManager  # what the mixin's methods and super() calls reach
else:
    _Layer = object


class CheckedKVCacheManager(_Layer):
    """The layer :func:`checked` puts on a manager's class (a mixin, never constructed
    directly): ``isinstance(manager, CheckedKVCacheManager)`` tells whether it is checked."""

    __slots__ = ()
    _kvcore_check: _CheckState  # a class attribute of the manager's own layer class

    def _after_call(self, what: Callable[[], str]) -> None:
        state = self._kvcore_check
        state.calls += 1
        if state.calls % state.every:
            return
        try:
            self.check_invariants()
            if state.oracle is not None:
                for rid, req in self.requests().items():
                    # (Not a request whose delayed load is not reported yet: its table is built
                    # for the load's end, checked once cache_blocks says so; nor a finished one
                    # whose blocks a KV connector still holds: no next token reads them.)
                    status = getattr(req, "status", None)
                    if (rid not in state.suspended and rid not in state.pending_loads
                            and not (isinstance(status, RequestStatus) and status.is_finished)):
                        state.oracle.check_table(req)
        except InvariantError as exc:
            raise InvariantError(exc.rule, f"after {what()}: {exc.detail}",
                                 block_id=exc.block_id, observed=exc.observed) from exc
        except WrongKVError as exc:
            raise InvariantError("wrong-kv", f"after {what()}: {exc}") from exc

    def _oracle_allocated(self, request: KVRequest, before: int, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> None:
        """Record what a successful allocate_slots call schedules to be written."""
        state = self._kvcore_check
        oracle = state.oracle
        assert oracle is not None
        bound = _bind_allocate(args, kwargs)
        num_new = int(bound.get("num_new_tokens", 0))
        num_hit = int(bound.get("num_new_computed_tokens", 0) or 0)
        num_external = int(bound.get("num_external_computed_tokens", 0) or 0)
        hits = bound.get("new_computed_blocks")
        rid = request.request_id
        if num_hit and hits is not None:
            oracle.check_hit(request, hits, num_hit)
        start = before + num_hit
        if bound.get("delay_cache_blocks") and num_external:
            state.pending_loads[rid] = start
            start += num_external  # loaded later: written when cache_blocks says so
            num_external = 0
        end = min(start + num_external + num_new, request.num_tokens)
        if end > start:
            oracle.written(request, start, end, min(start + num_external, end))
            state.wrote(rid, end)

    # -- the checked calls ----------------------------------------------------------------------
    def allocate_slots(self, request: KVRequest, *args: Any, **kwargs: Any) -> Any:
        state = self._kvcore_check
        before = request.num_computed_tokens
        managers = self.coordinator.managers
        copies_before = [len(m.pending_copies) for m in managers]
        try:
            out = super().allocate_slots(request, *args, **kwargs)
            if out is not None and state.oracle is not None:
                # The block copies this allocation recorded (a partial-block hit's copy-on-write)
                # run before its step writes anything.
                for m, n in zip(managers, copies_before):
                    for source, destination in m.pending_copies[n:]:
                        state.oracle.copied(source, destination)
                self._oracle_allocated(request, before, args, kwargs)
        except WrongKVError as exc:
            what = _describe("allocate_slots", (request, *args), kwargs)
            raise InvariantError("wrong-kv", f"in {what}: {exc}") from exc
        except InvalidHitError as exc:
            foreign = _foreign_hit(self, request, _bind_allocate(args, kwargs))
            if foreign is None:
                raise
            raise InvalidHitError(foreign) from exc
        finally:
            self._after_call(lambda: _describe("allocate_slots", (request, *args), kwargs))
        return out

    def cache_blocks(self, request: KVRequest, num_computed_tokens: SupportsIndex) -> None:
        state = self._kvcore_check
        try:
            super().cache_blocks(request, num_computed_tokens)
            start = state.pending_loads.pop(request.request_id, None)
            if state.oracle is not None and start is not None:
                end = min(operator.index(num_computed_tokens), request.num_tokens)
                state.oracle.written(request, start, end, end)  # loaded, not computed
                state.wrote(request.request_id, end)
        finally:
            self._after_call(lambda: _describe("cache_blocks", (request, num_computed_tokens), {}))

    def uncache_blocks(self, request: KVRequest, num_computed_tokens: SupportsIndex) -> None:
        state = self._kvcore_check
        try:
            super().uncache_blocks(request, num_computed_tokens)
            n = operator.index(num_computed_tokens)  # accepted above: an int or numpy integer
            end = state.written_upto.get(request.request_id, 0)
            if state.oracle is not None and end > n:
                state.oracle.discard(request, n, end)
                state.written_upto[request.request_id] = n
                state.suspended.add(request.request_id)
                # Requests that hit those blocks lost that KV too (the scheduler sets them back
                # in the same step, e.g. after a failed load): checked from the next new_step.
                lost = {b.block_id for m, blocks in zip(self.coordinator.managers,
                                                        self.get_blocks(request.request_id))
                        for b in blocks[n // m.block_size:] if not b.is_null}
                for rid in self.requests():
                    if any(b.block_id in lost for blocks in self.get_blocks(rid) for b in blocks):
                        state.suspended.add(rid)
        finally:
            self._after_call(
                lambda: _describe("uncache_blocks", (request, num_computed_tokens), {}))

    def free(self, request: KVRequest, *, retain: object = False) -> None:
        state = self._kvcore_check
        try:
            if retain is not False:  # only then: a subclass may override free(request)
                super().free(request, retain=retain)
            else:
                super().free(request)
            state.pending_loads.pop(request.request_id, None)
            state.written_upto.pop(request.request_id, None)
            state.suspended.discard(request.request_id)
        finally:
            self._after_call(lambda: _describe("free", (request,), {"retain": retain} if retain else {}))

    def pop_blocks_for_free(self, request: KVRequest) -> list[KVCacheBlock]:
        state = self._kvcore_check
        try:
            blocks = super().pop_blocks_for_free(request)
            state.pending_loads.pop(request.request_id, None)
            state.written_upto.pop(request.request_id, None)
            state.suspended.discard(request.request_id)
            return blocks
        finally:
            self._after_call(lambda: _describe("pop_blocks_for_free", (request,), {}))

    def free_withheld(self, ordered_blocks: Iterable[object]) -> None:
        blocks = list(ordered_blocks)
        try:
            super().free_withheld(blocks)
        finally:
            self._after_call(lambda: _describe("free_withheld", (blocks,), {}))

    def new_step(self) -> None:
        try:
            super().new_step()
            state = self._kvcore_check
            state.step_writers.clear()
            state.suspended.clear()
            oracle = state.oracle
            if oracle is not None:
                oracle.end_step()
                oracle.check_failed_uncached()
        except WrongKVError as exc:
            raise InvariantError("wrong-kv", f"at new_step(): {exc}") from exc
        finally:
            self._after_call(lambda: "new_step()")


_ALLOCATE_ARGS = ("num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
                  "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks")


def _bind_allocate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """allocate_slots' arguments after the request, by name."""
    bound = dict(zip(_ALLOCATE_ARGS, args))
    bound.update({k: v for k, v in kwargs.items() if k in _ALLOCATE_ARGS})
    return bound


def _foreign_hit(manager: KVCacheManager, request: KVRequest,
                 bound: dict[str, Any]) -> str | None:
    """Why the hit in ``bound`` was refused if one of its blocks is cached under a hash that is
    not the request's at its position (a hit looked up for a different prefix); else None,
    also for a hit of this request's own lookup that went stale (the manager says so)."""
    hits = bound.get("new_computed_blocks")
    if hits is None or evictions_since_lookup(hits, request, manager.pool):
        return None
    hashes = request.block_hashes
    for g, (group, blocks) in enumerate(zip(manager.config.groups, hits)):
        mine = hashes_at(hashes, manager.hash_block_size, group.spec.block_size)
        for i, block in enumerate(blocks):
            if (not isinstance(block, KVCacheBlock) or block.is_null
                    or block.block_hash is None
                    or manager.pool.blocks[block.block_id] is not block):
                continue
            if i >= len(mine) or block.block_hash != mine[i] or block.group_id != g:
                return (f"request {request.request_id!r}: group {g} position {i} of the hit: "
                        f"block {block.block_id} is cached for a different prefix, not this "
                        "request's (new_computed_blocks must come from get_computed_blocks for "
                        "this request)")
    return None


def _wrap_plain(name: str) -> Callable[..., Any]:
    base = getattr(KVCacheManager, name)

    @functools.wraps(base)
    def call(self: CheckedKVCacheManager, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(super(CheckedKVCacheManager, self), name)(*args, **kwargs)
        finally:
            self._after_call(lambda: _describe(name, args, kwargs))

    return call


for _name in CHECKED_CALLS:
    if _name not in CheckedKVCacheManager.__dict__:
        setattr(CheckedKVCacheManager, _name, _wrap_plain(_name))


def step_failed(manager: KVCacheManager) -> None:
    """Tell a :func:`checked` manager with ``track_contents`` that the step scheduled since its
    last ``new_step()`` was never executed (the forward failed): none of the KV it was to write
    exists.  Call it before the scheduler learns of the failure; see the module docstring."""
    state = manager._kvcore_check if isinstance(manager, CheckedKVCacheManager) else None
    if state is None or state.oracle is None:
        raise InvalidArgumentError(
            f"step_failed() needs a manager checked with track_contents=True, got {manager!r}")
    state.oracle.fail_step()
    state.suspended |= state.step_writers


def checked(manager: _M, *, every: int = 1, track_contents: bool = False) -> _M:
    """Turn checking on for ``manager`` (in place) and return it.

    ``every``: run the checks after every n-th call (1: all).  ``track_contents``: also follow
    what each KV slot holds and check every adopted hit and running table against it (see the
    module docstring; report failed steps with :func:`step_failed`); it needs a manager that
    holds no request yet, so the oracle sees every write.  Calling it again replaces the settings; :func:`unchecked` turns checking off.
    """
    if not isinstance(manager, KVCacheManager):
        raise InvalidArgumentError(f"checked() needs a KVCacheManager, got {manager!r}")
    if every.__class__ is not int or every < 1:
        raise InvalidArgumentError(f"every must be a positive int, got {every!r}")
    if track_contents and manager.requests():
        raise InvalidArgumentError(
            f"track_contents needs a manager that holds no request yet, this one holds "
            f"{sorted(manager.requests())}")
    state = _CheckState(manager, every, track_contents)
    remove_layer(manager, CheckedKVCacheManager)
    add_layer(manager, CheckedKVCacheManager, _kvcore_check=state)
    return manager


def unchecked(manager: _M) -> _M:
    """Turn :func:`checked`'s checks off (in place) and return the manager."""
    remove_layer(manager, CheckedKVCacheManager)
    return manager


def is_checked(manager: KVCacheManager) -> bool:
    """Whether :func:`checked` is on for ``manager``."""
    return isinstance(manager, CheckedKVCacheManager)


def assert_no_leak(manager: KVCacheManager) -> None:
    """Raise ``AssertionError`` with a readable message if a request still holds blocks (a
    forgotten ``free``) or a block is neither free nor held (a leak); then run the invariants."""
    held = sorted(manager.requests())
    if held:
        raise AssertionError(f"kvcore: requests still hold KV-cache blocks: {held} "
                             "(a forgotten free()?)")
    manager.check_invariants()
    usable = manager.config.num_blocks - 1
    if manager.num_free_blocks != usable:
        raise AssertionError(f"kvcore: {usable - manager.num_free_blocks} KV-cache blocks leaked "
                             "(no request holds them, yet they are not free)")
