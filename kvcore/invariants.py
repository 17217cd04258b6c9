"""Structural invariants of the block pool (DESIGN.md, "Invariants").

``check_invariants(pool, owners)`` walks the whole pool and raises :class:`InvariantError` naming
the first broken rule, the block and the observed values:

``block-id``        ``pool.blocks[i].block_id == i`` and block 0 is the null block
``null-block``      the null block is never queued, hashed, mapped or referenced
``queue-links``     every free list (the policy's segments, the hint reserve) is a proper
                    doubly linked list from head to tail sentinel
``queue-foreign``   every queued block is one of this pool's blocks
``queue-cycle``     walking the queue never revisits a block (a cycle normally trips
                    ``queue-links`` first: a revisited block cannot match both predecessors)
``queue-length``    each list's cached length, and the policy's count, equal the linked blocks
``policy``          the eviction policy's own invariants (``EvictionPolicy.check``: segment
                    table, segment caps, uncached blocks only in the clean segment, ghost size)
``hint-reserve``    every reserved block caches a declared hash, as the block a lookup would hit
``block-state``     every other block is either queued with ref_cnt 0 or unlinked with ref_cnt > 0
``ref-count``       with ``owners``: ref_cnt == number of references from all owners' block lists
``map-entry``       every map entry's block carries exactly that hash and group
``hashed-unmapped`` every hashed block is in its group's map (exactly once)
``caching-off``     with caching disabled no block carries a hash
``prefix-node``     prefix nodes only on hashed blocks (and on all of them when verifying hits)

It is O(num_blocks + map size): cheap enough to call after every step of a property test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

from kvcore import _moved
from kvcore.block_pool import BlockPool
from kvcore.coordinator import KVCacheCoordinator
from kvcore.errors import InvariantError
from kvcore.eviction.base import FreeList
from kvcore.hashing import hashes_at
from kvcore.types import KVCacheBlock, KVRequest
from kvcore.verify import HitVerifier


class ManagerState(Protocol):
    """What :func:`check_manager_invariants` reads of a manager
    (:class:`~kvcore.manager.KVCacheManager`)."""

    pool: BlockPool
    coordinator: KVCacheCoordinator
    hash_block_size: int
    num_hash_lookahead_tokens: int
    max_model_len: int

    def requests(self) -> dict[str, KVRequest]: ...

    def withheld_blocks(self) -> dict[int, int]: ...

    def held_free_blocks(self) -> list[KVCacheBlock]: ...

OwnerBlocks = Iterable[KVCacheBlock] | Iterable[Iterable[KVCacheBlock]]
"""What one owner holds references on: a block list, or one per group (a request's table)."""

# Its former name, served one release with a DeprecationWarning.
__getattr__ = _moved.former_names("kvcore.invariants",
                                  {"BlockLists": "kvcore.invariants:OwnerBlocks"})


def _fail(rule: str, message: str, block: KVCacheBlock | None = None,
          observed: object = None) -> InvariantError:
    return InvariantError(rule, message, block_id=None if block is None else block.block_id,
                          observed=observed)


def _count_references(pool: BlockPool, owners: Mapping[object, OwnerBlocks]) -> Counter[int]:
    refs: Counter[int] = Counter()
    blocks = pool.blocks
    for owner, lists in owners.items():
        for item in lists:
            group = (item,) if isinstance(item, KVCacheBlock) else item
            for block in group:
                if block.is_null:
                    continue
                bid = block.block_id
                if not (0 <= bid < len(blocks)) or blocks[bid] is not block:
                    raise _fail("ref-count", f"owner {owner!r} holds a block that is not this "
                                f"pool's", block, observed=bid)
                refs[bid] += 1
    return refs


def _check_free_side(pool: BlockPool) -> set[int]:
    """Every list of the policy and the hint reserve; returns the ids of all linked blocks."""
    seen: set[int] = set()
    policy = pool.policy
    for queue in policy.queues():
        _check_queue(pool, queue, seen)
    linked_in_policy = len(seen)
    if len(policy) != linked_in_policy:
        raise _fail("queue-length", f"the {policy.name} policy counts {len(policy)} free blocks "
                    f"but {linked_in_policy} are linked in its lists",
                    observed=(len(policy), linked_in_policy))
    for problem in policy.check():
        raise _fail("policy", f"{policy.name}: {problem}")
    reserve = _check_queue(pool, pool.reserve, seen)
    hints = pool.hints
    for bid in reserve:
        block = pool.blocks[bid]
        g = block.group_id
        if (block.block_hash is None or block.block_hash not in hints[g]
                or pool.cached_blocks_map(g).get(block.block_hash) is not block):
            raise _fail("hint-reserve", "a reserved block does not cache a declared hash "
                        "(as the block a lookup would hit)", block)
    if reserve != pool._hint_reserve.held:
        raise _fail("hint-reserve", "the reserve's id set differs from its list",
                    observed=sorted(reserve ^ pool._hint_reserve.held))
    return seen


def _check_queue(pool: BlockPool, queue: FreeList, seen: set[int]) -> set[int]:
    """One intrusive list: links, ownership, no block twice (across all lists: ``seen``) and its
    cached length; returns the ids it links."""
    mine: set[int] = set()
    head, tail = queue.head, queue.tail
    if head.prev_free is not None or tail.next_free is not None:
        raise _fail("queue-links", "a sentinel has an outer link")
    blocks = pool.blocks
    prev = head
    node = head.next_free
    while node is not tail:
        if node is None:
            raise _fail("queue-links", "the chain from the head sentinel ends before the tail",
                        prev if prev is not head else None)
        if node.prev_free is not prev:
            got = node.prev_free.block_id if node.prev_free is not None else None
            raise _fail("queue-links", f"prev_free is {got}, expected "
                        f"{prev.block_id if prev is not head else 'head'}", node,
                        observed=got)
        bid = node.block_id
        if not (0 <= bid < len(blocks)) or blocks[bid] is not node:
            raise _fail("queue-foreign", "the queue holds a block that is not this pool's", node)
        if bid in seen:
            raise _fail("queue-cycle", "the free lists visit this block twice", node)
        seen.add(bid)
        mine.add(bid)
        prev = node
        node = node.next_free
    if tail.prev_free is not prev:
        raise _fail("queue-links", "the tail sentinel's prev_free is not the last block", prev)
    if len(queue) != len(mine):
        raise _fail("queue-length", f"len(queue) is {len(queue)} but {len(mine)} blocks are "
                    "linked", observed=(len(queue), len(mine)))
    return mine


def _check_maps(pool: BlockPool) -> None:
    mapped: Counter[int] = Counter()
    for g in range(pool.num_groups):
        for h, block in pool.iter_cached(g):
            if block.is_null:
                raise _fail("null-block", f"the null block is in group {g}'s map", block)
            if (block.block_hash != h and h not in pool.secondary_keys(block)) \
                    or block.group_id != g:
                raise _fail("map-entry", f"entry (group {g}, hash {h.hex()[:12]}) points to a "
                            f"block carrying group {block.group_id}, hash "
                            f"{block.block_hash.hex()[:12] if block.block_hash else None}", block,
                            observed=(block.group_id, block.block_hash))
            mapped[block.block_id] += 1
    for block in pool.blocks:
        n = mapped.get(block.block_id, 0)
        extra = pool.secondary_keys(block)
        if block.block_hash is not None and n != 1 + len(extra):
            raise _fail("hashed-unmapped", f"hashed block appears {n} times in group "
                        f"{block.group_id}'s map (1 + {len(extra)} partial entries expected)",
                        block, observed=n)
        if block.block_hash is None and (block.group_id != -1 or extra):
            raise _fail("map-entry", f"unhashed block names group {block.group_id} or carries "
                        "partial entries", block)


def check_invariants(pool: BlockPool, owners: Mapping[object, OwnerBlocks] | None = None) -> None:
    """Raise :class:`InvariantError` if any pool invariant is broken.

    ``owners`` maps each owner (e.g. a request id) to its block lists (one list, or one list per
    group); when given, every block's ``ref_cnt`` must equal its number of references.
    """
    blocks = pool.blocks
    for i, block in enumerate(blocks):
        if block.block_id != i:
            raise _fail("block-id", f"pool.blocks[{i}] has block_id {block.block_id}", block)
    null = pool.null_block
    if blocks[0] is not null or not null.is_null:
        raise _fail("block-id", "block 0 is not the null block", blocks[0])
    if null.prev_free is not None or null.next_free is not None:
        raise _fail("null-block", "the null block is linked into a queue", null)
    if null.block_hash is not None:
        raise _fail("null-block", "the null block carries a hash", null)
    if null.ref_cnt != 0:
        raise _fail("null-block", f"the null block's ref_cnt is {null.ref_cnt}", null)

    queued = _check_free_side(pool)
    for block in blocks[1:]:
        if block.is_null:
            raise _fail("null-block", "a second block is marked null", block)
        linked = block.prev_free is not None or block.next_free is not None
        if block.block_id in queued:
            if block.ref_cnt != 0:
                raise _fail("block-state", f"block is in the free queue with ref_cnt "
                            f"{block.ref_cnt}", block, observed=block.ref_cnt)
        elif linked:
            raise _fail("block-state", "block has free-queue links but is not reachable from "
                        "the queue", block)
        elif block.ref_cnt <= 0:
            raise _fail("block-state", f"block is neither queued nor in use (ref_cnt "
                        f"{block.ref_cnt}): it leaked", block, observed=block.ref_cnt)

    if owners is not None:
        refs = _count_references(pool, owners)
        for block in blocks[1:]:
            want = refs.get(block.block_id, 0)
            if block.ref_cnt != want:
                raise _fail("ref-count", f"ref_cnt is {block.ref_cnt} but owners hold {want} "
                            "references", block, observed=(block.ref_cnt, want))

    if not pool.enable_caching:
        for block in blocks:
            if block.block_hash is not None:
                raise _fail("caching-off", "block carries a hash with caching disabled", block)
    _check_maps(pool)
    for block in blocks:
        if block.prefix_node is not None and block.block_hash is None:
            raise _fail("prefix-node", "unhashed block holds a prefix node", block)
        if (pool.verify_hits and block.block_hash is not None and block.prefix_node is None
                and not pool.has_partial_primary(block)):  # a partial entry is never a hit
            raise _fail("prefix-node", "hashed block lacks its prefix node while hits are "
                        "verified", block)


def check_manager_invariants(manager: ManagerState) -> None:
    """Pool invariants with exact ownership, plus per-request block-table rules:

    ``request-registry``  a request has blocks in some group iff the manager tracks it (and only
                          tracked requests have prefix chains or shared-prefix boundaries)
    ``withheld``          references handed out by ``pop_blocks_for_free`` or taken by
                          ``withhold`` name real blocks (the blocks ``set_num_free_blocks``
                          holds back own one reference each)
                          (and count in their ``ref_cnt``, checked with the pool's ownership)
    ``pending-copy``      each endpoint of a pending block copy (``pending_copies``) holds a
                          withheld reference for each copy it is an endpoint of
    ``partial-hit``       a copy-on-write still to make (``partial_hit_reqs``: a partial-block
                          hit's shared tail, a Mamba producer's partial prompt tail) names a
                          tracked request's real block at that position of its table, with
                          the request's cached blocks stopping before it
    ``null-placement``    null blocks only in groups whose type allows them, as a leading run
                          (anywhere for types with ``null_gaps``)
    ``block-count``       every computed token has a slot; no table exceeds max_model_len, nor
                          its type's fixed size (a circular buffer holds one block)
    ``scratch``           a scratch group (``spec.prefix_cacheable`` false: circular buffers,
                          bounded-replay windows) has nothing in the prefix cache and no block
                          of its tables carries a hash
    ``cached-count``      the cached-block watermark lies within the table and the full blocks
    ``block-hash``        a hashed block below the watermark carries the request's hash for that
                          position in this group; blocks above it carry none
    ``prefix-node``       verify mode: such a block's prefix node is exactly the request's prefix
                          up to that block (compared token by token)
    """
    coord = manager.coordinator
    requests = manager.requests()
    owners: dict[object, list[list[KVCacheBlock]]] = {}
    for g, m in enumerate(coord.managers):
        for rid in m.req_to_blocks:
            if rid not in requests:
                raise InvariantError("request-registry", f"group {g} holds blocks of untracked "
                                     f"request {rid!r}")
    for rid in requests:
        owners[rid] = [m.req_to_blocks.get(rid, []) for m in coord.managers]
    blocks = manager.pool.blocks
    for bid, n in manager.withheld_blocks().items():
        if not (0 < bid < len(blocks)) or n <= 0:
            raise InvariantError("withheld", f"withheld block {bid} with {n} references")
        owners[("withheld", bid)] = [[blocks[bid]] * n]  # references deferred frees hold
    withheld = manager.withheld_blocks()
    retained: dict[int, int] = {}
    for g, m in enumerate(coord.managers):
        entries: list[object] = list(m.pending_copies)  # anything an outside holder appended
        for pair in entries:
            ends = tuple(pair) if isinstance(pair, (tuple, list)) else ()
            if len(ends) != 2 or not all(isinstance(b, KVCacheBlock) and 0 < b.block_id < len(blocks)
                                         for b in ends):
                raise _fail("pending-copy", f"group {g}'s pending copy {pair!r} is not a "
                            "(source, destination) pair of blocks")
            for block in ends:
                bid = block.block_id
                retained[bid] = n = retained.get(bid, 0) + 1
                if n > withheld.get(bid, 0) or blocks[bid] is not block:
                    raise _fail("pending-copy", f"group {g}'s pending copy {pair!r} retains "
                                f"block {bid} {n} time(s), withheld {withheld.get(bid, 0)}",
                                block)
    for g, m in enumerate(coord.managers):
        for rid, (index, source) in m.partial_hit_reqs.items():
            table = m.req_to_blocks.get(rid, [])
            if (rid not in requests or not 0 <= index < len(table) or table[index] is not source
                    or source.is_null or m.num_cached_block.get(rid, 0) > index):
                raise _fail("partial-hit", f"request {rid!r} group {g}: the copy-on-write of "
                            f"block {source.block_id} at {index} does not match its table",
                            source)
    held = manager.held_free_blocks()
    if held:  # one reference each, taken by set_num_free_blocks
        owners["held free"] = [held]
    check_invariants(manager.pool, owners)
    if coord.prefix_chains is not None:
        stale = sorted(set(coord.prefix_chains.request_ids()) - set(requests))
        if stale:
            raise InvariantError("request-registry", f"prefix chains kept for untracked "
                                 f"requests {stale}")
    stale = sorted(set(coord.shared_prefix_boundaries) - set(requests))
    if stale:
        raise InvariantError("request-registry", f"shared-prefix boundaries kept for untracked "
                             f"requests {stale}")

    for g, m in enumerate(coord.managers):
        if not m.spec.prefix_cacheable:
            for _h, block in manager.pool.iter_cached(g):
                raise InvariantError("scratch", f"scratch group {g} ({type(m.spec).__name__}) "
                                     "has a block in the prefix cache", block_id=block.block_id)
    hbs = manager.hash_block_size
    verify = manager.pool.verify_hits
    for rid, request in requests.items():
        verifier = HitVerifier(request, manager.num_hash_lookahead_tokens) if verify else None
        for g, m in enumerate(coord.managers):
            blocks = m.req_to_blocks.get(rid, [])
            bs = m.block_size
            seen_real = False
            for i, block in enumerate(blocks):
                if block.is_null:
                    if not m.allows_null_blocks:
                        raise InvariantError("null-placement", f"request {rid!r} has the null block "
                                             f"at {i} in group {g} ({type(m).__name__})", block_id=0)
                    if seen_real and not m.null_gaps:
                        raise InvariantError("null-placement", f"request {rid!r}: null block at {i} "
                                             f"after real blocks in group {g}", block_id=0)
                else:
                    seen_real = True
            if m.spec.cacheable:
                needed = -(-request.num_computed_tokens // bs)
                if len(blocks) < needed:
                    raise InvariantError("block-count", f"request {rid!r} has {len(blocks)} blocks "
                                         f"in group {g} for {request.num_computed_tokens} computed "
                                         "tokens", observed=(len(blocks), needed))
                if len(blocks) > -(-manager.max_model_len // bs) + m.num_speculative_blocks:
                    raise InvariantError("block-count", f"request {rid!r} has {len(blocks)} blocks "
                                         f"in group {g}, more than max_model_len allows")
            cap = m.max_table_blocks
            if cap is not None and len(blocks) > cap:
                raise InvariantError("block-count", f"request {rid!r} has {len(blocks)} blocks "
                                     f"in group {g} ({type(m).__name__}), which holds at most "
                                     f"{cap}", observed=len(blocks))
            if not m.spec.prefix_cacheable:
                for block in blocks:
                    if block.block_hash is not None:
                        raise InvariantError("scratch", f"request {rid!r}: a block of scratch "
                                             f"group {g} carries a hash",
                                             block_id=block.block_id)
            num_cached = m.num_cached_block.get(rid, 0)
            if num_cached > len(blocks) or num_cached * bs > request.num_tokens:
                raise InvariantError("cached-count", f"request {rid!r} group {g}: {num_cached} cached "
                                     f"blocks of {len(blocks)} for {request.num_tokens} tokens",
                                     observed=num_cached)
            hashes = hashes_at(request.block_hashes, hbs, bs)
            for i, block in enumerate(blocks):
                if block.is_null or block.block_hash is None or manager.pool.has_partial_primary(
                        block):
                    continue
                if i >= num_cached:
                    raise InvariantError("block-hash", f"request {rid!r} group {g}: block at {i} is "
                                         f"hashed above the watermark {num_cached}",
                                         block_id=block.block_id)
                if i >= len(hashes) or block.block_hash != hashes[i] or block.group_id != g:
                    raise InvariantError("block-hash", f"request {rid!r} group {g}: block at {i} "
                                         "carries a hash that is not the request's",
                                         block_id=block.block_id,
                                         observed=(block.group_id, block.block_hash))
                if verifier is not None and not verifier.matches(block.prefix_node, i, bs):
                    raise InvariantError("prefix-node", f"request {rid!r} group {g}: block at "
                                         f"{i} is cached for another prefix",
                                         block_id=block.block_id)
