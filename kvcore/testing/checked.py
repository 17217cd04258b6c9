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
request's hits, changing a prompt after admission, forgetting ``uncache_blocks`` after a failed
step, ...) is caught with rule ``wrong-kv``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsIndex, TypeVar

from kvcore.errors import InvalidArgumentError, InvariantError
from kvcore.manager import KVCacheManager
from kvcore.request import KVRequest
from kvcore.testing._layers import add_layer, remove_layer
from kvcore.testing.oracle import ContentOracle, WrongKVError

_M = TypeVar("_M", bound=KVCacheManager)

# The calls that are checked (the manager's public API that reads or changes state).
CHECKED_CALLS = ("get_computed_blocks", "allocate_slots", "free", "cache_blocks",
                 "uncache_blocks", "remove_skipped_blocks", "reset_prefix_cache", "evict_blocks",
                 "new_step", "record_prefix_cache_stats", "take_events",
                 "make_prefix_cache_stats")


class _CheckState:
    __slots__ = ("calls", "every", "oracle", "pending_loads", "written_upto")

    def __init__(self, manager: KVCacheManager, every: int, track_contents: bool) -> None:
        self.every = every
        self.calls = 0
        self.oracle = ContentOracle(manager) if track_contents else None
        self.pending_loads: dict[str, int] = {}  # request id -> first position of a delayed load
        self.written_upto: dict[str, int] = {}  # request id -> end of what its steps wrote


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
                for req in self.requests().values():
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
        names = ("num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
                 "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks")
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
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
            oracle.written(request, start, end)
            state.written_upto[rid] = max(end, state.written_upto.get(rid, 0))

    # -- the checked calls ----------------------------------------------------------------------
    def allocate_slots(self, request: KVRequest, *args: Any, **kwargs: Any) -> Any:
        state = self._kvcore_check
        before = request.num_computed_tokens
        try:
            out = super().allocate_slots(request, *args, **kwargs)
            if out is not None and state.oracle is not None:
                self._oracle_allocated(request, before, args, kwargs)
        except WrongKVError as exc:
            what = _describe("allocate_slots", (request, *args), kwargs)
            raise InvariantError("wrong-kv", f"in {what}: {exc}") from exc
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
                state.oracle.written(request, start, end)
                rid = request.request_id
                state.written_upto[rid] = max(end, state.written_upto.get(rid, 0))
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
        finally:
            self._after_call(lambda: _describe("free", (request,), {"retain": retain} if retain else {}))

    def new_step(self) -> None:
        try:
            super().new_step()
            if self._kvcore_check.oracle is not None:
                self._kvcore_check.oracle.end_step()
        finally:
            self._after_call(lambda: "new_step()")


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


def checked(manager: _M, *, every: int = 1, track_contents: bool = False) -> _M:
    """Turn checking on for ``manager`` (in place) and return it.

    ``every``: run the checks after every n-th call (1: all).  ``track_contents``: also follow
    what each KV slot holds and check every adopted hit and running table against it (see the
    module docstring); it needs a manager that holds no request yet, so the oracle sees every
    write.  Calling it again replaces the settings; :func:`unchecked` turns checking off.
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
