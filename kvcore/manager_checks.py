"""Validation of the KV-cache manager's inputs, apart from what it does with them.

:class:`ManagerChecks` is the base class of :class:`~kvcore.manager.KVCacheManager`: every
check that a scheduler's call is one the manager may serve in its current state (a request's
identity and computed tokens, counts, hit blocks still cached under the request's hashes, verify
mode's proof), each raising kvcore's typed error naming the value before anything changes.  The
manager calls them off its fast path only (see ``allocate_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from kvcore._mypyc import mypyc_attr
from kvcore.block_pool import BlockPool
from kvcore.blocks import KVCacheBlock
from kvcore.cache_blocks import KVCacheBlocks, LookupHit
from kvcore.coordinator import KVCacheCoordinator
from kvcore.errors import (
    InvalidArgumentError,
    InvalidHitError,
    RequestStateError,
    StaleHitError,
    UnknownRequestError,
)
from kvcore.hashing import RequestBlockHasher, hashes_at, num_hashable_blocks
from kvcore.pool.checks import check_count
from kvcore.request import KVRequest, RequestLike
from kvcore.verify import HitVerifier


def evictions_since_lookup(hits: object, request: object, pool: BlockPool) -> int:
    """How many blocks ``pool`` evicted since ``get_computed_blocks`` found ``hits`` for
    ``request`` (a reset of its prefix cache counts as one more); 0 if none, or if ``hits`` is
    not that lookup's result (another request's, or built by hand).  A hit with evictions since
    its own lookup that no longer holds the request's prefix went stale between lookup and
    allocation: the manager raises :class:`StaleHitError` then, and ``kvcore.testing.checked``
    leaves that error as it is."""
    lookup = getattr(hits, "lookup", None) if isinstance(hits, LookupHit) else None
    if lookup is None or lookup[0] is not request:
        return 0
    return pool.num_evicted_blocks - lookup[2] + (pool.num_resets != lookup[3])


def check_counts(num_new_tokens: object, num_new_computed_tokens: object, num_lookahead_tokens: object,
            num_external_computed_tokens: object,
            num_encoder_tokens: object) -> tuple[int, int, int, int, int]:
    """``allocate_slots``'s token counts as plain ints (see ``check_count``)."""
    # (type(x): one pointer comparison in the compiled build, where x.__class__ is an attribute
    # lookup.)
    if (type(num_new_tokens) is int and num_new_tokens >= 0
            and type(num_new_computed_tokens) is int and num_new_computed_tokens >= 0
            and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0
            and type(num_external_computed_tokens) is int and num_external_computed_tokens >= 0
            and type(num_encoder_tokens) is int and num_encoder_tokens >= 0):
        return (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                num_external_computed_tokens, num_encoder_tokens)  # plain ints: nothing to do
    return (check_count("num_new_tokens", num_new_tokens),
            check_count("num_new_computed_tokens", num_new_computed_tokens),
            check_count("num_lookahead_tokens", num_lookahead_tokens),
            check_count("num_external_computed_tokens", num_external_computed_tokens),
            check_count("num_encoder_tokens", num_encoder_tokens))


@mypyc_attr(allow_interpreted_subclasses=True)
class ManagerChecks:
    """The manager's state the checks read (set by ``KVCacheManager.__init__``) and the checks."""

    __slots__ = ()

    pool: BlockPool
    coordinator: KVCacheCoordinator
    block_hasher: RequestBlockHasher
    enable_caching: bool
    verify_hits: bool
    hash_block_size: int
    num_hash_lookahead_tokens: int
    num_groups: int
    max_model_len: int
    # request id -> [request, num_slots] (see KVCacheManager.__init__)
    _requests: dict[str, list[Any]]
    _empty: KVCacheBlocks

    def _sync_hashes(self, request: RequestLike) -> None:
        # Requests built without this manager's hasher get their missing hashes here.
        hashes = request.block_hashes
        if len(hashes) < num_hashable_blocks(len(request.all_token_ids), self.hash_block_size,
                                             self.num_hash_lookahead_tokens):
            hashes.extend(self.block_hasher(request))

    def _check_allocation(self, request: RequestLike, num_new_tokens: int,
                          num_new_computed_tokens: int, new_computed_blocks: object,
                          num_external_computed_tokens: int) -> Sequence[Sequence[KVCacheBlock]]:
        """Raise unless ``allocate_slots`` may serve these (non-negative) counts for ``request``
        in its current state; returns the hit blocks per group."""
        rid = request.request_id
        running = rid in self._requests
        if running or request.num_computed_tokens:
            self._check_request(request)  # raises for a stranger, a freed or overrun request
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidArgumentError("allocate_slots needs new tokens or computed tokens to adopt")
        hits = self._empty if new_computed_blocks is None else new_computed_blocks
        if not isinstance(hits, (tuple, list)) or len(hits) != self.num_groups:
            raise InvalidArgumentError(
                f"new_computed_blocks must hold one block list per group ({self.num_groups}), "
                f"got {new_computed_blocks!r}")
        has_hits = any(hits)
        if running:
            if has_hits or num_new_computed_tokens:
                raise RequestStateError(f"request {rid!r} is running: it cannot take a new "
                                        "prefix hit")
            return hits
        if num_new_computed_tokens + num_external_computed_tokens > request.num_tokens:
            raise InvalidHitError(
                f"request {rid!r}: {num_new_computed_tokens} hit + {num_external_computed_tokens} "
                f"external tokens exceed its {request.num_tokens} tokens")
        if has_hits or num_new_computed_tokens:
            look = hits.lookup if type(hits) is LookupHit else None
            pool = self.pool
            if (look is None or look[0] is not request or look[1] != num_new_computed_tokens
                    or look[2] != pool.num_evicted_blocks or look[3] != pool.num_resets):
                self._check_hits(request, hits, num_new_computed_tokens,
                                 num_external_computed_tokens)
        return hits

    def _check_request(self, request: RequestLike) -> bool:
        """Whether ``request`` is running; raises if another object holds its id, if it claims
        tokens computed beyond its slots, or if it is not running but claims computed tokens
        (freed, finished, or never admitted)."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None:
            if request.num_computed_tokens:
                raise RequestStateError(
                    f"request {rid!r} has num_computed_tokens={request.num_computed_tokens} but "
                    "holds no blocks: it was freed (finished, or preempted without resetting "
                    "num_computed_tokens to 0) or never admitted")
            return False
        if tracked[0] is not request:
            raise RequestStateError(f"request id {rid!r} is already used by another live request")
        slots = tracked[1]
        if request.num_computed_tokens > slots:
            raise RequestStateError(
                f"request {rid!r} has num_computed_tokens={request.num_computed_tokens} but slots "
                f"for only {slots} tokens: tokens without a slot were never computed")
        return True

    def _check_hits(self, request: KVRequest, hits: Sequence[Sequence[KVCacheBlock]],
                    num_hit_tokens: int, num_external_tokens: int) -> None:
        """Raise :class:`InvalidHitError` unless ``hits`` is a prefix hit of ``num_hit_tokens``
        tokens that this manager could serve the request now: in every group, one block per
        ``block_size`` hit tokens (a state group may hold fewer when external tokens follow:
        their load brings the state), each one of this pool's blocks still cached under the
        request's hash at its position (and, in verify mode, proven to hold the request's own
        prefix), and the null block only where the next token reads no KV."""
        rid = request.request_id
        if not self.enable_caching:
            raise InvalidHitError(f"request {rid!r}: prefix caching is disabled, so "
                                  f"new_computed_blocks / num_new_computed_tokens must be empty")
        self._sync_hashes(request)
        mine = self.pool.blocks
        null = self.pool.null_block
        total_computed = num_hit_tokens + num_external_tokens
        for g, (m, blocks) in enumerate(zip(self.coordinator.managers, hits)):
            bs = m.block_size
            if not m.enable_caching:
                if blocks:
                    raise InvalidHitError(f"request {rid!r}: group {g} is never cached, but "
                                          f"new_computed_blocks holds {len(blocks)} blocks for it")
                continue
            if len(blocks) * bs != num_hit_tokens and not (
                    # A recurrent state's hit may stop short when a KV connector supplies the
                    # state at the end of the computed tokens (vLLM: a connector that refills
                    # Mamba state behind a deeper full-attention hit).
                    m.spec.holds_state and num_external_tokens
                    and len(blocks) * bs < num_hit_tokens):
                raise InvalidHitError(
                    f"request {rid!r}: num_new_computed_tokens={num_hit_tokens} but group {g} "
                    f"has {len(blocks)} hit blocks of {bs} tokens")
            needed_from = m.get_num_skipped_tokens(total_computed) // bs
            hashes = hashes_at(request.block_hashes, self.hash_block_size, bs)
            i = 0
            try:  # the common case in one tight pass; _bad_hit explains a failure
                for i, block in enumerate(blocks):
                    if block is null:
                        if i < needed_from:
                            continue
                    elif (block.block_hash == hashes[i] and block.group_id == g
                          and mine[block.block_id] is block):
                        continue
                    self._bad_hit(request, hits, g, i, block, needed_from, hashes)
            except (AttributeError, IndexError, TypeError):
                self._bad_hit(request, hits, g, i, blocks[i], needed_from, hashes)
        if self.verify_hits:
            verifier = HitVerifier(request, self.num_hash_lookahead_tokens)
            for g, (m, blocks) in enumerate(zip(self.coordinator.managers, hits)):
                for i, block in enumerate(blocks):
                    if not block.is_null and not verifier.matches(block.prefix_node, i,
                                                                  m.block_size):
                        raise InvalidHitError(
                            f"request {rid!r}: block {block.block_id} at group {g} position "
                            f"{i} holds KV of another prefix")

    def _bad_hit(self, request: KVRequest, hits: Sequence[Sequence[KVCacheBlock]], g: int,
                 i: int, block: object, needed_from: int, hashes: Sequence[object]) -> NoReturn:
        """Raise the :class:`InvalidHitError` that says why ``block`` cannot be hit ``i`` of
        group ``g`` (:class:`StaleHitError` when the request's own lookup found it and it was
        evicted since)."""
        mine = self.pool.blocks
        rid = request.request_id
        where = f"request {rid!r}: group {g} position {i}"
        if block is self.pool.null_block:
            raise InvalidHitError(f"{where} of the hit is the null block, but the next token "
                                  "attends to it")
        if (not isinstance(block, KVCacheBlock) or not 0 <= block.block_id < len(mine)
                or mine[block.block_id] is not block):
            raise InvalidHitError(f"{where}: {block!r} is not a block of this manager's pool")
        other = block.block_hash is not None and (i >= len(hashes) or block.block_hash != hashes[i]
                                                  or block.group_id != g)
        evicted = evictions_since_lookup(hits, request, self.pool)
        if evicted:
            now = ("is cached for a different prefix now" if other else
                   "is no longer cached")
            raise StaleHitError(
                f"{where}: block {block.block_id} {now}: the hit went stale between lookup and "
                "allocation (get_computed_blocks found it for this request, then the pool "
                "evicted it, e.g. for other allocations; allocate right after the lookup, or "
                "look the request up again)")
        if other:
            raise InvalidHitError(f"{where}: block {block.block_id} is cached for a different "
                                  "prefix (the hit blocks belong to another prefix, or the "
                                  "block was reused for one since get_computed_blocks)")
        raise InvalidHitError(f"{where}: block {block.block_id} is no longer cached under the "
                              "request's hash (evicted or reused since get_computed_blocks)")

    def _too_long(self, request: KVRequest, num_computed: int, num_new: int) -> None:
        raise InvalidArgumentError(
            f"request {request.request_id!r}: {num_computed} computed + {num_new} new tokens "
            f"exceed max_model_len={self.max_model_len}")

    def _known(self, request_id: str) -> None:
        if request_id not in self._requests:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks")

    def _tracked(self, request: KVRequest) -> list[Any]:
        """The record of ``request``, which must be the object holding blocks under its id."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None:
            raise UnknownRequestError(f"request {rid!r} holds no blocks (never allocated, or "
                                      "already freed)")
        if tracked[0] is not request:
            raise RequestStateError(f"request id {rid!r} is held by another request object")
        return tracked

    def _check_slots(self, tracked: list[Any], num_tokens: int) -> None:
        if num_tokens > tracked[1]:
            raise RequestStateError(
                f"request {tracked[0].request_id!r} has slots for {tracked[1]} tokens, not "
                f"{num_tokens}")
