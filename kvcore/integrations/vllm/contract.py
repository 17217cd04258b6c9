"""The contract probe: what kvcore's adapter relies on in vLLM, recorded per supported version,
and its comparison with an installed vLLM kvcore does not list.

vLLM's scheduler and connectors call kvcore's adapter and views as they would call vLLM's own
``KVCacheManager``, its coordinator, single-type managers, block pool, free queue and blocks.
What the adapter was checked against is recorded here as data (:data:`CONTRACTS`, captured from
vLLM 0.32.0 and 0.33.0 by :func:`capture`; ``scripts/vllm_contract.py`` prints it again):

* the parameters (names, kinds, in order) of the calls the scheduler makes with vLLM's
  arguments: ``KVCacheManager.__init__``, ``allocate_slots``, ``get_computed_blocks`` (and its
  connector variant), the coordinator's ``get_num_blocks_to_allocate`` and the hybrid
  coordinator's lookups;
* the public names each of those classes defines (a name vLLM gained is one its callers may
  now use, and kvcore does not answer);
* the names kvcore's views and adapter answer for vLLM's (``Contract.view_names``): each must still
  be defined by vLLM's class (as a class attribute, or set by one of its methods), or vLLM's
  callers now read something else (kvcore's side of the contract, written by hand from
  :mod:`~kvcore.integrations.vllm.views` and the adapter; a test keeps it in step with them);
* the fields of the KV events kvcore publishes (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``).

:func:`differences` compares a recorded contract with a :class:`VllmSurface` (the classes of an
installed vLLM; tests hand it fakes) and describes every mismatch in words
(``"KVCacheManager.__init__ gained parameter 'foo' (keyword)"``).  :func:`probe_installed` is
the probe :func:`kvcore.integrations.vllm.version.installed` runs for an unlisted version.

This module imports vLLM only in :func:`load_surface`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import FunctionType
from typing import Any

Params = tuple[tuple[str, str], ...]
"""A call's parameters after ``self``: (name, kind) in order, kind as ``inspect`` names it
(``POSITIONAL_OR_KEYWORD``, ``KEYWORD_ONLY``, ...)."""

CLASSES: tuple[str, ...] = ("KVCacheManager", "KVCacheCoordinator", "HybridKVCacheCoordinator",
                            "SingleTypeKVCacheManager", "BlockPool", "FreeKVCacheBlockQueue",
                            "KVCacheBlock")
"""The vLLM classes the contract covers, by the names a :class:`VllmSurface` keys them by."""

EVENTS: tuple[str, ...] = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
"""The KV-event classes the contract covers."""

CALLS: tuple[str, ...] = (
    "KVCacheManager.__init__", "KVCacheManager.allocate_slots",
    "KVCacheManager.get_computed_blocks", "KVCacheManager.get_computed_blocks_for_connector",
    "KVCacheCoordinator.get_num_blocks_to_allocate",
    "HybridKVCacheCoordinator.find_longest_cache_hit",
    "HybridKVCacheCoordinator.find_longest_cache_hit_per_group")
"""The calls whose parameters the contract records (``Class.method``)."""


@dataclass(frozen=True)
class Contract:
    """What the adapter relies on in one vLLM version (see the module docstring)."""

    calls: Mapping[str, Params]
    names: Mapping[str, frozenset[str]]
    events: Mapping[str, tuple[str, ...]]
    view_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The names kvcore's adapter and views answer for each class (kvcore's side: not read
    from vLLM, see the module docstring)."""


@dataclass(frozen=True)
class VllmSurface:
    """The classes of a vLLM installation the contract is read from: :data:`CLASSES` and
    :data:`EVENTS` by name (a missing one is a difference)."""

    classes: Mapping[str, type]
    events: Mapping[str, type]


def load_surface() -> VllmSurface:
    """The installed vLLM's surface (imports vLLM)."""
    from vllm.distributed import kv_events
    from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_manager, kv_cache_utils
    from vllm.v1.core import single_type_kv_cache_manager as single_type

    classes: dict[str, type] = {}
    for module in (kv_cache_manager, kv_cache_coordinator, single_type, block_pool,
                   kv_cache_utils):
        for name in CLASSES:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and name not in classes and cls.__module__ == module.__name__:
                classes[name] = cls
    events = {name: cls for name in EVENTS
              if isinstance(cls := getattr(kv_events, name, None), type)}
    return VllmSurface(classes, events)


def _params(function: Any) -> Params:
    params = list(inspect.signature(function).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return tuple((p.name, p.kind.name) for p in params)


def _event_fields(cls: type) -> tuple[str, ...]:
    struct = getattr(cls, "__struct_fields__", None)  # msgspec's Struct (vLLM's events)
    if isinstance(struct, tuple):
        return tuple(str(f) for f in struct)
    if is_dataclass(cls):
        return tuple(f.name for f in fields(cls))
    return tuple(n for n in getattr(cls, "__annotations__", {}) if not n.startswith("_"))


def capture(surface: VllmSurface) -> Contract:
    """The contract ``surface`` offers (what :data:`CONTRACTS` records for a supported vLLM).
    Raises ``KeyError`` naming a class the surface lacks."""
    calls = {}
    for call in CALLS:
        cls, method = call.split(".")
        calls[call] = _params(getattr(surface.classes[cls], method))
    names = {cls: frozenset(n for n in dir(surface.classes[cls]) if not n.startswith("_"))
             for cls in CLASSES}
    events = {name: _event_fields(surface.events[name]) for name in EVENTS}
    return Contract(calls, names, events)


def defines(cls: type, name: str) -> bool:
    """Whether vLLM's class ``cls`` has ``name``: as a class attribute, or as an attribute one
    of its methods (``__init__`` included) sets or reads on its objects."""
    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        if klass is object:
            continue
        for member in vars(klass).values():
            function = member.fget if isinstance(member, property) else member
            function = getattr(function, "__func__", function)
            if isinstance(function, FunctionType) and name in function.__code__.co_names:
                return True
    return False


def _kind(kind: str) -> str:
    return {"POSITIONAL_ONLY": "positional-only", "POSITIONAL_OR_KEYWORD": "positional or keyword",
            "VAR_POSITIONAL": "*args", "KEYWORD_ONLY": "keyword-only",
            "VAR_KEYWORD": "**kwargs"}.get(kind, kind)


def _call_differences(call: str, expected: Params, actual: Params) -> list[str]:
    out = []
    want, have = dict(expected), dict(actual)
    for name, kind in actual:
        if name not in want:
            out.append(f"{call} gained parameter {name!r} ({_kind(kind)})")
    for name, kind in expected:
        if name not in have:
            out.append(f"{call} lost parameter {name!r}")
        elif have[name] != kind:
            out.append(f"{call} parameter {name!r} is now {_kind(have[name])} (was "
                       f"{_kind(kind)})")
    if not out and [n for n, _ in expected] != [n for n, _ in actual]:
        out.append(f"{call} reordered its parameters: ({', '.join(n for n, _ in actual)}), "
                   f"was ({', '.join(n for n, _ in expected)})")
    return out


def _set_differences(what: str, expected: Iterable[str], actual: Iterable[str],
                     gained: str, lost: str) -> list[str]:
    want, have = set(expected), set(actual)
    return ([f"{what} {gained} {n!r}" for n in sorted(have - want)]
            + [f"{what} {lost} {n!r}" for n in sorted(want - have)])


def differences(expected: Contract, surface: VllmSurface) -> list[str]:
    """Every way ``surface`` differs from ``expected`` (a name kvcore answers that vLLM's class
    no longer defines included), in words; empty when it matches."""
    out: list[str] = []
    missing = [c for c in CLASSES if c not in surface.classes]
    out += [f"vLLM has no class {c} (kvcore's adapter stands in for it)" for c in missing]
    out += [f"vLLM has no KV event {e} (kvcore publishes it)" for e in EVENTS
            if e not in surface.events]
    for call in CALLS:
        cls, method = call.split(".")
        if cls in missing:
            continue
        function = getattr(surface.classes[cls], method, None)
        if function is None:
            out.append(f"{call} no longer exists")
            continue
        out += _call_differences(call, expected.calls[call], _params(function))
    for cls in CLASSES:
        if cls in missing:
            continue
        have = (n for n in dir(surface.classes[cls]) if not n.startswith("_"))
        out += _set_differences(cls, expected.names[cls], have, "gained", "lost")
    for cls, names in expected.view_names.items():
        if cls in missing:
            continue
        out += [f"{cls} no longer defines {n!r}, which kvcore answers for it"
                for n in names if not defines(surface.classes[cls], n)]
    for event in EVENTS:
        if event in surface.events:
            out += _set_differences(f"KV event {event}", expected.events[event],
                                    _event_fields(surface.events[event]), "gained field",
                                    "lost field")
    return out


def probe_installed(supported: tuple[int, int]) -> list[str]:
    """The differences between the installed vLLM and the contract of the supported version
    ``supported`` (the probe :func:`kvcore.integrations.vllm.version.installed` runs)."""
    return differences(CONTRACTS[supported], load_surface())


def _params_of(*names: str) -> Params:
    return tuple((n, "POSITIONAL_OR_KEYWORD") for n in names)


# Captured from vLLM 0.32.0 with scripts/vllm_contract.py; 0.33.0's differences follow.
_CALLS_032: dict[str, Params] = {
    'KVCacheManager.__init__': _params_of(
        'kv_cache_config', 'max_model_len', 'scheduler_block_size', 'hash_block_size',
        'max_in_flight_tokens', 'enable_caching', 'use_eagle', 'num_prefill_lookahead',
        'log_stats', 'enable_kv_cache_events', 'dcp_world_size', 'pcp_world_size',
        'metrics_collector', 'watermark', 'enable_mamba_shared_prefix_checkpoint'),
    'KVCacheManager.allocate_slots': _params_of(
        'request', 'num_new_tokens', 'num_new_computed_tokens', 'new_computed_blocks',
        'num_lookahead_tokens', 'num_external_computed_tokens', 'delay_cache_blocks',
        'num_encoder_tokens', 'full_sequence_must_fit', 'reserved_blocks', 'has_scheduled_reqs',
        'skip_zeroing_group_ids'),
    'KVCacheManager.get_computed_blocks': _params_of(
        'request'),
    'KVCacheManager.get_computed_blocks_for_connector': _params_of(
        'request'),
    'KVCacheCoordinator.get_num_blocks_to_allocate': _params_of(
        'request_id', 'num_tokens', 'new_computed_blocks', 'num_encoder_tokens',
        'total_computed_tokens', 'num_local_computed_tokens', 'num_tokens_main_model',
        'apply_admission_cap', 'prefill_end'),
    'HybridKVCacheCoordinator.find_longest_cache_hit': _params_of(
        'block_hashes', 'max_cache_hit_length'),
    'HybridKVCacheCoordinator.find_longest_cache_hit_per_group': _params_of(
        'block_hashes', 'max_cache_hit_length'),
}
_NAMES: dict[str, frozenset[str]] = {  # the same in 0.32.0 and 0.33.0
    'KVCacheManager': frozenset((
        'allocate_slots', 'cache_blocks', 'create_kv_cache_blocks', 'estimate_cached_tokens',
        'evict_blocks', 'finalize_partial_tail_offloads', 'free', 'get_block_ids',
        'get_block_ids_for_computed_tokens', 'get_blocks', 'get_computed_blocks',
        'get_computed_blocks_for_connector', 'get_num_common_prefix_blocks',
        'make_prefix_cache_stats', 'new_step_starts', 'pop_blocks_for_free',
        'prefix_cache_lookup_enabled', 'record_blocks_for_zeroing', 'record_prefix_cache_stats',
        'remove_skipped_blocks', 'reset_prefix_cache', 'take_boundary_state_offloads',
        'take_events', 'take_kv_cache_block_copies', 'take_new_block_ids',
        'truncate_computed_blocks', 'usage')),
    'KVCacheCoordinator': frozenset((
        'allocate_new_blocks', 'allocate_new_computed_blocks', 'cache_blocks',
        'emit_cached_block_events', 'enable_partial_hash_hits', 'find_longest_cache_hit', 'free',
        'get_blocks', 'get_num_blocks_to_allocate', 'get_num_cacheable_tokens', 'new_step_starts',
        'pop_blocks_for_free', 'remove_skipped_blocks', 'reset_prefix_cache')),
    'HybridKVCacheCoordinator': frozenset((
        'allocate_new_blocks', 'allocate_new_computed_blocks', 'cache_blocks',
        'emit_cached_block_events', 'enable_partial_hash_hits', 'find_longest_cache_hit',
        'find_longest_cache_hit_per_group', 'free', 'get_blocks', 'get_num_blocks_to_allocate',
        'get_num_cacheable_tokens', 'new_step_starts', 'pop_blocks_for_free',
        'remove_skipped_blocks', 'reset_prefix_cache', 'verify_and_split_kv_cache_groups')),
    'SingleTypeKVCacheManager': frozenset((
        'add_local_computed_blocks', 'allocate_external_computed_blocks', 'allocate_new_blocks',
        'cache_blocks', 'finalize_partial_tail_offload', 'find_longest_cache_hit', 'free',
        'get_num_blocks_to_allocate', 'get_num_skipped_tokens', 'has_positionally_stable_blocks',
        'new_step_starts', 'pop_blocks_for_free', 'reachable_block_mask', 'records_new_block_ids',
        'remove_skipped_blocks', 'retains_longer_hit', 'supports_fine_grained_hash_lookup',
        'take_new_block_ids', 'take_pending_boundary_state_offloads', 'take_pending_cow_copies')),
    'BlockPool': frozenset((
        'cache_full_blocks', 'cache_partial_block', 'emit_cached_block_events', 'evict_blocks',
        'free_blocks', 'get_cached_block', 'get_new_blocks', 'get_num_free_blocks', 'get_usage',
        'is_block_writable', 'move_block_hashes', 'reset_prefix_cache', 'take_events', 'touch',
        'unpin_blocks')),
    'FreeKVCacheBlockQueue': frozenset((
        'append', 'append_n', 'get_all_free_blocks', 'iter_blocks_after', 'popleft', 'popleft_n',
        'prepend_n', 'remove')),
    'KVCacheBlock': frozenset((
        'block_hash', 'block_hash_num_tokens', 'block_id', 'is_null', 'next_free_block', 'pool',
        'prev_free_block', 'ref_cnt', 'reset_hash', 'set_block_hash')),
}
_EVENTS_032: dict[str, tuple[str, ...]] = {
    'BlockStored': (
        'block_hashes', 'parent_block_hash', 'token_ids', 'block_size', 'lora_id', 'medium',
        'lora_name', 'extra_keys', 'group_idx', 'kv_cache_spec_kind',
        'kv_cache_spec_sliding_window', 'locality', 'ownership', 'session_id'),
    'BlockRemoved': (
        'block_hashes', 'medium', 'group_idx', 'locality', 'ownership'),
    'AllBlocksCleared': (),
}
_CALLS_033: dict[str, Params] = {**_CALLS_032, **{
    'KVCacheManager.__init__': _params_of(
        'kv_cache_config', 'max_model_len', 'scheduler_block_size', 'hash_block_size',
        'max_in_flight_tokens', 'enable_caching', 'use_eagle', 'num_hash_lookahead_tokens',
        'num_prefill_lookahead', 'log_stats', 'enable_kv_cache_events', 'dcp_world_size',
        'pcp_world_size', 'metrics_collector', 'watermark', 'enable_mamba_shared_prefix_checkpoint'),
    'KVCacheManager.get_computed_blocks': _params_of(
        'request', 'max_cache_hit_length'),
    'KVCacheManager.get_computed_blocks_for_connector': _params_of(
        'request', 'max_cache_hit_length'),
}}
_EVENTS_033: dict[str, tuple[str, ...]] = {
    **_EVENTS_032, "BlockStored": (*_EVENTS_032["BlockStored"], "lookahead_token_ids")}

# The names kvcore answers for vLLM's (the adapter's attributes and the views' names, from
# manager.py and views.py); tests/integrations/vllm/test_contract.py checks each view answers
# its list and nothing else a vLLM class has.
_VIEW_NAMES_032: dict[str, tuple[str, ...]] = {
    "KVCacheManager": (
        "block_pool", "coordinator", "empty_kv_cache_blocks", "enable_caching",
        "enable_kv_cache_events", "kv_cache_config", "log_stats",
        "mamba_shared_prefix_checkpoint", "max_model_len", "metrics_collector",
        "num_kv_cache_groups", "prefix_cache_stats", "retained_hit_group_ids", "use_eagle",
        "watermark_blocks"),
    "KVCacheCoordinator": (
        "block_pool", "eagle_group_ids", "enable_partial_hash_hits",
        "get_num_blocks_to_allocate", "kv_cache_config", "num_reprefillable_tokens",
        "single_type_managers"),
    "HybridKVCacheCoordinator": (
        "find_longest_cache_hit", "find_longest_cache_hit_per_group",
        "full_attention_group_id"),
    "SingleTypeKVCacheManager": (
        "_null_block", "_pending_cow_copies", "block_pool", "block_size", "enable_caching", "kv_cache_group_id",
        "kv_cache_spec", "num_cached_block", "records_new_block_ids", "req_to_blocks",
        "retains_longer_hit", "use_eagle"),
    "BlockPool": (
        "blocks", "cached_block_hash_to_block", "cached_block_hashes_by_block", "enable_caching",
        "evict_blocks", "free_block_queue", "free_blocks", "get_cached_block", "get_new_blocks",
        "get_num_free_blocks", "get_usage", "hash_block_size", "null_block", "num_gpu_blocks",
        "touch"),
    "FreeKVCacheBlockQueue": ("get_all_free_blocks", "iter_blocks_after", "num_free_blocks"),
    "KVCacheBlock": (
        "_block_hash", "block_hash", "block_hash_num_tokens", "block_id", "is_null", "ref_cnt"),
}
_VIEW_NAMES_033: dict[str, tuple[str, ...]] = {
    **_VIEW_NAMES_032,
    "KVCacheCoordinator": (*_VIEW_NAMES_032["KVCacheCoordinator"], "drop_eagle_group_ids"),
    "BlockPool": (*_VIEW_NAMES_032["BlockPool"], "num_hash_lookahead_tokens"),
}

CONTRACTS: Mapping[tuple[int, int], Contract] = {
    (0, 32): Contract(_CALLS_032, _NAMES, _EVENTS_032, _VIEW_NAMES_032),
    (0, 33): Contract(_CALLS_033, _NAMES, _EVENTS_033, _VIEW_NAMES_033),
}
"""The contract of each supported vLLM version (see the module docstring)."""
