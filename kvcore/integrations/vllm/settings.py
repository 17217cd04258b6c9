"""kvcore's settings inside vLLM: the ``"kvcore"`` entry of vLLM's ``additional_config``.

::

    LLM(..., additional_config={"kvcore": {"eviction_policy": "recommended"}})
    vllm serve MODEL --additional-config '{"kvcore": {"eviction_policy": "slru", "queue_hints": 64}}'

Keys (all optional):

``eviction_policy``
    ``"lru"`` (vLLM's order, the default), ``"slru"``, ``"s3fifo"``, ``"arc"`` with options
    (``"slru:protected_share=0.7"``), or ``"recommended"`` (:data:`kvcore.eviction.RECOMMENDED`,
    which also sets ``queue_hints`` unless it is given).
``queue_hints``
    Declare the first this many waiting requests to the pool every step, so free blocks caching
    their prefixes are evicted last (``KVCacheManager.declare_upcoming``); ``0`` = off.
``verify_hits``
    Confirm every prefix hit against the request's own tokens (no wrong-KV hit even under a hash
    collision); cached blocks then keep their token ids.
``schedule_policy``
    Admission order of vLLM's waiting queue (:mod:`kvcore.integrations.vllm.queue`):
    ``"fcfs"`` (vLLM's, the default: vLLM's own queue is kept), ``"lpm"`` (longest cached prefix
    first), ``"dfs-weight"`` (grouped by shared prefix) or ``"recommended"`` (``lpm``).  Not with
    vLLM's ``--scheduling-policy priority`` (refused at start).
``max_waiting_steps``
    Starvation guard of the non-FCFS orders: a request that has waited more than this many
    scheduler steps goes ahead of every fresh request that has not (default
    :data:`MAX_WAITING_STEPS`, >= 1).
``lpm_lookups_per_step``
    ``lpm``: at most this many prefix lookups per step refresh the hit estimates (default 32).
``check_invariants_every``
    Check every pool and manager invariant at the start of every N-th scheduler step (``0`` =
    never); a broken one raises :class:`~kvcore.errors.InvariantError` naming the rule.
``allow_unreleased_vllm``
    Run on a pre-release or development build of a supported vLLM (``0.33.1rc1``,
    ``0.34.0.dev5+g0123abc``), with a warning naming it (default ``false``: such a build is
    refused at engine start; :mod:`~kvcore.integrations.vllm.version`).  A build of a version
    kvcore does not list must also pass the contract probe.

This module does not import vLLM: it is what the vLLM integration and its tests share with
kvcore's own command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvcore.errors import InvalidArgumentError
from kvcore.eviction import RECOMMENDED, RECOMMENDED_NAME, parse_policy
from kvcore.scheduler.admission import resolve as resolve_schedule_policy

MAX_WAITING_STEPS = 1024
"""The default starvation bound inside vLLM, four times kvcore's own scheduler's: vLLM's waiting
queue holds every arrived request (kvcore's replay hands its scheduler a window of them), so a
request's steps count from its arrival, and on the shipped Mooncake trace at 1,024 blocks of 512
the bound of 256 put most requests past it, turning ``lpm`` back into FCFS (12.6% against 23.8%
with 1,024; BENCHMARKS.md 2026-11-27)."""

CONFIG_KEY = "kvcore"
"""The key of kvcore's settings in vLLM's ``additional_config``."""


def _count(name: str, value: object, least: int = 0) -> int:
    if type(value) is not int or value < least:
        raise InvalidArgumentError(f"additional_config['kvcore'][{name!r}] must be an int >= "
                                   f"{least}, got {value!r}")
    return value


def _flag(raw: Mapping[object, object], name: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"additional_config['kvcore'][{name!r}] must be a bool, "
                                   f"got {value!r}")
    return value


@dataclass(frozen=True)
class KvcoreSettings:
    """Validated settings (see the module docstring); build them with :func:`parse_settings`."""

    eviction_policy: str = "lru"
    queue_hints: int = 0
    verify_hits: bool = False
    check_invariants_every: int = 0
    schedule_policy: str = "fcfs"
    max_waiting_steps: int = MAX_WAITING_STEPS
    lpm_lookups_per_step: int = 32
    allow_unreleased_vllm: bool = False


_KEYS = tuple(f.name for f in fields(KvcoreSettings))


def parse_settings(raw: object) -> KvcoreSettings:
    """The settings in ``raw`` (the value of ``additional_config["kvcore"]``: a mapping, or
    ``None`` for all defaults).  Raises :class:`InvalidArgumentError` naming the key and value of
    anything wrong: an unknown key, a wrong type, an unknown eviction policy or option."""
    if raw is None:
        return KvcoreSettings()
    if not isinstance(raw, Mapping):
        raise InvalidArgumentError(f"additional_config['kvcore'] must be a mapping of settings, "
                                   f"got {raw!r}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise InvalidArgumentError(f"unknown additional_config['kvcore'] setting(s) "
                                   f"{', '.join(map(repr, unknown))}; known: {', '.join(_KEYS)}")
    policy = raw.get("eviction_policy", "lru")
    hints = raw.get("queue_hints")
    if policy == RECOMMENDED_NAME:
        policy = RECOMMENDED.policy
        if hints is None:
            hints = RECOMMENDED.queue_hints
    try:
        parse_policy(policy)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"additional_config['kvcore']['eviction_policy']: {exc} "
                                   f"(or {RECOMMENDED_NAME!r})") from None
    verify = _flag(raw, "verify_hits")
    unreleased = _flag(raw, "allow_unreleased_vllm")
    try:
        schedule = resolve_schedule_policy(raw.get("schedule_policy", "fcfs"))
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"additional_config['kvcore']['schedule_policy']: "
                                   f"{exc}") from None
    return KvcoreSettings(
        eviction_policy=str(policy).strip(),
        queue_hints=_count("queue_hints", 0 if hints is None else hints),
        verify_hits=verify,
        check_invariants_every=_count("check_invariants_every",
                                      raw.get("check_invariants_every", 0)),
        schedule_policy=schedule,
        max_waiting_steps=_count("max_waiting_steps",
                                 raw.get("max_waiting_steps", MAX_WAITING_STEPS), 1),
        lpm_lookups_per_step=_count("lpm_lookups_per_step", raw.get("lpm_lookups_per_step", 32),
                                    1),
        allow_unreleased_vllm=unreleased)


def settings_from_additional_config(additional_config: object) -> KvcoreSettings | None:
    """kvcore's settings from vLLM's ``additional_config``, or ``None`` when it has no
    ``"kvcore"`` entry (the opt-in of the ``vllm.general_plugins`` route)."""
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    return parse_settings(additional_config[CONFIG_KEY])
