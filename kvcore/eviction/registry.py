"""The one registry of eviction policies: name -> class.

Every place that names a policy reads it from here: the pool (``BlockPool(eviction_policy=)``,
``KVCacheManager(eviction_policy=)``), the simulator (``kvcore.sim.policies``), the command
line's ``--policy`` / ``--eviction-policy`` / ``--host-policy`` and their help, and kvcore
inside vLLM.  A policy is a subclass of :class:`~kvcore.eviction.base.EvictionPolicy` built as
``cls(blocks, **options)``; ``offline`` ones (they need the future, or are O(log n)) run in the
simulator only, and the pool refuses them.

A new built-in policy is one file in this package and one line in ``_BUILTIN``; a policy of
your own is one call::

    from kvcore.eviction import register_policy
    register_policy("mru", MyMRUPolicy)      # now KVCacheManager(..., eviction_policy="mru")

The registry is the one piece of process-wide state kvcore keeps on purpose: registering a
policy is how code outside kvcore extends every entry point at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvcore.errors import InvalidArgumentError
from kvcore.eviction.arc import ARCPolicy
from kvcore.eviction.base import EvictionPolicy
from kvcore.eviction.learned import LearnedPolicy
from kvcore.eviction.lru import FreeBlockQueue
from kvcore.eviction.offline import BeladyPolicy, FIFOPolicy, LFUPolicy, ReuseOraclePolicy
from kvcore.eviction.s3fifo import S3FIFOPolicy
from kvcore.eviction.slru import SLRUPolicy
from kvcore.types import KVCacheBlock

PolicyFactory = Callable[[Sequence[KVCacheBlock]], EvictionPolicy]
"""A policy of your own handed over directly: ``blocks -> EvictionPolicy``."""


@dataclass(frozen=True)
class PolicyInfo:
    """One registered policy: its name, class, one-line summary and whether it is offline
    (simulator only)."""

    name: str
    cls: type[EvictionPolicy]
    summary: str
    offline: bool


class Recommendation(NamedTuple):
    policy: str
    queue_hints: int


RECOMMENDED_NAME = "recommended"
"""The name that stands for :data:`RECOMMENDED` wherever a pool policy is named."""

RECOMMENDED = Recommendation("learned", 128)
"""The configuration the README recommends (``--eviction-policy recommended``): ``learned``
with its defaults and queue hints of depth 128, measured with the scheduler replay (kvcore's and
vLLM's) on the shipped Mooncake trace and the ``agent``, ``api`` and ``rag`` workloads at 1k-8k
blocks of 512 tokens: within 0.2 points of the recommendation before it (``slru`` with the same
hints) where queue hints decide (1k-2k blocks), ahead from 4k blocks and on ``rag``
(BENCHMARKS.md, 2026-11-28).  Inside vLLM 0.32's scheduler on the shipped trace it takes stock
vLLM's token hit rate from 7.66 / 13.43 / 23.11 / 38.45% to 12.05 / 23.79 / 29.67 / 43.30% at
1k / 2k / 4k / 8k blocks (BENCHMARKS.md, 2026-11-29, "learned-deep").  On a layout of more than one
KV-cache group (a hybrid Mamba model) ``learned`` ranks in LRU order, so there this is LRU with
the same hints: 0.3-1.1 points below ``slru`` with them at 2k-8k blocks."""

OFFLINE_BOUND = "belady"
"""The offline policy the simulator and the replay report as the bound."""
REUSE_ORACLE = "reuse_oracle"
"""The offline policy that knows which blocks are reused but not when (LRU otherwise)."""


class PolicyRegistry:
    """Policies by name, in registration order."""

    def __init__(self) -> None:
        self._entries: dict[str, PolicyInfo] = {}

    def register(self, name: str, cls: type[EvictionPolicy], *, offline: bool = False,
                 summary: str | None = None) -> None:
        """Add ``cls`` under ``name`` (``offline``: the simulator only).  ``summary`` defaults to
        the first line of the class docstring."""
        if not isinstance(name, str) or not name.isidentifier() or name == RECOMMENDED_NAME:
            raise InvalidArgumentError(f"a policy name must be an identifier other than "
                                       f"{RECOMMENDED_NAME!r}, got {name!r}")
        if not isinstance(cls, type) or not issubclass(cls, EvictionPolicy):
            raise InvalidArgumentError(f"policy {name!r} must be an EvictionPolicy subclass, "
                                       f"got {cls!r}")
        if name in self._entries:
            raise InvalidArgumentError(f"eviction policy {name!r} is already registered "
                                       f"({self._entries[name].cls.__name__})")
        if summary is None:
            # getattr: mypyc refuses cls.__doc__ on a native class ("Cannot access instance
            # attribute \"__doc__\" through class object"), and the compiled build would not build.
            summary = (getattr(cls, "__doc__", None) or "").strip().partition("\n")[0]
        self._entries[name] = PolicyInfo(name, cls, summary, bool(offline))

    def unregister(self, name: str) -> None:
        """Remove a policy registered earlier."""
        if self._entries.pop(name, None) is None:
            raise InvalidArgumentError(f"no eviction policy {name!r} is registered")

    def names(self, *, offline: bool = True) -> tuple[str, ...]:
        """Registered names; ``offline=False``: only those the pool runs."""
        return tuple(n for n, e in self._entries.items() if offline or not e.offline)

    def info(self, name: str) -> PolicyInfo:
        entry = self._entries.get(name)
        if entry is None:
            raise InvalidArgumentError(f"unknown eviction policy {name!r}; choose one of "
                                       f"{', '.join(self._entries)}")
        return entry

    def describe(self, *, offline: bool = True) -> str:
        """The policies as one line of help text: ``name (summary), ...``."""
        return ", ".join(f"{e.name} ({e.summary}{'; simulator only' if e.offline else ''})"
                         for e in self._entries.values() if offline or not e.offline)

    def parse(self, spec: object, *, offline: bool = False) -> tuple[str, dict[str, float]]:
        """``"name"`` or ``"name:key=value,..."`` -> (name, options); values are numbers.  An
        offline policy is refused unless ``offline``."""
        if not isinstance(spec, str) or not spec.strip():
            raise InvalidArgumentError(f"eviction policy must be a name, got {spec!r}")
        name, _, rest = spec.strip().partition(":")
        entry = self._entries.get(name)
        if entry is None:
            raise InvalidArgumentError(f"unknown eviction policy {name!r}; choose one of "
                                       f"{', '.join(self.names(offline=offline))}")
        if entry.offline and not offline:
            raise InvalidArgumentError(f"eviction policy {name!r} is simulator-only; the pool runs "
                                       f"one of {', '.join(self.names(offline=False))}")
        options: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, value = item.partition("=")
            try:
                if not eq:
                    raise ValueError
                options[key.strip()] = float(value)
            except ValueError:
                raise InvalidArgumentError(
                    f"eviction policy option {item!r} in {spec!r} is not key=number") from None
        return name, options

    def make(self, spec: object, blocks: Sequence[KVCacheBlock], *,
             offline: bool = False) -> EvictionPolicy:
        """Build the policy ``spec`` names (see :meth:`parse`) over ``blocks``, all free, in
        their initial reuse order.  ``spec`` may also be a :data:`PolicyFactory`.

        An option the policy's class does not take is a usage error
        (:class:`InvalidArgumentError` naming it and the options there are); any error the
        class raises itself (a bad option value, or a bug in it) is passed on unchanged."""
        if callable(spec):
            policy = spec(blocks)
            if not isinstance(policy, EvictionPolicy) or len(policy) != len(blocks):
                raise InvalidArgumentError(
                    f"eviction policy factory {spec!r} must return an EvictionPolicy holding the "
                    f"{len(blocks)} blocks it was given, got {policy!r}")
            return policy
        name, options = self.parse(spec, offline=offline)
        cls = self._entries[name].cls
        if options:
            _check_options(name, cls, blocks, options)
        return cls(blocks, **options)  # type: ignore[call-arg]  # subclasses take options

    def check(self, spec: object, *, offline: bool = False) -> None:
        """Raise :class:`InvalidArgumentError` unless :meth:`make` would build ``spec`` (a
        factory is taken as it is): the policy is built over one fresh block, so that its class
        checks the option values too (a policy checks its options in ``__init__`` and can be
        built over any number of blocks)."""
        if not callable(spec):
            self.make(spec, (KVCacheBlock(1),), offline=offline)


def _check_options(name: str, cls: type[EvictionPolicy], blocks: Sequence[KVCacheBlock],
                   options: dict[str, float]) -> None:
    """Raise :class:`InvalidArgumentError` if ``cls(blocks, **options)`` would not bind: an
    option its ``__init__`` does not take.  (Catching the ``TypeError`` of the call instead
    would also catch one raised inside ``__init__``, a bug of the policy's, and misreport it as
    a usage error.)"""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read: the call reports a bad option
        return
    try:
        signature.bind(blocks, **options)
    except TypeError:
        params = list(signature.parameters.values())[1:]  # after the blocks
        taken = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                      inspect.Parameter.KEYWORD_ONLY)]
        unknown = [k for k in options if k not in taken]
        raise InvalidArgumentError(
            f"eviction policy {name!r} takes no option {', '.join(unknown) or 'of these'} "
            f"(its options: {', '.join(taken) or 'none'})") from None


_BUILTIN: tuple[tuple[str, type[EvictionPolicy], str, bool], ...] = (
    # name, class, summary, offline (simulator only)
    ("lru", FreeBlockQueue, "vLLM's free queue, least recently freed first", False),
    ("slru", SLRUPolicy, "segmented LRU: reused prefixes protected, with a ghost table", False),
    ("s3fifo", S3FIFOPolicy, "S3-FIFO: small and main FIFOs, with a ghost table", False),
    ("arc", ARCPolicy, "Adaptive Replacement Cache", False),
    ("learned", LearnedPolicy,
     "categories of blocks ranked by the reuse probability learned in this run", False),
    ("fifo", FIFOPolicy, "first cached, first evicted", True),
    ("lfu", LFUPolicy, "fewest releases first, then least recent", True),
    (OFFLINE_BOUND, BeladyPolicy, "offline bound: needed furthest in the future", True),
    (REUSE_ORACLE, ReuseOraclePolicy,
     "offline: LRU, blocks never needed again first (a perfect reuse predictor)", True),
)

REGISTRY = PolicyRegistry()
"""The registry every entry point reads."""
for _name, _cls, _summary, _offline in _BUILTIN:
    REGISTRY.register(_name, _cls, offline=_offline, summary=_summary)


def register_policy(name: str, cls: type[EvictionPolicy], *, offline: bool = False,
                    summary: str | None = None) -> None:
    """Register a policy of your own in :data:`REGISTRY` (see the module docstring)."""
    REGISTRY.register(name, cls, offline=offline, summary=summary)


def unregister_policy(name: str) -> None:
    REGISTRY.unregister(name)


def parse_policy(spec: object, *, offline: bool = False) -> tuple[str, dict[str, float]]:
    return REGISTRY.parse(spec, offline=offline)


def make_policy(spec: object, blocks: Sequence[KVCacheBlock], *,
                offline: bool = False) -> EvictionPolicy:
    return REGISTRY.make(spec, blocks, offline=offline)
