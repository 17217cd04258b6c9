"""vLLM's internal names over kvcore's state, for code written against vLLM's own manager.

vLLM's scheduler, its connectors and its unit tests reach past ``KVCacheManager`` into its
``coordinator``, the coordinator's ``single_type_managers`` and the ``block_pool``.  The adapter
hands them these views instead: each answers the names those callers read (found by grep over
vLLM 0.32's and 0.33's sources and tests) from kvcore's live state — nothing is copied, so a
view never goes stale — and is read-only where vLLM's callers only read.  A name a caller reads
or sets that a view does not provide means a caller kvcore was not checked against: every view
then raises :class:`~kvcore.errors.ViewAttributeError` naming the view and the name (a
``UnsupportedFeatureError`` that is also an ``AttributeError``, so ``hasattr`` and ``getattr``
with a default keep working), never a silent default.  Setting a name raises it too, except the
names kvcore honours (``GroupView.retains_longer_hit`` / ``retains_complete_hit``,
``FreeBlockQueueView.num_free_blocks``): a view never
grows an attribute nothing reads.

Blocks of request tables (``KVCacheBlocks``, ``req_to_blocks``, the free queue's list) are
kvcore's :class:`~kvcore.types.KVCacheBlock` objects, which carry vLLM's block names
(``block_id``, ``ref_cnt``, ``block_hash``, ``is_null``; ``block_hash`` is kvcore's bare hash and
``_block_hash`` vLLM's key).  The blocks the pool view looks up for a connector that binds vLLM's
pool (``blocks[i]``, ``get_cached_block``, ``free_block_queue.iter_blocks_after``) are
:class:`BlockView` objects, whose ``block_hash`` is vLLM's key (hash and group id), as a CPU
tier keyed by vLLM's keys needs.  The pool view's mutating calls, ``touch``, ``get_new_blocks`` and
``free_blocks``, go through kvcore's manager (``withhold`` / ``withhold_new_blocks`` /
``free_withheld``), so its
invariants hold after every call, and a call kvcore cannot honour raises a typed error and
changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, overload

from vllm.v1.core.single_type_kv_cache_manager import (
    CrossAttentionManager as VllmCrossAttentionManager,
)

from kvcore.block_pool import BlockPool
from kvcore.coordinator.hybrid import HybridCoordinator
from kvcore.errors import (
    BlockStateError,
    InvalidArgumentError,
    UnsupportedFeatureError,
    ViewAttributeError,
)
from kvcore.managers.base import SingleTypeKVCacheManager
from kvcore.types import BlockHash, KVCacheBlock

if TYPE_CHECKING:
    from kvcore.manager import KVCacheManager


class _View:
    """Base of every view: a name the view does not provide raises
    :class:`~kvcore.errors.ViewAttributeError`, read or set.  A view's own slots are set once,
    by its constructor; afterwards only the names in ``_settable`` can be set (properties that
    kvcore honours)."""

    __slots__ = ()
    _settable: ClassVar[frozenset[str]] = frozenset()

    def __getattr__(self, name: str) -> Any:  # only reached when the name is not found
        raise ViewAttributeError(type(self).__name__, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._settable:
            try:
                object.__getattribute__(self, name)
            except AttributeError:  # a slot the constructor has not filled yet
                if any(name in getattr(k, "__slots__", ()) for k in type(self).__mro__):
                    object.__setattr__(self, name, value)
                    return
            raise ViewAttributeError(type(self).__name__, name, setting=True)
        object.__setattr__(self, name, value)


class BlockView(_View):
    """One of kvcore's blocks with vLLM's ``KVCacheBlock`` names, read live: ``block_id``,
    ``ref_cnt``, ``is_null``, and ``block_hash`` / ``_block_hash`` as vLLM's key (hash and group
    id; ``None`` while uncached).  ``block_hash_num_tokens`` is the prefix a partial prompt-tail
    entry covers, ``None`` for a full block's hash (kvcore does not record a full block's
    position; vLLM's callers compare the value only for partial entries).  A view compares equal
    to, and hashes as, the block it shows (so it can stand for it in sets and comparisons);
    the pool view makes one per block."""

    __slots__ = ("_pool", "block")

    def __init__(self, block: KVCacheBlock, pool: BlockPool) -> None:
        self.block = block
        self._pool = pool

    @property
    def block_id(self) -> int:
        return self.block.block_id

    @property
    def ref_cnt(self) -> int:
        return self.block.ref_cnt

    @property
    def is_null(self) -> bool:
        return self.block.is_null

    @property
    def block_hash(self) -> bytes | None:
        return self.block._block_hash

    @property
    def _block_hash(self) -> bytes | None:
        return self.block._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._pool.partial_primary_tokens(self.block)

    def __eq__(self, other: object) -> bool:
        return other is self.block or (type(other) is BlockView and other.block is self.block)

    def __hash__(self) -> int:
        return hash(self.block)

    def __repr__(self) -> str:
        return f"BlockView({self.block!r})"


def _unwrap(blocks: Iterable[object]) -> list[object]:
    """kvcore's blocks for a caller's blocks or :class:`BlockView` objects (anything else
    passes through, for kvcore's manager to refuse by name)."""
    out: list[object] = []
    for b in blocks:
        out.append(b.block if isinstance(b, BlockView) else b)
    return out


class BlockViews(_View, Sequence[BlockView]):
    """vLLM's ``BlockPool.blocks``: block id -> :class:`BlockView`, one view per block, made on
    first use.  An id outside the pool raises ``IndexError`` naming it (vLLM's list does)."""

    __slots__ = ("_pool", "_views")

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._views: list[BlockView | None] = [None] * pool.num_blocks

    def view(self, block: KVCacheBlock) -> BlockView:
        """The view of one of the pool's blocks."""
        view = self._views[block.block_id]
        if view is None:
            view = self._views[block.block_id] = BlockView(block, self._pool)
        return view

    @overload
    def __getitem__(self, index: int) -> BlockView: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockView]: ...

    def __getitem__(self, index: int | slice) -> BlockView | list[BlockView]:
        blocks = self._pool.blocks
        if isinstance(index, slice):
            return [self.view(b) for b in blocks[index]]
        try:
            block = blocks[index]
        except (IndexError, TypeError):
            raise IndexError(f"block id {index!r} is not in the pool (ids 0 to "
                             f"{len(blocks) - 1})") from None
        return self.view(block)

    def __len__(self) -> int:
        return len(self._pool.blocks)

    def __iter__(self) -> Iterator[BlockView]:
        return map(self.view, self._pool.blocks)


class FreeBlockQueueView(_View):
    """vLLM's ``FreeKVCacheBlockQueue`` names over kvcore's free side (the eviction policy, plus
    the hint reserve when hints are declared)."""

    __slots__ = ("_kv", "_pool", "_views")
    _settable: ClassVar[frozenset[str]] = frozenset({"num_free_blocks"})

    def __init__(self, kv: KVCacheManager, views: BlockViews) -> None:
        self._kv = kv
        self._pool = kv.pool
        self._views = views

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @num_free_blocks.setter
    def num_free_blocks(self, value: int) -> None:
        """vLLM's tests set the count to exhaust the pool (0) and set it back later: kvcore
        holds free blocks back, or gives held ones back, until that many are free
        (``KVCacheManager.set_num_free_blocks``: held blocks count as in use; a count above
        the free and held blocks together raises ``NoFreeBlocksError``, changing nothing)."""
        self._kv.set_num_free_blocks(value)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, in the order they would be reused (the reserve's last)."""
        return [*self._pool.policy, *self._pool.reserve]

    def __len__(self) -> int:
        return self._pool.num_free_blocks

    def iter_blocks_after(self, cursor: BlockView | KVCacheBlock | None) -> Iterator[BlockView]:
        """The free blocks after ``cursor`` (from the first with ``None``), in the order
        kvcore would reuse them: the eviction policy's order (its segments in the order it
        takes victims from), then the hint reserve, least urgent first — the order of
        :meth:`get_all_free_blocks`.  With ``lru`` (and no hints) this is vLLM's free queue
        exactly; with ``slru`` / ``s3fifo`` / ``arc`` it is the order the policy examines
        blocks in, which a policy that gives blocks a second chance while picking may reorder
        (the walk then names the blocks that are evicted soonest, not their exact sequence).
        Lazy, as vLLM's: a walk must not outlive a change to the pool.

        A cursor that is not one of the pool's free blocks raises
        :class:`~kvcore.errors.BlockStateError` (vLLM's queue would yield nothing after a block
        it no longer holds; its one caller resets such a cursor first)."""
        pool = self._pool
        lists = [*pool.policy.queues(), pool.reserve]
        view = self._views.view
        if cursor is None:
            return map(view, chain.from_iterable(lists))
        block = cursor.block if type(cursor) is BlockView else cursor
        bid = getattr(block, "block_id", None)
        if not isinstance(bid, int) or not 0 <= bid < pool.num_blocks or pool.blocks[bid] is not block:
            raise BlockStateError(f"iter_blocks_after: {cursor!r} is not a block of this pool")
        if block.is_null or block.ref_cnt or block.next_free is None:
            raise BlockStateError(f"iter_blocks_after: block {bid} is not free (ref_cnt "
                                  f"{block.ref_cnt}): the walk has no position there")
        return map(view, _after(lists, block))


def _after(lists: Sequence[Any], cursor: KVCacheBlock) -> Iterator[KVCacheBlock]:
    """The blocks linked after ``cursor`` in its intrusive list, then every later list's."""
    tails = {id(q.tail): i for i, q in enumerate(lists)}
    node = cursor.next_free
    while node is not None:
        i = tails.get(id(node))
        if i is not None:
            for q in lists[i + 1:]:
                yield from q
            return
        yield node
        node = node.next_free


class CachedBlockHashesByBlockView(_View, Mapping[int, frozenset[bytes]]):
    """vLLM's ``cached_block_hashes_by_block``, read-only: block id -> the vLLM keys of the
    partial prompt-tail entries a cached block carries besides its hash (only blocks that
    carry some are keys)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def _keys(self, block: KVCacheBlock) -> frozenset[bytes]:
        group = block.group_id.to_bytes(4, "big") if block.group_id >= 0 else b""
        return frozenset(h + group for h in self._pool.secondary_keys(block))

    def __getitem__(self, block_id: int) -> frozenset[bytes]:
        blocks = self._pool.blocks
        if type(block_id) is int and 0 <= block_id < len(blocks):
            keys = self._keys(blocks[block_id])
            if keys:
                return keys
        raise KeyError(block_id)

    def __iter__(self) -> Iterator[int]:
        return (b.block_id for b in self._pool.blocks if self._pool.secondary_keys(b))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class CachedBlockMapView(_View, Mapping[BlockHash, KVCacheBlock]):
    """vLLM's ``cached_block_hash_to_block``, read-only: the cached blocks by hash, over all
    groups (kvcore keeps one map per group: a hash cached in two groups maps to the lower
    group's block and is iterated once per group; ``len`` counts cached blocks)."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __getitem__(self, block_hash: BlockHash) -> KVCacheBlock:
        for g in range(self._pool.num_groups):
            block = self._pool.cached_blocks_map(g).get(block_hash)
            if block is not None:
                return block
        raise KeyError(block_hash)

    def __iter__(self) -> Iterator[BlockHash]:
        for g in range(self._pool.num_groups):
            yield from self._pool.cached_blocks_map(g)

    def __len__(self) -> int:
        return self._pool.num_cached_blocks()

    @property
    def _cache(self) -> Mapping[bytes, KVCacheBlock]:
        """vLLM's private dict, read-only and made on each read: every cached block by vLLM's
        key (hash followed by the group id, 4 bytes big-endian; the block's ``_block_hash``)."""
        pool = self._pool
        return MappingProxyType({
            h + g.to_bytes(4, "big"): block
            for g in range(pool.num_groups) for h, block in pool.cached_blocks_map(g).items()})


class BlockPoolView(_View):
    """vLLM's ``BlockPool`` names over kvcore's pool (see the module docstring).  Its
    mutating names are references held outside kvcore's requests: ``touch`` takes them
    (kvcore's ``KVCacheManager.withhold``: vLLM's ``SimpleCPUOffloadConnector`` pins blocks it
    copies), ``get_new_blocks`` takes fresh blocks so (``withhold_new_blocks``: a block copy's
    endpoints), ``free_blocks`` returns them and the blocks a deferred free withheld
    (``KVCacheManager.free_withheld``)."""

    __slots__ = ("_kv", "_pool", "_views", "cached_block_hash_to_block",
                 "cached_block_hashes_by_block", "enable_caching", "free_block_queue",
                 "hash_block_size", "num_hash_lookahead_tokens")

    def __init__(self, kv: KVCacheManager, hash_block_size: int, num_hash_lookahead_tokens: int
                 ) -> None:
        pool = kv.pool
        self._kv = kv
        self._pool = pool
        self.enable_caching = pool.enable_caching
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self._views = BlockViews(pool)
        self.free_block_queue = FreeBlockQueueView(kv, self._views)
        self.cached_block_hash_to_block = CachedBlockMapView(pool)
        self.cached_block_hashes_by_block = CachedBlockHashesByBlockView(pool)

    @property
    def blocks(self) -> BlockViews:
        """Every block by id, as :class:`BlockView` objects."""
        return self._views

    @property
    def null_block(self) -> KVCacheBlock:
        return self._pool.null_block

    @property
    def num_gpu_blocks(self) -> int:
        return self._pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks from the prefix cache (reference counts unchanged; an id out of
        range raises before anything changes): the adapter's ``evict_blocks``."""
        self._kv.evict_blocks(block_ids)

    def get_usage(self) -> float:
        return self._pool.usage

    def touch(self, blocks: Iterable[BlockView | KVCacheBlock]) -> None:
        """vLLM's ``touch`` for a holder outside the scheduler's requests (a connector that
        copies the blocks): one more reference on each block, a free (cached) one leaves the
        free queue; ``free_blocks`` returns them.  kvcore's ``KVCacheManager.withhold``: the
        references count as withheld, and taking one records no access.  Null blocks are
        skipped (vLLM 0.32 counts the null block's reference, 0.33 skips it too).

        Raises :class:`~kvcore.errors.BlockStateError`, changing nothing, for a block of
        another pool and for a free block that caches nothing.  Each (non-null) block is an
        access for the pool's observer (vLLM's residency metrics count the copy's touch)."""
        batch = _unwrap(blocks)
        self._kv.withhold(batch)  # raises, changing nothing, unless all are the pool's blocks
        observer = self._pool.observer
        if observer is not None:
            for block in batch:
                if isinstance(block, KVCacheBlock) and not block.is_null:
                    observer.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[BlockView | KVCacheBlock]) -> None:
        """Return references ``touch`` took or ``pop_blocks_for_free`` withheld, first evicted
        first (vLLM's scheduler drains its deferred frees through this once their step has
        finished; a connector returns what it touched once its copy is done): a block whose
        last reference this is returns to the free side, cached ones to the end of the order
        and uncached ones to its front, as vLLM's ``free_blocks`` does.

        A block returned more often than it was withheld (a double free, or a block only
        requests hold) or one of another pool raises :class:`~kvcore.errors.BlockStateError`
        and changes nothing."""
        self._kv.free_withheld(_unwrap(ordered_blocks))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """vLLM's ``get_new_blocks`` for a holder outside the scheduler's requests (a block
        copy's endpoints): ``num_blocks`` blocks off the free side, each with one reference
        withheld until ``free_blocks`` returns it (kvcore's ``withhold_new_blocks``).  Asking
        for more than are free raises :class:`~kvcore.errors.NoFreeBlocksError` and changes
        nothing."""
        return self._kv.withhold_new_blocks(num_blocks)

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: Sequence[int]) -> list[BlockView] | None:
        """The block cached under ``block_hash`` in each of these groups, or ``None`` if any
        group misses (vLLM's contract)."""
        found = self._pool.get_cached_block(block_hash, kv_cache_group_ids)
        return None if found is None else [self._views.view(b) for b in found]


class GroupView(_View):
    """vLLM's ``SingleTypeKVCacheManager`` names over one of kvcore's single-type managers:
    the group's id, spec and block size, whether its hits drop the EAGLE block, and (read-only)
    its block tables and cached-block watermarks.

    ``retains_longer_hit`` and ``retains_complete_hit`` can be set (a KV connector's bind
    does, for the full-attention groups whose resident KV it reuses while it loads the other
    groups'): kvcore honours the first through ``KVCacheManager.retain_longer_hits`` (the
    group's lookups keep its own longer hit, and an admission keeps as much of it as the local
    and external tokens cover, as vLLM's manager does with ``retained_hit_group_ids``; one set
    behind both names).  The second is recorded and read back: a retained hit in kvcore is
    already the group's complete own hit up to the lookup's cap (kvcore searches each
    full-attention group once, before any other type, and never shortens it), so it changes
    nothing more.  Both take a bool; anything else raises
    :class:`~kvcore.errors.InvalidArgumentError` and changes nothing."""

    __slots__ = ("_complete", "_kv", "_manager", "block_pool", "block_size",
                 "kv_cache_group_id", "kv_cache_spec", "num_cached_block", "req_to_blocks",
                 "use_eagle")
    _settable = frozenset({"retains_longer_hit", "retains_complete_hit"})

    records_new_block_ids = False

    def __init__(self, kv: KVCacheManager, manager: SingleTypeKVCacheManager, spec: Any,
                 block_pool: BlockPoolView) -> None:
        self._kv = kv
        self._manager = manager
        self._complete = False
        self.kv_cache_group_id = manager.group_id
        self.kv_cache_spec = spec
        self.block_size: int = spec.block_size
        self.block_pool = block_pool
        self.use_eagle = manager.use_eagle
        self.req_to_blocks: Mapping[str, list[KVCacheBlock]] = MappingProxyType(
            manager.req_to_blocks)
        self.num_cached_block: Mapping[str, int] = MappingProxyType(manager.num_cached_block)

    @property
    def enable_caching(self) -> bool:
        return self._manager.enable_caching

    @property
    def _null_block(self) -> KVCacheBlock:
        return self._manager.null_block

    @property
    def _pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """vLLM's pending copy-on-write list: the group's live ``pending_copies`` list.  A pair
        appended here is taken by the adapter's ``take_kv_cache_block_copies``; each endpoint
        must hold a withheld reference (``block_pool.get_new_blocks`` / ``touch``) that the
        take hands over as the copy's retention (else the take raises
        :class:`~kvcore.errors.BlockStateError`, changing nothing)."""
        return self._manager.pending_copies

    @property
    def retains_longer_hit(self) -> bool:
        """Whether the group keeps its own longer hit (see the class docstring)."""
        return self.kv_cache_group_id in self._kv.retained_hit_groups

    @retains_longer_hit.setter
    def retains_longer_hit(self, value: bool) -> None:
        groups = set(self._kv.retained_hit_groups)
        if _flag("retains_longer_hit", value):
            groups.add(self.kv_cache_group_id)
        else:
            groups.discard(self.kv_cache_group_id)
        self._kv.retain_longer_hits(sorted(groups))

    @property
    def retains_complete_hit(self) -> bool:
        """What a caller set (see the class docstring); ``False`` until then."""
        return self._complete

    @retains_complete_hit.setter
    def retains_complete_hit(self, value: bool) -> None:
        object.__setattr__(self, "_complete", _flag("retains_complete_hit", value))


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    return value


@VllmCrossAttentionManager.register
class CrossAttentionGroupView(GroupView):
    """The view of a cross-attention group (encoder-decoder models).  Registered as a virtual
    subclass of vLLM's ``CrossAttentionManager`` (an ABC), so code that finds the encoder group
    by ``isinstance`` — vLLM's own scheduler tests do — finds it here too."""

    __slots__ = ()


class CoordinatorView(_View):
    """vLLM's ``KVCacheCoordinator`` names over kvcore's coordinator: the pool, one
    :class:`GroupView` per group, the EAGLE group sets, and the block count the scheduler's
    reservation of in-flight prefills reads."""

    __slots__ = ("_kv", "block_pool", "drop_eagle_group_ids", "eagle_group_ids",
                 "kv_cache_config", "single_type_managers")

    num_reprefillable_tokens = 0

    @property
    def enable_partial_hash_hits(self) -> bool:
        """vLLM's flag: whether hits may end inside a block (``KVCacheConfig.partial_block_hits``;
        vLLM's scheduler then also ends a Mamba prefill chunk at the prompt's last hash unit)."""
        return self._kv.coordinator.partial_hits

    def __init__(self, kv: KVCacheManager, kv_cache_config: Any, block_pool: BlockPoolView,
                 eagle_group_ids: set[int], drop_eagle_group_ids: set[int]) -> None:
        self._kv = kv
        self.kv_cache_config = kv_cache_config
        self.block_pool = block_pool
        self.single_type_managers = tuple(
            (CrossAttentionGroupView if m.uses_encoder_tokens else GroupView)(
                kv, m, g.kv_cache_spec, block_pool)
            for m, g in zip(kv.coordinator.managers, kv_cache_config.kv_cache_groups))
        self.eagle_group_ids = eagle_group_ids
        self.drop_eagle_group_ids = drop_eagle_group_ids

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Free blocks the request needs to hold ``num_tokens`` tokens (vLLM's reservation of
        in-flight prefills reads it)."""
        kv = self._kv
        return kv.coordinator.num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
            total_computed_tokens, kv.admission_caps if apply_admission_cap else None,
            num_tokens_main_model, prefill_end, not apply_admission_cap,
            num_local_computed_tokens=num_local_computed_tokens)

    @property
    def full_attention_group_id(self) -> int | None:
        coord = self._kv.coordinator
        return coord.full_attention_group_id if isinstance(coord, HybridCoordinator) else None

    def find_longest_cache_hit(self, block_hashes: Sequence[Any], max_cache_hit_length: int
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """vLLM's coordinator lookup, for a connector: (hit blocks per group, the hit length
        all groups agree on, how many tokens beyond it some group found cached — vLLM's
        ``num_uncached_common_prefix_tokens``).  A retained group keeps its own longer hit.  No request is
        given, so with ``verify_hits`` the hit is not proven against tokens here (the
        adapter's ``get_computed_blocks`` does that for the hit a request is admitted with).
        Changes no state."""
        blocks, length, longest = self._kv.coordinator.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, None)
        # (kvcore's third value is the longest group hit when longer than the agreed one)
        return tuple(list(b) for b in blocks), length, longest - length if longest else 0

    def find_longest_cache_hit_per_group(
            self, block_hashes: Sequence[Any], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each group's own longest hit and its length (hybrid models; see kvcore's
        ``HybridCoordinator.find_longest_cache_hit_per_group``)."""
        coord = self._kv.coordinator
        if not isinstance(coord, HybridCoordinator):
            raise UnsupportedFeatureError("per-group prefix lookups exist for hybrid models "
                                          "only (vLLM's HybridKVCacheCoordinator)")
        return coord.find_longest_cache_hit_per_group(block_hashes, max_cache_hit_length)



class HybridCoordinatorView(CoordinatorView):
    """The view of a hybrid model's coordinator: registered as a virtual subclass of vLLM's
    ``HybridKVCacheCoordinator`` (an abstract base class), so vLLM's
    ``isinstance(coordinator, HybridKVCacheCoordinator)`` checks (its offloading connector,
    its tests) see what vLLM would have built."""

    __slots__ = ()


def coordinator_view(kv: KVCacheManager, kv_cache_config: Any, block_pool: BlockPoolView,
                     eagle_group_ids: set[int], drop_eagle_group_ids: set[int]
                     ) -> CoordinatorView:
    """The view matching kvcore's coordinator (hybrid models get :class:`HybridCoordinatorView`,
    registered with vLLM's class on first use)."""
    if not isinstance(kv.coordinator, HybridCoordinator):
        return CoordinatorView(kv, kv_cache_config, block_pool, eagle_group_ids,
                               drop_eagle_group_ids)
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    if not issubclass(HybridCoordinatorView, HybridKVCacheCoordinator):
        HybridKVCacheCoordinator.register(HybridCoordinatorView)
    return HybridCoordinatorView(kv, kv_cache_config, block_pool, eagle_group_ids,
                                 drop_eagle_group_ids)
