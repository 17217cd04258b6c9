"""The offloading manager: which KV blocks a host-memory tier holds, in vLLM's shape.

It runs on the scheduler side and tracks host *slots* only (the bytes live with the worker, see
``runner.offload``).  The calls are vLLM's ``OffloadingManager`` primitives:

* ``lookup(keys)``: how many leading keys are stored and ready to load;
* ``prepare_load(keys)`` → the slots to read; they are pinned (never evicted) until
  ``complete_load(keys)``;
* ``touch(keys)``: record an access (for the eviction policy), e.g. for blocks the device cache
  served;
* ``prepare_store(keys)`` → which keys to write, into which slots, and which keys were evicted
  to make room; ``complete_store(keys, success)`` makes them loadable (or gives the slots back).

Keys are ``(group id, block hash)``: one KV-cache group's block.  The free side is one of
kvcore's eviction policies (``lru``, ``arc``, ... over the slots, as in the device pool), so
the tier evicts exactly as the device pool would.  An admission filter stores a key only once it
was offered ``admit_after`` times (1 = always): blocks seen once never displace reused ones.
Events: ``BlockStored`` / ``BlockRemoved`` with ``medium="CPU"``, so a routing index weighs host
copies as such.  A store whose caller names each key's request and block (``prepare_store``'s
``sources``) is announced self-describing, as the device's: one ``BlockStored`` per block with its
parent hash, tokens, LoRA and the group's spec (vLLM 0.32's self-describing offload events);
without sources, a placeholder (hashes only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from kvcore.errors import BlockStateError, InvalidArgumentError, InvariantError
from kvcore.events import MEDIUM_CPU, EventRecorder, KVCacheEvent
from kvcore.eviction import make_policy
from kvcore.types import BlockHash, KVCacheBlock, KVRequest

OffloadKey: TypeAlias = tuple[int, BlockHash]
"""``(group id, block hash)``."""

StoreSource: TypeAlias = tuple[KVRequest, int]
"""Where a stored key's KV comes from: the request and the block's index in it."""


@dataclass(frozen=True)
class HostLoadStoreSpec:
    """Where a load reads or a store writes: one host slot per key, in order."""

    slots: tuple[int, ...]
    medium: str = MEDIUM_CPU


@dataclass(frozen=True)
class PrepareStoreOutput:
    """``keys_to_store`` go to ``store_spec.slots`` (aligned); ``keys_evicted`` left the tier
    to make room."""

    keys_to_store: list[OffloadKey]
    store_spec: HostLoadStoreSpec
    keys_evicted: list[OffloadKey]


class OffloadingManager:
    """The interface (vLLM's ``OffloadingManager``); see the module docstring."""

    def lookup(self, keys: Sequence[OffloadKey]) -> int | None:
        """Leading keys stored and ready (``None``: ask again later)."""
        raise NotImplementedError

    def prepare_load(self, keys: Sequence[OffloadKey]) -> HostLoadStoreSpec:
        raise NotImplementedError

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        raise NotImplementedError

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        raise NotImplementedError

    def prepare_store(self, keys: Sequence[OffloadKey],
                      sources: Mapping[OffloadKey, StoreSource] | None = None
                      ) -> PrepareStoreOutput | None:
        raise NotImplementedError

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        raise NotImplementedError

    def take_events(self) -> list[KVCacheEvent]:
        return []


class HostOffloadingManager(OffloadingManager):
    """A host tier of ``num_blocks`` slots of ``block_size`` tokens.

    Args:
        eviction_policy: a :mod:`kvcore.eviction` policy name (``"lru"``, ``"arc"``, ...).
        admit_after: store a key only on its ``admit_after``-th offer (>= 1).
        enable_events: record ``medium="CPU"`` events for ``take_events``.
        events: the recorder they go to (default: one stamping no spec; the connector passes
            one stamped with its groups' specs).
    """

    def __init__(self, num_blocks: int, block_size: int, *, eviction_policy: str = "lru",
                 admit_after: int = 1, enable_events: bool = True,
                 events: EventRecorder | None = None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("admit_after", admit_after)):
            if type(value) is not int or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.admit_after = admit_after
        self.events: EventRecorder | None = (
            (events if events is not None else EventRecorder(medium=MEDIUM_CPU))
            if enable_events else None)
        self.slots = [KVCacheBlock(i) for i in range(num_blocks)]
        self.policy = make_policy(eviction_policy, self.slots)
        self.policy_name = eviction_policy
        self._ready: dict[OffloadKey, KVCacheBlock] = {}
        self._writing: dict[OffloadKey, KVCacheBlock] = {}
        # Offers of keys not admitted yet, in two generations (bounded memory, no scan).
        self._offers: dict[OffloadKey, int] = {}
        self._offers_old: dict[OffloadKey, int] = {}
        self._sources: dict[OffloadKey, StoreSource] = {}  # keys being written: their origin
        self.num_stored = 0
        self.num_loaded = 0
        self.num_evicted = 0
        self.num_rejected_stores = 0  # keys not stored: no slot could be freed

    # -- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Keys stored and ready."""
        return len(self._ready)

    def __contains__(self, key: object) -> bool:
        return key in self._ready

    @property
    def usage(self) -> float:
        return 1.0 - len(self.policy) / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        ready = self._ready
        n = 0
        for key in keys:
            if key not in ready:
                break
            n += 1
        return n

    # -- loads ----------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[OffloadKey]) -> HostLoadStoreSpec:
        """Pin the slots of ``keys`` (all must be ready) and return them, in order."""
        blocks = self._ready_blocks(keys, "load")
        self.policy.on_touch(blocks)  # ref_cnt += 1; a free slot leaves the policy (pinned)
        self.num_loaded += len(blocks)
        return HostLoadStoreSpec(tuple(b.block_id for b in blocks))

    def complete_load(self, keys: Iterable[OffloadKey]) -> None:
        """Unpin the slots ``prepare_load`` pinned (once per key and load)."""
        keys = list(keys)
        blocks = self._ready_blocks(keys, "complete_load")
        bad = [k for k, b in zip(keys, blocks) if b.ref_cnt <= 0]
        if bad:
            raise BlockStateError(f"complete_load of keys that are not being loaded: {bad[:3]}")
        freed = []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                freed.append(b)
        if freed:
            self.policy.on_free((), freed)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Record an access to the ready keys among ``keys`` (others are ignored)."""
        ready = self._ready
        unique = {b.block_id: b for k in keys if (b := ready.get(k)) is not None}
        blocks = list(unique.values())
        free = [b for b in blocks if b.ref_cnt == 0]
        pinned = [b for b in blocks if b.ref_cnt > 0]
        if free:
            self.policy.on_touch(free)
            for b in free:
                b.ref_cnt = 0
            self.policy.on_free((), free)
        if pinned:
            self.policy.on_hit(pinned)

    # -- stores ---------------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[OffloadKey],
                      sources: Mapping[OffloadKey, StoreSource] | None = None
                      ) -> PrepareStoreOutput | None:
        """Slots for the keys not stored yet that pass the admission filter, as many leading
        ones as free or evictable slots allow; ``None`` if none is to be stored.  ``sources``
        (optional) names each key's request and block, for self-describing events."""
        todo: list[OffloadKey] = []
        seen: set[OffloadKey] = set()
        for key in keys:
            if key in self._ready or key in self._writing or key in seen:
                continue
            seen.add(key)
            if self.admit_after > 1 and not self._admit(key):
                continue
            todo.append(key)
        room = len(self.policy)
        if len(todo) > room:
            self.num_rejected_stores += len(todo) - room
            todo = todo[:room]
        if not todo:
            return None
        victims = self.policy.pick_victims(len(todo), 1)
        evicted = []
        for block in victims:
            if block.block_hash is not None:
                evicted.append(self._evict(block))
        for key, block in zip(todo, victims):
            self._writing[key] = block
            if sources is not None and self.events is not None and key in sources:
                self._sources[key] = sources[key]
        return PrepareStoreOutput(todo, HostLoadStoreSpec(tuple(b.block_id for b in victims)),
                                  evicted)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """The copies of ``keys`` (from ``prepare_store``) finished: make them loadable, or on
        failure give their slots back."""
        keys = list(keys)
        missing = [k for k in keys if k not in self._writing]
        if missing:
            raise BlockStateError(f"complete_store of keys not being stored: {missing[:3]}")
        blocks = [self._writing.pop(k) for k in keys]
        origins = [self._sources.pop(k, None) for k in keys] if self._sources else []
        for block in blocks:
            block.ref_cnt = 0
        if not success:
            self.policy.on_free(blocks, ())
            return
        for (g, h), block in zip(keys, blocks):
            block.block_hash = h
            block.group_id = g
            self._ready[(g, h)] = block
        self.policy.on_free((), blocks)
        self.num_stored += len(blocks)
        if self.events is not None:
            self._announce(keys, origins)

    def _announce(self, keys: Sequence[OffloadKey], origins: Sequence[StoreSource | None]) -> None:
        """``BlockStored`` for stored ``keys``: one self-describing event per key whose origin is
        known, one placeholder per group for the others."""
        events = self.events
        assert events is not None
        bs = self.block_size
        unknown: dict[int, list[BlockHash]] = {}
        for i, (g, h) in enumerate(keys):
            origin = origins[i] if origins else None
            if origin is None:
                unknown.setdefault(g, []).append(h)
            else:
                request, index = origin
                events.stored(request, request.block_hashes, index, 1, bs, g, (0,))
        for g, hashes in unknown.items():
            events.stored_keys(hashes, bs, g)

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take() if self.events is not None else []

    # -- helpers --------------------------------------------------------------------------------
    def _ready_blocks(self, keys: Sequence[OffloadKey], op: str) -> list[KVCacheBlock]:
        ready = self._ready
        missing = [k for k in keys if k not in ready]
        if missing:
            raise BlockStateError(f"{op} of keys the host tier does not hold: {missing[:3]}")
        return [ready[k] for k in keys]

    def _admit(self, key: OffloadKey) -> bool:
        n = self._offers.pop(key, 0) or self._offers_old.pop(key, 0)
        n += 1
        if n >= self.admit_after:
            return True
        self._offers[key] = n
        if len(self._offers) >= 4 * self.num_blocks:  # a new generation; the oldest goes
            self._offers_old, self._offers = self._offers, {}
        return False

    def _evict(self, block: KVCacheBlock) -> OffloadKey:
        h = block.block_hash
        assert h is not None
        key = (block.group_id, h)
        del self._ready[key]
        block.block_hash = None
        block.group_id = -1
        self.num_evicted += 1
        if self.events is not None:
            self.events.removed(h, key[0])
        return key

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` unless every slot is exactly one of: free in the policy
        (``ref_cnt`` 0), being written (``ref_cnt`` 1, no hash), or ready (hashed, in the key
        table; pinned by loads while ``ref_cnt`` > 0, else in the policy)."""
        in_policy = {b.block_id for b in self.policy}
        problems = list(self.policy.check())
        writing = {b.block_id for b in self._writing.values()}
        for key, b in self._ready.items():
            if (b.group_id, b.block_hash) != key:
                problems.append(f"slot {b.block_id} is indexed under {key} but carries "
                                f"({b.group_id}, {b.block_hash!r})")
            if (b.ref_cnt == 0) != (b.block_id in in_policy):
                problems.append(f"ready slot {b.block_id} with ref_cnt {b.ref_cnt} is "
                                f"{'' if b.block_id in in_policy else 'not '}in the policy")
        for b in self._writing.values():
            if b.ref_cnt != 1 or b.block_hash is not None or b.block_id in in_policy:
                problems.append(f"slot {b.block_id} being written is not exclusively held")
        ready_ids = {b.block_id for b in self._ready.values()}
        for b in self.slots:
            if b.block_id in ready_ids or b.block_id in writing:
                continue
            if b.block_id not in in_policy or b.block_hash is not None or b.ref_cnt != 0:
                problems.append(f"slot {b.block_id} is neither free, written nor ready")
        if len(ready_ids) != len(self._ready) or ready_ids & writing:
            problems.append("a slot is held under two keys")
        if problems:
            raise InvariantError("host tier", "; ".join(problems[:5]))
