"""BlockPool: every KV-cache block, the free side (an eviction policy), the null block and the
prefix-cache maps.

One pool serves every KV-cache group of a model.  Blocks move between two states:

* **free** (``ref_cnt == 0``, held by the eviction policy ``policy``).  A free block may still
  carry a hash and sit in its group's map: it is a prefix-cache entry that a hit can *resurrect*
  with ``touch``.  It loses the hash only when ``get_new_blocks`` reuses it (lazy eviction).
* **in use** (``ref_cnt > 0``, not linked).

The policy (:mod:`kvcore.eviction`, ``lru`` by default) decides which free block is reused next;
with ``lru``, ``free_blocks`` returns hashed blocks to the tail (evicted last) and unhashed blocks
to the head (reused first), so a request freeing its blocks tail-first leaves its prefix to live
longest.  A scheduler may declare upcoming prefixes (``set_hints``): free blocks caching them
wait in a *reserve* that is reused only once the policy has no block left (a soft pin).
Block 0 is the null block, taken at construction; the first allocation returns ids 1, 2, ...

``cache_version`` lets a caller keep the answer of a lookup, and the failure of an allocation,
for as long as they still hold (a scheduler retrying the head of its queue)::

    changes that bump cache_version            changes that do not
    -----------------------------------------  -------------------------------------------
    an entry under a watched hash cached,      entries under other hashes (while a watch is
      replaced or evicted (watch(None): any)     set), reference counts that stay above 0,
    a reset of the prefix cache                blocks freed (num_free_blocks grows instead),
    touch, pin (a free block taken by a hit)   blocks allocated (num_free_blocks shrinks),
    the manager's retain_longer_hits           hints (set_hints), retain, release notes

A lookup of hashes all watched answers the same while ``cache_version`` is unchanged; an
allocation that failed fails again, given the same arguments, while ``cache_version`` is
unchanged and ``num_free_blocks`` has not grown (only a hit taken, or the hit blocks evicted,
lowers what it needs along with the free count).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex

from kvcore.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidGroupError,
    KVCoreError,
    NoFreeBlocksError,
    NullBlockError,
)
from kvcore.events import EventRecorder, KVCacheEvent
from kvcore.eviction.base import EvictionPolicy, Release
from kvcore.eviction.lru import FreeBlockQueue
from kvcore.eviction.registry import make_policy
from kvcore.pool.hints import HINT_RESERVE_SHARE, HintReserve
from kvcore.pool.maps import PrefixMaps
from kvcore.pool.observer import PoolObserver, check_observer
from kvcore.settings import CacheSettings
from kvcore.types import BlockHash, KVCacheBlock, NullBlock
from kvcore.validation import check_collection, check_count, check_flag, check_hashes

if TYPE_CHECKING:
    from kvcore.types import KVRequest, PrefixNode

__all__ = ["HINT_RESERVE_SHARE", "BlockPool"]


def _group_ids_error(group_ids: object) -> KVCoreError | None:
    """The typed error naming what is wrong with ``group_ids`` (not a collection, or holding a
    group id that is not an int), or ``None``."""
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Iterable):
        return InvalidArgumentError(f"group_ids must be a collection of group ids, got "
                                    f"{group_ids!r:.80}")
    for g in group_ids:
        if type(g) is not int:
            return InvalidGroupError(f"a group id must be an int, got {g!r}")
    return None


class BlockPool:
    """Owns ``num_blocks`` blocks (ids ``0..num_blocks-1``; 0 is the null block).

    Args:
        num_blocks: total blocks, the null block included (so ``num_blocks - 1`` are usable).
        num_groups: number of KV-cache groups; each has its own hash map, so a hash cached in
            group 0 never hits in group 1.
        settings: the :class:`~kvcore.settings.CacheSettings` the pool reads:
            ``enable_caching`` (keep prefix-cache maps; when off, blocks are never hashed),
            ``eviction_policy`` (the free side's policy, see :mod:`kvcore.eviction`),
            ``verify_hits`` (every cached block keeps the exact prefix its KV belongs to, a
            :class:`~kvcore.types.PrefixNode` given to ``cache_full_blocks``, so lookups can
            prove a hit) and ``enable_events`` (record :mod:`kvcore.events` for ``take_events``).
        events: the recorder the events go to (default: one that stamps no spec metadata; the
            manager passes one stamped with its groups' spec kinds and windows).
        observer: told of allocations, hits, evictions and resets as they happen (see
            :mod:`kvcore.pool.observer`; ``set_observer`` changes it later).
        **options: :class:`CacheSettings` fields, a shorthand for ``settings=``.
    """

    # Arguments are annotated with types the compiled build does not check on entry (an int
    # parameter would take True as 1): the checks below raise kvcore's typed errors in both builds.
    def __init__(self, num_blocks: SupportsIndex, *, num_groups: SupportsIndex = 1,
                 settings: CacheSettings | None = None, events: object = None,
                 observer: PoolObserver | None = None, **options: Any) -> None:
        if type(num_blocks) is not int or num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
        if type(num_groups) is not int or num_groups < 1:
            raise InvalidArgumentError(f"num_groups must be a positive int, got {num_groups!r}")
        settings = CacheSettings._of(settings, options)
        recorder: EventRecorder | None = None
        if events is not None:
            if not isinstance(events, EventRecorder):
                raise InvalidArgumentError(f"events must be an EventRecorder, got {events!r}")
            recorder = events
        self._observer: PoolObserver | None = check_observer(observer)
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.settings = settings
        self.enable_caching = settings.enable_caching
        self.verify_hits = settings.verify_hits and self.enable_caching
        self.null_block: KVCacheBlock = NullBlock(0)
        self.blocks: list[KVCacheBlock] = [self.null_block]
        self.blocks.extend(KVCacheBlock(i) for i in range(1, num_blocks))
        # The free side: any eviction policy (``lru``, vLLM's free queue, by default).
        self.policy: EvictionPolicy = make_policy(settings.eviction_policy, self.blocks[1:])
        # Events go to the recorder as they happen; None when events are off.
        self.events: EventRecorder | None = (
            (recorder if recorder is not None
             else EventRecorder(lookahead=settings.num_hash_lookahead_tokens))
            if settings.enable_events
            else None)
        # Scheduler hints (set_hints): the free blocks caching declared prefixes, held out of
        # the policy until needed.  The hot methods read its fields through a local.
        self._hint_reserve = HintReserve(num_blocks - 1, self.policy)
        # The prefix-cache maps (per group: hash -> first block cached under it; duplicates and
        # partial prompt-tail entries apart, see kvcore.pool.maps).
        self._maps = PrefixMaps(num_groups)
        self.num_evicted_blocks = 0
        self.num_resets = 0  # successful reset_prefix_cache calls
        # What can change what a cached block holds besides an eviction: prefix-cache resets and
        # entries taken off a block that stays (move_block_hashes; cache_partial_block replacing
        # a block's entries).  A LookupHit is stamped with it (kvcore.manager): a hit handed back
        # after one of these is checked again, not trusted.
        self.num_invalidations = 0
        self.num_rejected_hits = 0  # lookups whose block held another prefix (verify mode)
        # See the module docstring: bumped by changes to entries under the watched hashes
        # (None: under any hash), resets and hits taken.
        self.cache_version = 0
        self._watched: frozenset[BlockHash] | None = None

    @property
    def enable_events(self) -> bool:
        return self.events is not None

    @property
    def observer(self) -> PoolObserver | None:
        """The pool's observer (:mod:`kvcore.pool.observer`), or ``None``."""
        return self._observer

    def set_observer(self, observer: PoolObserver | None) -> None:
        """Tell ``observer`` of every later allocation, hit, eviction and reset
        (:mod:`kvcore.pool.observer`; ``None``: nobody).  An object without every callback
        raises :class:`InvalidArgumentError` and the observer stays as it was."""
        self._observer = check_observer(observer)

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out (cached-but-free blocks included)."""
        return len(self.policy) + len(self._hint_reserve.queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1] (the null block is not counted)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    @property
    def eviction_policy(self) -> str:
        """The free side's policy name."""
        return self.policy.name

    @property
    def free_queue(self) -> EvictionPolicy:
        """Deprecated name of :attr:`policy` (it holds any eviction policy, not only ``lru``'s
        free queue); kept one release."""
        warnings.warn("BlockPool.free_queue is deprecated: use BlockPool.policy",
                      DeprecationWarning, stacklevel=2)
        return self.policy

    @property
    def reserve(self) -> FreeBlockQueue:
        """Free cached blocks held for declared upcoming prefixes (see ``set_hints``), the first
        released first."""
        return self._hint_reserve.queue

    @property
    def hints(self) -> tuple[frozenset[BlockHash], ...]:
        """Per group, the hashes currently declared upcoming (empty sets when none)."""
        hints = self._hint_reserve.hints
        if hints is None:
            return tuple(frozenset() for _ in range(self.num_groups))
        return tuple(frozenset(h) for h in hints)

    def get_cached_block(self, block_hash: BlockHash,
                         group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group in ``group_ids`` for ``block_hash``, or ``None`` if any
        group misses.  With duplicates, the earliest cached block is returned."""
        out = []
        maps = self._maps.cached
        n = self.num_groups
        try:  # (no cost until it raises: the managers' lookups call this per block)
            for g in group_ids:
                if not 0 <= g < n:
                    raise InvalidGroupError(f"group id {g} out of range [0, {n})")
                block = maps[g].get(block_hash)
                if block is None:
                    return None
                out.append(block)
        except TypeError:  # a group id that is not an int, or group_ids not a collection
            error = _group_ids_error(group_ids)
            if error is None:
                raise
            raise error from None
        return out

    def watch(self, hashes: object) -> None:
        """Bump ``cache_version`` from now on only for changes to the entries under ``hashes``
        (a frozenset of block hashes, in any group), besides resets and hits taken; ``None``:
        for changes under any hash (the default).  Changes nothing else (see the module
        docstring).  ``hashes`` is typed ``object`` so that the compiled build refuses anything
        else with the same typed error as pure Python (mypyc would raise a bare TypeError at a
        ``frozenset | None`` parameter)."""
        if hashes is not None and not isinstance(hashes, frozenset):
            raise InvalidArgumentError(f"watch takes a frozenset of block hashes or None, got "
                                       f"{hashes!r:.80}")
        self._watched = hashes

    def _changed(self, keys: Iterable[BlockHash]) -> None:
        """Entries under ``keys`` changed: bump ``cache_version`` if one of them is watched."""
        watched = self._watched
        if watched is None or not watched.isdisjoint(keys):
            self.cache_version += 1

    def cached_blocks_map(self, group_id: int) -> dict[BlockHash, KVCacheBlock]:
        """Group ``group_id``'s hash → block map (read-only view for hot lookups by managers)."""
        if not 0 <= group_id < self.num_groups:
            raise InvalidGroupError(f"group id {group_id} out of range [0, {self.num_groups})")
        return self._maps.cached[group_id]

    def iter_cached(self, group_id: int) -> Iterator[tuple[BlockHash, KVCacheBlock]]:
        """Every ``(hash, block)`` entry of a group's map, duplicates included."""
        return self._maps.iter_group(group_id)

    def num_cached_blocks(self) -> int:
        """Blocks currently registered in some group's map."""
        return len(self._maps)

    # -- allocation -----------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: SupportsIndex) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the free side, each with ``ref_cnt == 1``: the policy's
        victims (``lru``: the head of its queue).  When the policy holds too few, the hint
        reserve's least urgent blocks return to it first.

        A block taken that still carries a hash is evicted from its group's map (lazy eviction,
        emitting ``BlockRemoved``).  Raises :class:`NoFreeBlocksError` if too few are free.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            num_blocks = check_count("num_blocks", num_blocks)
        if num_blocks > len(self.policy):
            self._release_reserve(num_blocks)  # raises if even the reserve is too small
        if not num_blocks:
            return []
        blocks = self.policy.pick_victims(num_blocks, 1)
        if self.enable_caching:
            for block in blocks:
                if block.block_hash is not None:
                    self._evict(block)
        if self._observer is not None:
            self._observe_allocation(self._observer, blocks)
        return blocks

    def _observe_allocation(self, observer: PoolObserver, blocks: list[KVCacheBlock]) -> None:
        """Tell the observer of blocks handed out: with caching, each one's eviction from the
        prefix cache first (cached or not), as vLLM's pool reports them."""
        if self.enable_caching:
            for block in blocks:
                observer.on_block_evicted(block)
                observer.on_block_allocated(block)
        else:
            for block in blocks:
                observer.on_block_allocated(block)

    def _release_reserve(self, num_blocks: int) -> None:
        """Return reserved blocks to the policy until it holds ``num_blocks`` (soft pins yield
        before an allocation fails); :class:`NoFreeBlocksError` if all free blocks are fewer."""
        short = num_blocks - len(self.policy)
        if short > len(self._hint_reserve.queue):
            raise NoFreeBlocksError(
                f"cannot allocate {num_blocks} blocks: only {self.num_free_blocks} are free")
        self._hint_reserve.release(short)

    # trusted: object, not bool: the compiled build would raise TypeError on entry for a
    # non-bool instead of the InvalidArgumentError of check_flag (here and below).
    def touch(self, blocks: Iterable[KVCacheBlock], *, trusted: object = False) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free side
        (the policy, which records the hit, or the hint reserve).

        Null blocks are skipped: their reference count is not tracked.  A block of another pool,
        or a free block that is not on the free side, raises :class:`BlockStateError` before
        anything changes.

        ``trusted`` (a bool) skips those checks, for a caller passing blocks known to be this
        pool's and consistent (kvcore's single-type managers: their hits, checked where they
        entered the manager).
        """
        # (A hit's groups are tuples: taken as they are, not copied, ~100 ns of a 6-block hit.)
        batch: Sequence[KVCacheBlock] = (blocks if isinstance(blocks, (tuple, list))
                                         else check_collection("touch's blocks", blocks))
        if trusted is not True:
            if trusted is not False:
                check_flag("trusted", trusted)
            self._check_takeable(batch, "touch")
        if batch:
            self.cache_version += 1  # a hit taken: a free block may leave the free side
        observer = self._observer
        if observer is not None:
            for block in batch:
                if not block.is_null:
                    observer.on_block_accessed(block)
        reserved = self._hint_reserve.held
        if reserved:  # reserved blocks are handed out here; the policy records the hit
            held: list[KVCacheBlock] = []
            rest: list[KVCacheBlock] = []
            for block in batch:
                (held if block.block_id in reserved else rest).append(block)
            if held:
                for block in held:
                    if block.ref_cnt:  # listed twice: its first copy took it out already
                        block.ref_cnt += 1
                        continue
                    self._hint_reserve.unhold(block)
                    block.ref_cnt = 1
                self.policy.on_hit(held)
                batch = rest
        self.policy.on_touch(batch)

    def pin(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block *without* recording an access: a free block
        leaves the free side (the policy, or the hint reserve) as it is, so the eviction
        policy's history is what it was (a holder that only copies the block, such as a KV
        offload, is not a reuse).  ``free_blocks`` returns it as any freed block.

        Null blocks are skipped.  A block of another pool, or a free block that is not on the
        free side, raises :class:`BlockStateError` before anything changes.
        """
        batch = check_collection("pin's blocks", blocks)
        self._check_takeable(batch, "pin")
        self.cache_version += 1  # as touch: a free block may leave the free side
        reserved = self._hint_reserve.held
        for block in batch:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                if block.block_id in reserved:
                    self._hint_reserve.unhold(block)
                else:
                    self.policy.remove(block)
            block.ref_cnt += 1

    def retain(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A retention hint: record one access on each cached block in use (as a prefix hit
        would, through the policy's ``on_hit``) without taking a reference.  Free, uncached and
        null blocks are skipped; a block of another pool raises :class:`BlockStateError` before
        anything changes."""
        batch = check_collection("retain's blocks", blocks)
        self._check_owned(batch, "retain")
        if self.enable_caching:
            cached = [b for b in batch if b.ref_cnt > 0 and b.block_hash is not None]
            if cached:
                self.policy.on_hit(cached)

    def note_release(self, groups: Sequence[Sequence[KVCacheBlock]], release: object, *,
                     trusted: object = False) -> None:
        """A request is about to free (or hand back) the blocks of ``groups`` (one list per
        group, table order): passed to the policy's ``on_release`` (``release``: what the
        policy reads of a request, a :class:`~kvcore.eviction.base.Release`).  Changes no
        reference count.

        A release that does not match the pool (not a :class:`Release`, another group count,
        a block of another pool) raises before the policy hears of it (``release`` is typed
        ``object`` so that the compiled build does not refuse a wrong type with its own
        ``TypeError`` first).  ``trusted`` (a bool) skips those checks, for a caller that passes
        its own tables (kvcore's SGLang backend; kvcore's manager calls the policy's
        ``on_release`` itself)."""
        if trusted is not True:
            if trusted is not False:
                check_flag("trusted", trusted)
            self._check_release(groups, release)
        # (an annotated local, not cast(): cast is a Python call per release in the pure build)
        checked: Release = release  # type: ignore[assignment]  # checked above, or trusted
        self.policy.on_release(groups, checked)

    def _check_release(self, groups: object, release: object) -> None:
        if not isinstance(release, Release):
            raise InvalidArgumentError(f"note_release needs a Release, got {release!r:.80}")
        if (not isinstance(groups, (list, tuple)) or len(groups) != self.num_groups
                or len(release.block_sizes) != self.num_groups):
            raise InvalidArgumentError(
                f"note_release needs one block list and one block size per group "
                f"({self.num_groups}), got {groups!r:.80} and block sizes "
                f"{release.block_sizes!r}")
        for group in groups:
            self._check_owned(check_collection("note_release's groups", group), "note_release")
        check_count("num_prompt_tokens", release.num_prompt_tokens)
        check_count("num_output_tokens", release.num_output_tokens)
        if not all(type(b) is int and b > 0 for b in release.block_sizes):
            raise InvalidArgumentError(f"note_release: block sizes must be positive ints, got "
                                       f"{release.block_sizes!r}")

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], *,
                    trusted: object = False) -> None:
        """Drop one reference on each block, ``ordered_blocks`` being in eviction priority order
        (first = evict first).  Null blocks are skipped.  Blocks reaching zero return to the free
        side in that order, the uncached ones apart from the cached ones: the policy places
        each kind (``lru``: uncached to the head, reused first, cached to the tail), and a
        cached block serving a declared hint (``set_hints``) waits in the reserve instead.

        Freeing a block more often than it is referenced raises :class:`DoubleFreeError`, and a
        block of another pool :class:`BlockStateError`; either leaves everything unchanged.
        ``trusted`` (a bool) skips the ownership check (not the double-free one), for a caller
        freeing blocks of its own tables (kvcore's single-type managers).
        """
        # (Typed list: the compiled build then iterates and indexes it natively; as an Iterable
        # it took the generic protocol, 1.7x the time of a compiled free, issue 37's bench.)
        blocks: list[KVCacheBlock] = (
            ordered_blocks if isinstance(ordered_blocks, list)
            else check_collection("free_blocks' ordered_blocks", ordered_blocks))
        if trusted is not True:
            if trusted is not False:
                check_flag("trusted", trusted)
            self._check_owned(blocks, "free_blocks")
        to_head: list[KVCacheBlock] = []
        to_tail: list[KVCacheBlock] = []
        caching = self.enable_caching
        it = iter(blocks)
        for block in it:
            ref_cnt = block.ref_cnt
            if ref_cnt > 1:
                block.ref_cnt = ref_cnt - 1
            elif ref_cnt == 1:
                block.ref_cnt = 0
                if caching and block.block_hash is not None:
                    to_tail.append(block)
                else:
                    to_head.append(block)
            elif block.is_null:
                continue
            else:
                failed_at = len(blocks) - sum(1 for _ in it) - 1
                for undo in blocks[:failed_at]:
                    if not undo.is_null:
                        undo.ref_cnt += 1
                raise DoubleFreeError(f"block {block.block_id} freed with ref_cnt {ref_cnt}")
        if to_tail:
            reserve = self._hint_reserve
            if reserve.hints is not None:
                to_tail = reserve.divert(to_tail, self._maps.cached)
        if to_head or to_tail:
            self.policy.on_free(to_head, to_tail)

    def set_hints(self, hashes: Sequence[Iterable[BlockHash]]) -> None:
        """Declare the prefixes a scheduler is about to run: per group, the block hashes of its
        upcoming requests, most urgent first (replacing the previous declaration; empty
        iterables clear it).

        Free blocks caching a declared hash (the block a lookup would hit) are moved to the
        reserve, reused only after every block the policy holds: a soft pin that changes
        eviction order, never correctness or whether an allocation succeeds.  Blocks no longer
        declared return to the policy.  O(number of hashes) per call.
        """
        if not isinstance(hashes, Sequence) or isinstance(hashes, (str, bytes)) or len(
                hashes) != self.num_groups:
            raise InvalidArgumentError(
                f"set_hints needs one hash collection per group ({self.num_groups}), "
                f"got {hashes!r:.80}")
        new = [dict.fromkeys(check_hashes(group)) for group in hashes]
        self._hint_reserve.declare(new if self.enable_caching and any(new) else None,
                                   self._maps.cached)

    # -- prefix cache ---------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        request: KVRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        block_hashes: Sequence[BlockHash] | None = None,
        block_mask: Sequence[bool] | None = None,
        prefix_nodes: Sequence[PrefixNode] | None = None,
        *,
        trusted: object = False,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` (now full) in group
        ``group_id``'s map under their hashes.

        ``block_hashes`` are the request's hashes at this group's block size (default:
        ``request.block_hashes``).  Null blocks are skipped, and so are blocks whose entry in
        ``block_mask`` (aligned with the new blocks) is false.  A block already cached under the
        same hash in the same group is left as it is; a block cached elsewhere (another group or
        another hash) is rejected with :class:`InvalidGroupError` / :class:`BlockStateError`
        before anything changes.  Emits one ``BlockStored`` for the call, as vLLM does: its
        hashes are the blocks stored now (none when all were skipped), its tokens the whole
        range.

        With ``verify_hits``, ``prefix_nodes`` (aligned with ``block_hashes``) give each block the
        exact prefix its KV belongs to.

        ``trusted`` (a bool) skips the checks, for a caller passing its own block table and the
        counts it keeps, whose inputs were checked where they entered it (kvcore's single-type
        managers: this runs every time a block fills).
        """
        if not self.enable_caching:
            if trusted is not True and trusted is not False:
                check_flag("trusted", trusted)
            return
        hashes = request.block_hashes if block_hashes is None else block_hashes
        if trusted is True:
            new_blocks = blocks[num_cached_blocks:num_full_blocks]
        else:
            if trusted is not False:
                check_flag("trusted", trusted)
            new_blocks = self._blocks_to_cache(blocks, hashes, num_cached_blocks, num_full_blocks,
                                               group_id, block_mask, prefix_nodes)
        if not new_blocks:
            return
        maps = self._maps
        cached = maps.cached[group_id]
        nodes = prefix_nodes if self.verify_hits else None
        partial = maps.partial_primary
        stored: list[int] = []  # indices into new_blocks
        num_already_cached = 0
        for i, block in enumerate(new_blocks):
            if block.is_null or (block_mask is not None and not block_mask[i]):
                continue
            if block.block_hash is not None:
                if not partial or block.block_id not in partial:
                    num_already_cached += 1  # under this hash (checked above): idempotent
                    continue
                self._drop_partial_primary(block, group_id)
            idx = num_cached_blocks + i
            h = hashes[idx]
            block.block_hash = h
            block.group_id = group_id
            if nodes is not None:
                block.prefix_node = nodes[idx]
            if h in cached:
                maps.dups[group_id].setdefault(h, {})[block.block_id] = block
            else:
                cached[h] = block
            stored.append(i)
        if stored:
            watched = self._watched
            if watched is None:
                self.cache_version += 1
            else:
                for i in stored:
                    if hashes[num_cached_blocks + i] in watched:
                        self.cache_version += 1
                        break
        # An event also when every new block was null or masked out, as vLLM sends it; none
        # for a call that only repeats what is cached.
        events = self.events
        if events is not None and num_already_cached < len(new_blocks):
            events.stored(request, hashes, num_cached_blocks, len(new_blocks), block_size,
                          group_id, stored)

    def _drop_partial_primary(self, block: KVCacheBlock, group_id: int) -> None:
        """``block``'s hash is a partial prompt-tail entry and the block is now full: drop the
        entry (and any extra keys) so the full hash replaces it, as vLLM promotes it."""
        removed = self._maps.drop_keys(block)
        self._changed(removed)
        if self.events is not None:
            for h in removed:
                self.events.removed(h, group_id)

    def report_cached_blocks(self, request: KVRequest, num_blocks: int, block_size: int,
                             group_id: int, block_hashes: Sequence[BlockHash]) -> None:
        """Record one ``BlockStored`` for the request's first ``num_blocks`` blocks of group
        ``group_id``, already cached (a prefix hit), changing no block: vLLM's
        ``kv_cache_report_mode="full"``, so routers learn who reuses a prefix.  ``block_hashes``
        are the request's hashes at ``block_size``."""
        if not 0 <= group_id < self.num_groups:
            raise InvalidGroupError(f"group id {group_id} out of range [0, {self.num_groups})")
        n = check_count("num_blocks", num_blocks)
        if n > len(block_hashes):
            raise InvalidArgumentError(f"num_blocks={n} exceeds the {len(block_hashes)} block "
                                       "hashes given")
        if self.events is not None and n > 0:
            self.events.stored(request, block_hashes, 0, n, block_size, group_id, range(n))

    def _evict(self, block: KVCacheBlock) -> None:
        """Remove every key of ``block`` from its group's map (the block itself stays where it
        is): its hash, and any partial entries it also carries."""
        g = block.group_id
        maps = self._maps
        if maps.secondary or maps.partial_primary:
            removed = maps.drop_keys(block)
        else:  # the common case, inlined (lazy eviction runs for every reused cached block)
            h = block.block_hash
            assert h is not None
            cached = maps.cached[g]
            if cached.get(h) is block and h not in maps.dups[g]:
                del cached[h]
            else:
                maps.unmap(g, h, block)
            block.block_hash = None
            block.group_id = -1
            block.prefix_node = None
            removed = [h]
        watched = self._watched
        if watched is None or not watched.isdisjoint(removed):
            self.cache_version += 1
        self.num_evicted_blocks += 1
        if self.events is not None:
            for h in removed:
                self.events.removed(h, g)

    def cache_partial_block(self, request: KVRequest, block: KVCacheBlock, num_tokens: int,
                            hash_block_size: int, group_id: int, *,
                            replace_existing_hashes: object = False) -> BlockHash | None:
        """Register ``block`` under the request's hash at ``num_tokens`` (a multiple of the hash
        block size inside the block): a *partial* prefix-cache entry, as vLLM registers the
        prompt's last hash boundary when a full-attention block is larger than the hash block.

        The entry becomes the block's hash if it has none (the block is then cached: freed to
        the tail, evicted with a ``BlockRemoved``), otherwise an extra key evicted with it; a
        later ``cache_full_blocks`` of the filled block replaces it.  No lookup finds a partial
        entry through a full block's hash (it is a different prefix length): it exists so that
        KV events, eviction order and free-queue placement match vLLM's.  Emits ``BlockStored``
        (``block_size`` = the hash block size) when the entry is new.

        ``replace_existing_hashes`` (vLLM's flag of that name: the block's content was
        replaced) first drops every entry the block carries (a ``BlockRemoved`` each), then
        registers this one as its hash, with a ``BlockStored`` even if it was there before.
        Returns the entry's key (also when it was already there); ``None`` for the null block
        or with caching off (``replace_existing_hashes`` is typed ``object``: the compiled build
        would refuse a non-bool with its own ``TypeError`` before the typed error).
        """
        replace = check_flag("replace_existing_hashes", replace_existing_hashes)
        if not self.enable_caching or block.is_null:
            return None
        idx = self._check_partial(request, block, num_tokens, hash_block_size, group_id)
        key = request.block_hashes[idx - 1]
        dropped: list[BlockHash] = []
        if replace and block.block_hash is not None:
            dropped = self._maps.drop_keys(block)
            self.num_invalidations += 1
        removed = self._maps.add_partial(block, key, num_tokens, group_id)
        if removed is not None:
            removed = dropped + removed
            self._changed((key, *removed))
        events = self.events
        if removed is None or events is None:
            return key
        for h in removed:
            events.removed(h, group_id)
        events.stored(request, request.block_hashes, idx - 1, 1, hash_block_size, group_id, (0,))
        return key

    def has_partial_primary(self, block: KVCacheBlock) -> bool:
        """Whether ``block``'s hash is a partial prompt-tail entry (``cache_partial_block``)."""
        return block.block_id in self._maps.partial_primary

    def partial_primary_tokens(self, block: KVCacheBlock) -> int | None:
        """How many prefix tokens ``block``'s partial prompt-tail entry covers (``None``: its
        hash, if any, covers the whole block)."""
        return self._maps.partial_primary.get(block.block_id)

    def secondary_keys(self, block: KVCacheBlock) -> tuple[BlockHash, ...]:
        """The partial entries ``block`` carries besides its hash."""
        return tuple(self._maps.secondary.get(block.block_id, ()))

    def move_block_hashes(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Re-point every prefix-cache entry of ``src`` (its hash, a partial entry's token count,
        its extra partial keys, its prefix node) to the unhashed ``dst``, as vLLM's
        ``BlockPool.move_block_hashes``: for a request that keeps writing into ``src`` while a
        copy of it (``dst``, filled by a block copy before that write) takes its place in the
        cache.  The entries stay live: no KV events; lookups of these keys now find ``dst`` (after
        any duplicate cached earlier, which a removed first entry promotes).  ``src`` without a
        hash moves nothing.  Raises :class:`BlockStateError` (changing nothing) for a block not
        of this pool, ``dst`` is ``src`` or a hashed ``dst``; :class:`NullBlockError` for the
        null block.
        """
        self._check_owned([src, dst], "move_block_hashes")
        if src.is_null or dst.is_null:
            raise NullBlockError("move_block_hashes: the null block carries no cache entries")
        if dst is src:
            raise BlockStateError(f"move_block_hashes: block {src.block_id} onto itself")
        if dst.block_hash is not None:
            raise BlockStateError(f"move_block_hashes: destination block {dst.block_id} is "
                                  "already cached")
        if src.block_hash is None or not self.enable_caching:
            return
        maps = self._maps
        g = src.group_id
        node = src.prefix_node
        covered = maps.partial_primary.get(src.block_id)
        keys = maps.drop_keys(src)  # primary first, then the extra keys in their order
        # src keeps being written: a lookup that found it must not be trusted from here on
        self.num_invalidations += 1
        dst.block_hash = keys[0]
        dst.group_id = g
        dst.prefix_node = node
        maps.map(g, keys[0], dst)
        if covered is not None:
            maps.partial_primary[dst.block_id] = covered
        if len(keys) > 1:
            maps.secondary[dst.block_id] = list(keys[1:])
            for key in keys[1:]:
                maps.map(g, key, dst)
        self._changed(keys)

    def evict_blocks(self, block_ids: Iterable[SupportsIndex]) -> None:
        """Drop the listed blocks from the prefix cache (their reference counts are unchanged).

        Unhashed blocks are ignored (the observer is told of every id); an out-of-range id or
        the null block raises before anything changes.
        """
        ids: list[int] = []
        for block_id in check_collection("evict_blocks' block_ids", block_ids):
            if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
                raise InvalidArgumentError(f"block id {block_id!r} out of range [0, {self.num_blocks})")
            if block_id == self.null_block.block_id:
                raise NullBlockError("the null block is never cached, cannot evict it")
            ids.append(block_id)
        observer = self._observer
        reserved = self._hint_reserve.held
        for block_id in ids:
            block = self.blocks[block_id]
            if observer is not None:  # every id listed, cached or not, as vLLM reports them
                observer.on_block_evicted(block)
            if block.block_hash is not None:
                self.policy.on_evict((block,))
                self._evict(block)
                if block_id in reserved:  # no longer serves a prefix: back to the policy
                    self._hint_reserve.unhold(block)
                    self.policy.on_free((block,), ())
                elif block.ref_cnt == 0:
                    self.policy.on_uncache(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash.  Refuses (returns ``False``, changes nothing) while any
        non-null block is in use; emits ``AllBlocksCleared`` on success."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.set_hints([() for _ in range(self.num_groups)])
        self.policy.reset()
        self._maps.clear()
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
            block.prefix_node = None
        self.num_resets += 1
        self.num_invalidations += 1
        self.cache_version += 1
        if self._observer is not None:
            self._observer.reset()
        if self.events is not None:
            self.events.cleared()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return the events recorded since the last call, and forget them."""
        return self.events.take() if self.events is not None else []

    # -- input checks: each raises kvcore's typed error naming the bad value before anything
    # changes; the managers' calls with blocks they hold skip them.

    def _check_owned(self, blocks: Sequence[object], op: str) -> None:
        """Raise :class:`BlockStateError` if any block is not one of this pool's."""
        mine = self.blocks
        n = len(mine)
        for block in blocks:
            if type(block) is not KVCacheBlock and not isinstance(block, KVCacheBlock):
                raise BlockStateError(f"{op}: {block!r} is not a KV-cache block")
            bid = block.block_id
            if not 0 <= bid < n or mine[bid] is not block:
                raise BlockStateError(f"{op}: {block!r} is not a block of this pool")

    def _check_takeable(self, blocks: Sequence[KVCacheBlock], op: str) -> None:
        """Check that each block is one of this pool's and, if free, on the free side (what
        ``touch`` and ``pin`` take a reference on); raises :class:`BlockStateError`
        otherwise."""
        self._check_owned(blocks, op)
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null and block.prev_free is None:
                raise BlockStateError(f"{op}: block {block.block_id} has ref_cnt 0 but is not "
                                      "in the free queue")

    def _blocks_to_cache(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash],
                         num_cached_blocks: int, num_full_blocks: int, group_id: int,
                         block_mask: Sequence[bool] | None,
                         prefix_nodes: Sequence[PrefixNode] | None) -> Sequence[KVCacheBlock]:
        """Validate a ``cache_full_blocks`` call and return the blocks it covers (empty when there
        are none); raises, before anything changes, if any argument or block is unfit."""
        if not 0 <= group_id < self.num_groups:
            raise InvalidGroupError(f"group id {group_id} out of range [0, {self.num_groups})")
        if (type(num_cached_blocks) is not int or type(num_full_blocks) is not int
                or num_cached_blocks < 0 or num_full_blocks < 0):  # checks off the common path
            check_count("num_cached_blocks", num_cached_blocks)
            check_count("num_full_blocks", num_full_blocks)
        if num_full_blocks > len(blocks) or num_full_blocks > len(hashes):
            raise InvalidArgumentError(
                f"num_full_blocks={num_full_blocks} exceeds the request's {len(blocks)} blocks "
                f"or {len(hashes)} block hashes")
        if num_cached_blocks >= num_full_blocks:
            return ()
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        if block_mask is not None and len(block_mask) != len(new_blocks):
            raise InvalidArgumentError(
                f"block_mask has {len(block_mask)} entries for {len(new_blocks)} new blocks")
        if self.verify_hits and (prefix_nodes is None or len(prefix_nodes) < num_full_blocks):
            raise InvalidArgumentError(
                "a pool that verifies hits needs the prefix node of every block it caches")
        mine = self.blocks
        try:
            for i, block in enumerate(new_blocks):
                if block.is_null or (block_mask is not None and not block_mask[i]):
                    continue
                if mine[block.block_id] is not block:
                    self._check_owned([block], "cache_full_blocks")  # raises, naming it
                if block.ref_cnt <= 0:
                    raise BlockStateError(
                        f"block {block.block_id} is free; only blocks in use can be cached")
                if (block.block_hash is not None
                        and block.block_id not in self._maps.partial_primary):
                    if block.group_id != group_id:
                        raise InvalidGroupError(
                            f"block {block.block_id} is cached in group {block.group_id}, "
                            f"cannot cache it in group {group_id}")
                    if block.block_hash != hashes[num_cached_blocks + i]:
                        raise BlockStateError(
                            f"block {block.block_id} is already cached under another hash")
        except (AttributeError, IndexError, TypeError):  # not a block, or an id out of range
            self._check_owned(new_blocks, "cache_full_blocks")  # raises, naming it
            raise
        return new_blocks

    def _check_partial(self, request: KVRequest, block: KVCacheBlock, num_tokens: int,
                       hash_block_size: int, group_id: int) -> int:
        """Raise unless ``cache_partial_block`` may register this entry; returns the index (1-based)
        of its hash among the request's."""
        if not 0 <= group_id < self.num_groups:
            raise InvalidGroupError(f"group id {group_id} out of range [0, {self.num_groups})")
        self._check_owned([block], "cache_partial_block")
        check_count("hash_block_size", hash_block_size)
        idx = check_count("num_tokens", num_tokens) // max(hash_block_size, 1)
        if not hash_block_size or num_tokens % hash_block_size or not 0 < idx <= len(
                request.block_hashes):
            raise InvalidArgumentError(
                f"num_tokens={num_tokens} must be a positive multiple of hash_block_size="
                f"{hash_block_size} within the request's {len(request.block_hashes)} hashes")
        if block.ref_cnt <= 0:
            raise BlockStateError(f"block {block.block_id} is free; only blocks in use can be "
                                  "cached")
        return idx
