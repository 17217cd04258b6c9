"""The kvcore backend's settings inside SGLang, read from the environment at start.

SGLang's server arguments have no free-form entry for a backend, so the settings are
environment variables of the server process (each one optional):

``KVCORE_SGLANG_EVICTION_POLICY``
    A kvcore pool policy (:mod:`kvcore.eviction`): ``lru``, ``slru``, ``s3fifo``, ``arc``,
    ``learned``, with options (``slru:protected_share=0.3``), or ``recommended``.  Unset: SGLang's
    ``--radix-eviction-policy`` is used when kvcore has a pool policy of that name (``lru``, the
    default, or ``slru``); SGLang's other names (``lfu``, ``priority``, ``tlru``, ...) are refused
    at start, naming this variable.
``KVCORE_SGLANG_QUEUE_HINTS``
    ``0`` only (the default).  Queue hints need the scheduler's waiting queue, which SGLang's
    radix-cache interface does not hand to the cache; any other value is refused at start.
    ``recommended`` therefore runs :data:`kvcore.eviction.RECOMMENDED`'s policy without its hints.
``KVCORE_SGLANG_VERIFY_HITS``
    ``1``/``true``: every page a lookup finds is confirmed against the looked-up tokens, its
    namespace and its parent page before it counts as a hit (no wrong-KV hit even under a hash
    collision); a page that fails ends the match there and is counted
    (``KVCoreRadixCache.num_rejected_hits``).  Default ``0``.
``KVCORE_SGLANG_CHECK_INVARIANTS_EVERY``
    Check the pool's invariants and the backend's accounting (SGLang's leak check among them)
    after every N-th cache operation (``0`` = never, the default); a broken rule raises
    :class:`~kvcore.errors.InvariantError` naming it.

A bad value raises :class:`~kvcore.errors.InvalidArgumentError` (or
:class:`~kvcore.errors.UnsupportedFeatureError`) with one line naming the variable and the value.
This module does not import SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvcore.errors import InvalidArgumentError, UnsupportedFeatureError
from kvcore.eviction import RECOMMENDED, RECOMMENDED_NAME, REGISTRY, make_policy

ENV_POLICY = "KVCORE_SGLANG_EVICTION_POLICY"
ENV_QUEUE_HINTS = "KVCORE_SGLANG_QUEUE_HINTS"
ENV_VERIFY_HITS = "KVCORE_SGLANG_VERIFY_HITS"
ENV_CHECK_EVERY = "KVCORE_SGLANG_CHECK_INVARIANTS_EVERY"
ENV_NAMES = (ENV_POLICY, ENV_QUEUE_HINTS, ENV_VERIFY_HITS, ENV_CHECK_EVERY)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class SGLangSettings:
    """The backend's validated settings (see the module docstring)."""

    eviction_policy: str = "lru"
    verify_hits: bool = False
    check_invariants_every: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, sglang_policy: str = "lru") -> SGLangSettings:
        """Settings from ``env`` (``os.environ``); ``sglang_policy`` is SGLang's
        ``--radix-eviction-policy``, used when the environment names no policy."""
        raw_policy = env.get(ENV_POLICY, "").strip()
        if raw_policy:
            policy = _pool_policy(raw_policy, ENV_POLICY)
        else:
            name = (sglang_policy or "lru").strip().lower()
            if name not in REGISTRY.names(offline=False):
                raise UnsupportedFeatureError(
                    f"--radix-eviction-policy {name!r} has no kvcore pool policy of that name "
                    f"(kvcore's: {', '.join(REGISTRY.names(offline=False))}, "
                    f"{RECOMMENDED_NAME}); set {ENV_POLICY} to one of them")
            policy = name
        hints = env.get(ENV_QUEUE_HINTS, "0").strip() or "0"
        if hints != "0":
            raise UnsupportedFeatureError(
                f"{ENV_QUEUE_HINTS}={hints!r}: queue hints need SGLang's waiting queue, which its "
                f"radix-cache interface does not pass to the cache; only 0 is supported")
        return cls(eviction_policy=policy,
                   verify_hits=_flag(env.get(ENV_VERIFY_HITS, "0"), ENV_VERIFY_HITS),
                   check_invariants_every=_count(env.get(ENV_CHECK_EVERY, "0"), ENV_CHECK_EVERY))


def _pool_policy(spec: str, what: str) -> str:
    """``spec`` if it names a policy the pool runs, with options it takes (checked by building
    it over no blocks); ``recommended`` resolved."""
    if spec == RECOMMENDED_NAME:
        return RECOMMENDED.policy
    name = spec.partition(":")[0]
    if name in REGISTRY.names() and name not in REGISTRY.names(offline=False):
        raise InvalidArgumentError(
            f"{what}={spec!r}: {name!r} runs in kvcore's simulator only; the pool runs "
            f"{', '.join(REGISTRY.names(offline=False))} or {RECOMMENDED_NAME}")
    try:
        make_policy(spec, [])
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{what}={spec!r}: {exc}") from None
    return spec


def _flag(raw: str, what: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidArgumentError(f"{what}={raw!r}: expected 1/true or 0/false")


def _count(raw: str, what: str) -> int:
    value = raw.strip() or "0"
    if not value.isdigit():
        raise InvalidArgumentError(f"{what}={raw!r}: expected an integer >= 0")
    return int(value)
