"""Admission order of a scheduler's waiting queue (``SchedulerConfig(schedule_policy=...)``).

Eviction decides which cached block goes; this decides which waiting request is admitted next,
so that requests sharing a prefix run while it is cached.  Policies (``POLICIES``):

* ``fcfs``: arrival order (vLLM's; the default).  Nothing is reordered.
* ``lpm``: longest cached prefix first (SGLang's ``lpm``).  Estimates are not a full lookup per
  request per step: each step refreshes at most ``lpm_lookups_per_step`` of them (requests never
  looked up first, then the stalest), the others keep their last estimate.
* ``dfs-weight``: groups requests by shared prefix even when nothing is cached yet (SGLang's
  ``dfs-weight``, over the waiting requests' own block hashes instead of the radix cache): a
  prefix tree of the waiting requests' chained block hashes (the first ``DFS_MAX_DEPTH``), walked
  depth first with the heavier subtree (more requests) first, ties to the earlier arrival; a
  request whose path ends at a node comes before its node's children.

Only fresh requests are reordered.  Requests that already hold KV or a step's token (preempted
ones, connector loads, a token in flight) keep their place at the head, in the scheduler's
order, as under FCFS.

:class:`WaitingOrder` knows requests only through ``request_id``, ``block_hashes`` and two
functions its owner gives it (a request's cached-prefix estimate, and whether it is pinned to
the head), so the same order serves kvcore's scheduler and vLLM's waiting queue
(:mod:`kvcore.integrations.vllm.queue`).

Starvation guard (every non-FCFS policy): a request that has waited more than
``max_waiting_steps`` scheduler steps (counted from the first step that saw it waiting) goes
ahead of every fresh request that has not, in arrival order.  So once past the bound it waits
only for the pinned head, older starved requests, and room in the batch and the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, MutableSequence, Sequence
from typing import Any, Generic, Protocol, TypeVar

from kvcore.errors import InvalidArgumentError

FCFS = "fcfs"
LPM = "lpm"
DFS_WEIGHT = "dfs-weight"
POLICIES = (FCFS, LPM, DFS_WEIGHT)
RECOMMENDED_NAME = "recommended"
RECOMMENDED = LPM
"""What ``recommended`` means: ``lpm``, measured with the recommended eviction on the shipped
Mooncake trace, the ``agent`` workload (512-token blocks, 1k-8k blocks) and a loaded multi-turn
workload (docs/policies.md, BENCHMARKS.md 2026-11-26).  The default stays ``fcfs``:
vLLM's order, which the differential suite checks."""
DFS_MAX_DEPTH = 256  # block hashes per request in the dfs-weight tree


def hint_key(requests: Iterable[Any]) -> tuple[tuple[int, object, bool], ...]:
    """What declaring ``requests`` to the cache (``declare_upcoming``) declares, as a value: per
    request its number of block hashes, its last chained hash (which names the whole prefix) and
    whether it skips the prefix cache.  A scheduler re-declares only when this changes, whatever
    objects carry the requests (kvcore's scheduler and the vLLM mix-in both)."""
    return tuple((len(h), h[-1] if h else None, r.skip_reading_prefix_cache)
                 for r in requests for h in (r.block_hashes,))


def resolve(name: object) -> str:
    """A policy name (``recommended`` resolved); raises naming an unknown one."""
    if name == RECOMMENDED_NAME:
        return RECOMMENDED
    if not isinstance(name, str) or name not in POLICIES:
        raise InvalidArgumentError(f"unknown schedule_policy {name!r}; the policies are "
                                   f"{', '.join(POLICIES)} and {RECOMMENDED_NAME}")
    return name


class OrderConfig(Protocol):
    """The fields of ``SchedulerConfig`` a :class:`WaitingOrder` reads."""

    @property
    def schedule_policy(self) -> str: ...
    @property
    def max_waiting_steps(self) -> int: ...
    @property
    def lpm_lookups_per_step(self) -> int: ...


class Orderable(Protocol):
    """What an order reads of a waiting request (kvcore's ``Request``, vLLM's ``Request``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def block_hashes(self) -> Sequence[Hashable]: ...


R = TypeVar("R", bound=Orderable)


class WaitingOrder(Generic[R]):
    """Reorders a waiting queue in place each step (``fcfs``: leaves it alone).

    ``hit_tokens(request)``: the tokens of its prefix cached now (a lookup without side effects
    on the cache; ``lpm`` calls it at most ``lpm_lookups_per_step`` times a step).
    ``pinned(request)``: it holds KV or a token in flight, and keeps its place at the head.
    """

    def __init__(self, config: OrderConfig, hit_tokens: Callable[[R], int],
                 pinned: Callable[[R], bool]) -> None:
        self.policy = resolve(config.schedule_policy)
        self.max_waiting_steps = config.max_waiting_steps
        self.lookups_per_step = config.lpm_lookups_per_step
        self._hit_tokens = hit_tokens
        self._pinned = pinned
        # What the order remembers of a request is kept with the request object and used only
        # for that object: a request aborted and submitted again under its id between two
        # reorders is a new request (it inherits no wait, no estimate, no place).
        # id -> (request, first step seen waiting, seq)
        self._since: dict[str, tuple[R, int, int]] = {}
        self._seq = 0
        # lpm: id -> (request, hit tokens, step looked up)
        self._hits: dict[str, tuple[R, int, int]] = {}
        self.num_lookups = 0  # lpm prefix lookups made (bounded per step)
        # dfs-weight: the last input (its requests' id() values: the cached order holds the
        # objects, so none of them can be collected and its id() reused) and its order.
        self._dfs_cache: tuple[tuple[int, ...], list[R]] = ((), [])

    def reorder(self, waiting: MutableSequence[R], step: int) -> None:
        """Put ``waiting`` in this policy's admission order for scheduler step ``step``."""
        if self.policy == FCFS:
            return
        is_pinned = self._pinned
        pinned: list[R] = []
        fresh: list[R] = []
        for req in waiting:
            (pinned if is_pinned(req) else fresh).append(req)
        known = self._since
        since: dict[str, tuple[R, int, int]] = {}
        for req in fresh:
            rid = req.request_id
            entry = known.get(rid)
            if entry is None or entry[0] is not req:
                entry = (req, step, self._seq)
                self._seq += 1
            since[rid] = entry
        self._since = since  # forget requests that left the queue

        def arrival(req: R) -> tuple[int, int]:
            entry = since[req.request_id]
            return entry[1], entry[2]
        if len(fresh) < 2:
            return
        bound = step - self.max_waiting_steps
        starved = sorted((r for r in fresh if since[r.request_id][1] < bound), key=arrival)
        rest = [r for r in fresh if since[r.request_id][1] >= bound]
        rest.sort(key=arrival)  # arrival order: the tie-break
        ordered = self._lpm(rest, step) if self.policy == LPM else self._dfs(rest)
        waiting.clear()
        waiting.extend(pinned)
        waiting.extend(starved)
        waiting.extend(ordered)

    # -- policies -----------------------------------------------------------------------------
    def _lpm(self, reqs: list[R], step: int) -> list[R]:
        known = self._hits
        hits: dict[str, tuple[R, int, int] | None] = {}
        for r in reqs:
            h = known.get(r.request_id)
            hits[r.request_id] = h if h is not None and h[0] is r else None

        def looked_up(req: R) -> int:  # never (-1) first, then the stalest
            h = hits[req.request_id]
            return -1 if h is None else h[2]
        for req in sorted(reqs, key=looked_up)[:self.lookups_per_step]:
            hits[req.request_id] = (req, self._hit_tokens(req), step)
            self.num_lookups += 1
        self._hits = {rid: h for rid, h in hits.items() if h is not None}

        def estimate(req: R) -> int:
            h = hits[req.request_id]
            return 0 if h is None else -h[1]
        return sorted(reqs, key=estimate)  # stable: equal estimates stay in arrival order

    def _dfs(self, reqs: list[R]) -> list[R]:
        key = tuple(map(id, reqs))
        if key != self._dfs_cache[0]:  # the same requests keep their order (hashes are fixed)
            self._dfs_cache = (key, dfs_weight_order(
                reqs, [r.block_hashes[:DFS_MAX_DEPTH] for r in reqs]))
        return self._dfs_cache[1]


class _Node:
    __slots__ = ("children", "ends", "first", "weight")

    def __init__(self, first: int) -> None:
        self.children: dict[Hashable, _Node] = {}
        self.ends: list[int] = []  # requests whose path ends here (indices, arrival order)
        self.weight = 0  # requests in this subtree
        self.first = first  # the earliest request index in it


def dfs_weight_order(reqs: Sequence[R], paths: Sequence[Sequence[Hashable]]) -> list[R]:
    """``reqs`` (in arrival order) grouped by shared prefix: the depth-first walk of the prefix
    tree of ``paths`` (chained block hashes: each names its whole prefix), heavier subtrees
    first, ties to the earlier arrival."""
    root = _Node(0)
    for i, path in enumerate(paths):
        node = root
        node.weight += 1
        for h in path:
            child = node.children.get(h)
            if child is None:
                child = node.children[h] = _Node(i)
            child.weight += 1
            node = child
        node.ends.append(i)
    out: list[R] = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(reqs[i] for i in node.ends)
        # Pushed lightest last-first: the heaviest (then earliest) child is popped next.
        stack.extend(sorted(node.children.values(), key=lambda n: (n.weight, -n.first)))
    return out

