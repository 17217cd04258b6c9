"""``KVCoreRadixCache``: SGLang 0.5.23's prefix cache (``BasePrefixCache``) over a kvcore
:class:`~kvcore.block_pool.BlockPool`.

Pages are kvcore blocks: the page of KV slots ``[b * page_size, (b + 1) * page_size)`` is block
``b`` (``slot // page_size``); SGLang's reserved page 0 (slot 0, the padding slot) is kvcore's
null block.  Every usable block is in exactly one of three states, which are SGLang's:

* **outside** (``ref_cnt == 1``, no hash): free in SGLang's token allocator, or owned by a
  request's slot row and not cached.  The pool never hands these out itself: at construction the
  backend takes every block out of the eviction policy, as SGLang's allocator owns them.
* **evictable** (``ref_cnt == 0``, hashed): a cached page no request has locked.  kvcore's free
  side (the eviction policy) holds exactly these, so the policy decides what SGLang evicts.
* **protected** (``ref_cnt == lock count > 0``, hashed): a cached page on a locked path.

``insert`` caches a request's pages (outside -> evictable); ``inc_lock_ref`` / ``dec_lock_ref``
pin and unpin a path (evictable <-> protected, no recency change on the pin: SGLang's lock does
not touch its LRU clock; the unpin returns the pages to the policy's most-recent end);
``match_prefix`` and ``insert`` count as accesses (the policy records a hit on every page
found); ``evict`` takes the policy's victims and gives their slots back to SGLang's allocator
(evictable -> outside).  A finished request's last ``checkpoint`` tells a policy that learns
from releases (``learned``) its pages and its prompt and output lengths.

Pages are keyed by SGLang's storage hash chain (:mod:`~kvcore.integrations.sglang.hashing`): the
full SHA-256 digest of the page's namespace and whole prefix.  A node handle
(:class:`PageNode`) is the path of digests and blocks from the root; a lookup walks the digest
chain until the first page not cached.  kvcore's policies may evict a page whose descendants
stay cached (SGLang's tree evicts leaves only): those descendants can no longer be reached, stay
evictable until evicted, and are replaced when the same prefix is inserted again.

Events are SGLang's own: the backend feeds SGLang's ``KVCacheEventRecorder`` with the pages it
stores and removes, so ``take_events`` returns ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` batches built by SGLang's code from the same hash chains (byte-identical to
``RadixCache``'s while nothing is evicted; an eviction's ``BlockRemoved`` lists the pages this
backend evicted, in its policy's order, where ``RadixCache``'s lists whole leaf nodes).

Differences from SGLang's ``RadixCache`` (the tests measure them): eviction is per page (exactly
the pages asked for; SGLang frees whole leaf nodes, which may be more), ordered by the kvcore
policy; an unpinned page is as recent as its unlock; hit counts and ``priority`` are not kept
(kvcore's policies keep their own history).  Not implemented, and refused at start by
:mod:`~kvcore.integrations.sglang.plugin`: EAGLE bigram keys, SWA and Mamba state, HiCache and
storage tiers, KV sharding, radix and streaming sessions.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixKey

from kvcore.block_pool import BlockPool
from kvcore.errors import BlockStateError, InvalidArgumentError, InvariantError
from kvcore.eviction.base import Release
from kvcore.integrations.sglang.hashing import Namespace, event_seed, page_digest, storage_seed
from kvcore.integrations.sglang.settings import SGLangSettings
from kvcore.invariants import check_invariants
from kvcore.types import BlockHash, KVCacheBlock

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from kvcore.types import KVRequest

__all__ = ["KVCoreRadixCache", "PageNode"]


@dataclass(frozen=True, eq=False)
class PageNode:
    """A node handle: the cached path from the root to a page (``req.last_node``).

    ``digests`` are the pages' storage digests, ``block_ids`` their blocks, in path order; the
    root has none.  A handle stays valid while its pages stay cached; lock it to keep them."""

    namespace: Namespace
    digests: tuple[bytes, ...] = ()
    block_ids: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class _Page:
    """What the backend keeps of one cached page: its key, the event chain's digest, its tokens,
    its namespace, its parent's block id (0: the root), for events and hit verification, and
    when it was cached (``seq``, the order SGLang's tree keeps a node's children in)."""

    digest: bytes
    event_digest: bytes
    tokens: tuple[int, ...]
    namespace: Namespace
    parent: int
    seq: int = 0


@dataclass
class _EventNode:
    """The shape of a radix node SGLang's event recorder reads (key, parent, hash chains)."""

    key: Any
    parent: Any
    hash_value: list[str] | None
    event_hash_value: list[str] | None
    children: dict[Any, Any] = field(default_factory=dict)


class KVCoreRadixCache(BasePrefixCache):
    """SGLang's ``BasePrefixCache`` (0.5.23) whose pages are kvcore blocks, evicted by a kvcore
    policy (see the module docstring)."""

    def __init__(self, params: CacheInitParams, settings: SGLangSettings | None = None) -> None:
        if settings is None:
            settings = SGLangSettings.from_env(os.environ,
                                               sglang_policy=params.eviction_policy)
        self.settings = settings
        self.disable = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        if self.page_size < 1:
            raise InvalidArgumentError(f"page_size must be >= 1, got {params.page_size!r}")
        self.is_eagle = bool(params.is_eagle)
        allocator = self.token_to_kv_pool_allocator
        if allocator is None:
            raise InvalidArgumentError("the kvcore backend needs SGLang's token allocator")
        self.num_pages = int(allocator.size) // self.page_size
        dev = getattr(allocator, "device", "cpu")
        self.device = torch.device(dev) if isinstance(dev, (str, torch.device)) else (
            torch.device("cpu"))
        self.kv_events = KVCacheEventRecorder(
            enabled=params.enable_kv_cache_events, page_size=self.page_size,
            dynamo_format=params.dynamo_kv_event_format, lora_names=params.kv_event_lora_names)
        if params.enable_metrics:
            self.init_metrics_collector()
        self._page_offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        self.num_rejected_hits = 0
        self.num_evicted_pages = 0
        self._ops = 0
        self.reset()

    # -- state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every cached page (SGLang's flush; its allocator is cleared by the caller)."""
        self.pool = BlockPool(self.num_pages + 1, eviction_policy=self.settings.eviction_policy)
        # Every usable block starts outside (SGLang's allocator owns it): out of the policy.
        self.pool.get_new_blocks(self.num_pages)
        self._map: dict[BlockHash, KVCacheBlock] = self.pool.cached_blocks_map(0)
        self._pages: dict[int, _Page] = {}
        self._num_cached = 0  # pages cached so far: the next page's seq
        self._num_protected = 0
        self.root_node = PageNode((None, None))
        self._empty_indices = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.kv_events.record_all_cleared()

    @property
    def eviction_policy(self) -> str:
        """The kvcore policy that decides evictions."""
        return self.pool.eviction_policy

    def evictable_size(self) -> int:
        return self.pool.num_free_blocks * self.page_size

    def protected_size(self) -> int:
        return self._num_protected * self.page_size

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        return len(self._pages) * self.page_size

    def supports_prefix_sharing(self) -> bool:
        return True

    def is_root(self, node: PageNode) -> bool:
        return len(node) == 0

    def pretty_print(self) -> None:
        print(f"kvcore backend ({self.eviction_policy}): {len(self._pages)} cached pages, "
              f"{self.evictable_size()} evictable + {self.protected_size()} protected tokens")

    # -- lookups --------------------------------------------------------------------------------
    def _tokens(self, key: RadixKey) -> tuple[Namespace, array[int] | Sequence[int], int]:
        if key.is_bigram:
            raise InvalidArgumentError("the kvcore backend does not take EAGLE bigram keys")
        n = len(key) // self.page_size * self.page_size
        return (key.extra_key, key.cache_salt), key.token_ids, n

    def _walk(self, key: RadixKey) -> tuple[PageNode, list[KVCacheBlock]]:
        """The longest cached page path of ``key`` (page aligned, in its namespace)."""
        namespace, tokens, n = self._tokens(key)
        ps = self.page_size
        prior = storage_seed(namespace)
        digests: list[bytes] = []
        blocks: list[KVCacheBlock] = []
        parent = 0
        verify = self.settings.verify_hits
        for start in range(0, n, ps):
            page = tokens[start:start + ps]
            digest = page_digest(prior, page)
            block = self._map.get(BlockHash(digest))
            if block is None:
                break
            if verify:
                record = self._pages[block.block_id]
                if record.namespace != namespace or record.tokens != tuple(page):
                    self.num_rejected_hits += 1  # another prefix under this digest
                    break
                if record.parent != parent:
                    break  # cached under a parent page since evicted: an orphan, not reused
            digests.append(digest)
            blocks.append(block)
            parent = block.block_id
            prior = digest
        return PageNode(namespace, tuple(digests), tuple(b.block_id for b in blocks)), blocks

    def _access(self, blocks: list[KVCacheBlock]) -> None:
        """Record an access on a path: each page is touched (a hit for the policy) and every
        evictable one returns to the policy's recent end, deepest first (a parent outlives its
        children under ``lru``)."""
        if blocks:
            self.pool.touch(blocks, trusted=True)
            self.pool.free_blocks(blocks[::-1], trusted=True)

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached page-aligned prefix of ``params.key`` in its namespace
        (``extra_key``, ``cache_salt``); refreshes its pages' recency."""
        node, blocks = self._walk(params.key)
        self._access(blocks)
        self._tick()
        return MatchResult(device_prefix_len=len(node) * self.page_size, last_device_node=node,
                           last_host_node=node, best_match_node=node)

    def touch_prefix(self, key: RadixKey) -> None:
        _, blocks = self._walk(key)
        self._access(blocks)

    def path_device_indices(self, node: PageNode) -> torch.Tensor:
        """The KV slots of ``node``'s pages, in order."""
        if not node.block_ids:
            return self._empty_indices
        ids = torch.tensor(node.block_ids, dtype=torch.int64, device=self.device)
        return (ids[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def dfs_weight_order(self, node_handles: Sequence[Any]) -> list[int]:
        """Request indices in SGLang's dfs-weight order over the trie of the handles' pages:
        depth first, heavier subtrees (more requests) first, a node's own requests after its
        subtrees' (the root's last); equal weights in the order their first pages were cached
        (the order SGLang's tree keeps a node's children in)."""
        Key = tuple[Namespace, bytes]
        children: dict[Key | None, list[Key]] = {None: []}
        weight: dict[Key, int] = {}
        ends: dict[Key | None, list[int]] = {}
        for index, node in enumerate(node_handles):
            parent: Key | None = None
            for digest in node.digests:
                page: Key = (node.namespace, digest)
                if page not in weight:
                    weight[page] = 0
                    children.setdefault(parent, []).append(page)
                weight[page] += 1
                parent = page
            ends.setdefault(parent, []).append(index)
        order: list[int] = []
        stack: list[tuple[Key | None, bool]] = [(None, False)]
        while stack:
            at, visited = stack.pop()
            if visited:
                order.extend(ends.get(at, ()))
                continue
            stack.append((at, True))
            kids = sorted(children.get(at, ()), key=lambda k: (-weight[k], self._seq_of(k[1])))
            stack.extend((kid, False) for kid in reversed(kids))
        return order

    def _seq_of(self, digest: bytes) -> int:
        block = self._map.get(BlockHash(digest))
        return self._pages[block.block_id].seq if block is not None else self._num_cached + 1

    # -- insertion ------------------------------------------------------------------------------
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``params.value``'s pages under ``params.key`` (page aligned).  Returns the
        length already cached (the caller frees its duplicate slots there) and the node of the
        whole key.  A page of the value that is not outside (cached, or the null page) raises
        :class:`BlockStateError` before anything changes."""
        key = params.key
        if key is None:
            raise InvalidArgumentError("insert needs a key")
        namespace, tokens, n = self._tokens(key)
        ps = self.page_size
        value = params.value
        if value is None:
            raise InvalidArgumentError("the kvcore backend's insert needs the pages' KV slots")
        if len(value) < n:
            raise InvalidArgumentError(f"insert: {len(value)} slots for a key of {n} tokens")
        node, prefix = self._walk(key)
        matched = len(prefix)
        new_ids = self._new_page_ids(value, matched, n)
        digests = list(node.digests)
        prior = digests[-1] if digests else storage_seed(namespace)
        event_prior = (self._pages[prefix[-1].block_id].event_digest if prefix
                       else event_seed(namespace))
        new_pages: list[_Page] = []
        parent = prefix[-1].block_id if prefix else 0
        for i, block_id in enumerate(new_ids):
            page = tuple(tokens[(matched + i) * ps:(matched + i + 1) * ps])
            digest = page_digest(prior, page)
            event_digest = (digest if namespace == (None, None)
                            else page_digest(event_prior, page))
            new_pages.append(_Page(digest, event_digest, page, namespace, parent))
            prior, event_prior, parent = digest, event_digest, block_id
        # Everything checked: change state.  A page past the match still cached is an orphan
        # (its parent was evicted): evict it, the request's copy takes its place.
        orphans = [self._map[BlockHash(p.digest)] for p in new_pages
                   if BlockHash(p.digest) in self._map]
        if orphans:
            self._drop(orphans)
        blocks = self.pool.blocks
        new_blocks = [blocks[b] for b in new_ids]
        if new_blocks:
            new_digests = [BlockHash(p.digest) for p in new_pages]
            self.pool.cache_full_blocks(cast("KVRequest", None), new_blocks, 0, len(new_blocks),
                                        ps, 0, new_digests)
            for block, record in zip(new_blocks, new_pages):
                self._num_cached += 1
                record.seq = self._num_cached
                self._pages[block.block_id] = record
            digests.extend(p.digest for p in new_pages)
        path = prefix + new_blocks
        if prefix:
            self.pool.touch(prefix, trusted=True)
        # The new pages drop the outside reference, the prefix the one touch took: the whole
        # path is evictable unless locked, deepest first.
        self.pool.free_blocks(path[::-1], trusted=True)
        if new_pages:
            self._record_store(prefix[-1].block_id if prefix else 0, new_pages, key)
        self._tick()
        last = PageNode(namespace, tuple(digests), tuple(b.block_id for b in path))
        return InsertResult(prefix_len=matched * ps, total_len=n, last_device_node=last)

    def _new_page_ids(self, value: torch.Tensor, start: int, n: int) -> list[int]:
        """The block ids of ``value``'s pages from page ``start`` to ``n`` tokens, checked to be
        whole pages of outside blocks."""
        ps = self.page_size
        slots = value[start * ps:n].to(device="cpu", dtype=torch.int64)
        if slots.numel() == 0:
            return []
        pages = slots.view(-1, ps)
        ids = pages[:, 0] // ps
        if ps > 1 and not torch.equal(pages, ids[:, None] * ps + self._page_offsets.cpu()):
            raise InvalidArgumentError("insert: the KV slots are not whole, aligned pages")
        out: list[int] = ids.tolist()
        seen: set[int] = set()
        blocks = self.pool.blocks
        for b in out:
            if not 0 < b <= self.num_pages:
                raise BlockStateError(f"insert: page {b} is not a usable page of the pool "
                                      f"(1..{self.num_pages})")
            block = blocks[b]
            if block.block_hash is not None or block.ref_cnt != 1 or b in seen:
                raise BlockStateError(f"insert: page {b} is already cached (or listed twice); "
                                      "only a request's own pages can be inserted")
            seen.add(b)
        return out

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        """Insert the request's page-aligned KV up to ``up_to``, free its duplicate slots,
        repoint its slot row onto the cached pages, move its lock to the new node and advance
        ``cache_protected_len`` (SGLang's contract, ``BasePrefixCache.checkpoint``)."""
        token_ids = req.full_untruncated_fill_ids[:up_to]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(token_ids)]
        key = RadixKey(token_ids, req.extra_key, is_bigram=self.is_eagle,
                       cache_salt=req.cache_salt).page_aligned(self.page_size)
        values = row[:len(key)].to(dtype=torch.int64, copy=True)
        result = self.insert(InsertParams(key=key, value=values,
                                          inserted_len=req.kv.cache_inserted_len,
                                          priority=req.priority or 0))
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, len(key))
        protected = req.kv.cache_protected_len
        self.token_to_kv_pool_allocator.free_segment(row[protected:result.prefix_len],
                                                     start_pos=protected)
        node = cast(PageNode, result.last_device_node)
        new_indices = self.path_device_indices(node)
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, len(new_indices))),
                                     new_indices[protected:])
        req.kv.cache_protected_len = len(new_indices)
        if req.finished() and self.pool.policy.reads_releases:
            # The request's last checkpoint: a policy that learns from releases (``learned``)
            # hears which of its pages hold prompt and which generated tokens before they are
            # unpinned.
            self.pool.note_release([self._path_blocks(node)],
                                   Release(len(req.origin_input_ids), len(req.output_ids),
                                           (self.page_size,)), trusted=True)
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

    # -- locks ----------------------------------------------------------------------------------
    def _path_blocks(self, node: PageNode) -> list[KVCacheBlock]:
        """``node``'s blocks, checked to still cache its pages (a stale handle raises
        :class:`BlockStateError`)."""
        blocks = self.pool.blocks
        out = []
        for digest, b in zip(node.digests, node.block_ids):
            block = blocks[b]
            if block.block_hash != digest:
                raise BlockStateError(f"page {b} of this node was evicted: the node handle is "
                                      "stale (lock a node before anything can evict it)")
            out.append(block)
        return out

    def inc_lock_ref(self, node: PageNode) -> IncLockRefResult:
        blocks = self._path_blocks(node)
        newly = sum(1 for b in blocks if b.ref_cnt == 0)
        self.pool.pin(blocks)
        self._num_protected += newly
        self._tick()
        return IncLockRefResult(delta=-newly * self.page_size)

    def dec_lock_ref(self, node: PageNode,
                     params: DecLockRefParams | None = None) -> DecLockRefResult:
        blocks = self._path_blocks(node)
        for b in blocks:
            if b.ref_cnt < 1:
                raise BlockStateError(f"dec_lock_ref: page {b.block_id} is not locked")
        released = sum(1 for b in blocks if b.ref_cnt == 1)
        self.pool.free_blocks(blocks[::-1], trusted=True)
        self._num_protected -= released
        self._tick()
        return DecLockRefResult(delta=released * self.page_size)

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        """Evict the policy's victims until ``params.num_tokens`` tokens are freed (whole pages,
        no more than needed) or nothing is evictable; their slots go back to SGLang's
        allocator."""
        want = -(-max(int(params.num_tokens), 0) // self.page_size)
        n = min(want, self.pool.num_free_blocks)
        if n <= 0:
            return EvictResult()
        blocks = self.pool.get_new_blocks(n)  # each victim: hash dropped, back to ref 1
        records = [self._pages.pop(block.block_id) for block in blocks]
        self._release_slots([b.block_id for b in blocks])
        self._record_remove(records)
        self.num_evicted_pages += n
        self._tick()
        return EvictResult(num_tokens_evicted=n * self.page_size)

    def _drop(self, blocks: list[KVCacheBlock]) -> None:
        """Evict these evictable pages (orphans) now, whatever the policy says."""
        self.pool.pin(blocks)  # out of the policy, ref 1: outside again once unhashed
        self.pool.evict_blocks([b.block_id for b in blocks])
        records = [self._pages.pop(b.block_id) for b in blocks]
        self._release_slots([b.block_id for b in blocks])
        self._record_remove(records)
        self.num_evicted_pages += len(blocks)

    def _release_slots(self, block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.token_to_kv_pool_allocator.free((ids[:, None] * self.page_size
                                              + self._page_offsets).reshape(-1))

    # -- events ---------------------------------------------------------------------------------
    def _event_parent(self, parent_id: int) -> _EventNode | None:
        if parent_id == 0:
            return _EventNode(key=None, parent=None, hash_value=[], event_hash_value=[])
        record = self._pages[parent_id]
        key = RadixKey(array("q", record.tokens), record.namespace[0],
                       cache_salt=record.namespace[1])
        return _EventNode(key=key, parent=self.root_node, hash_value=[record.digest.hex()],
                          event_hash_value=[record.event_digest.hex()])

    def _record_store(self, parent_id: int, pages: list[_Page], key: RadixKey) -> None:
        if not self.kv_events.enabled:
            return
        tokens = array("q", [t for p in pages for t in p.tokens])
        node = _EventNode(key=RadixKey(tokens, key.extra_key, cache_salt=key.cache_salt),
                          parent=self._event_parent(parent_id),
                          hash_value=[p.digest.hex() for p in pages],
                          event_hash_value=[p.event_digest.hex() for p in pages])
        self.kv_events.record_store(node)

    def _record_remove(self, records: list[_Page]) -> None:
        if not self.kv_events.enabled:
            return
        for record in records:
            key = RadixKey(array("q", record.tokens), record.namespace[0],
                           cache_salt=record.namespace[1])
            self.kv_events.record_remove(_EventNode(
                key=key, parent=None, hash_value=[record.digest.hex()],
                event_hash_value=[record.event_digest.hex()]))

    # -- invariants -----------------------------------------------------------------------------
    def _tick(self) -> None:
        every = self.settings.check_invariants_every
        if every:
            self._ops += 1
            if self._ops % every == 0:
                self.sanity_check()

    def sanity_check(self) -> None:
        """Check the pool's invariants and the backend's accounting: the policy holds exactly
        the unlocked cached pages, the protected count matches the locked ones, and SGLang's
        leak check (free + evictable + protected + request-owned = total) where the allocator's
        free pages can be read.  Raises :class:`InvariantError` naming the broken rule."""
        check_invariants(self.pool)
        outside = [b for b in self.pool.blocks[1:] if b.block_hash is None and b.ref_cnt != 1]
        if outside:
            raise InvariantError("sglang-outside", f"uncached page {outside[0].block_id} has "
                                 f"ref_cnt {outside[0].ref_cnt}, not 1 (SGLang's)",
                                 block_id=outside[0].block_id)
        cached = [b for b in self.pool.blocks[1:] if b.block_hash is not None]
        if len(cached) != len(self._pages):
            raise InvariantError("sglang-pages", f"{len(cached)} cached blocks but "
                                 f"{len(self._pages)} page records")
        protected = sum(1 for b in cached if b.ref_cnt > 0)
        if protected != self._num_protected:
            raise InvariantError("sglang-protected", f"{protected} locked pages counted as "
                                 f"{self._num_protected}")
        if len(cached) - protected != self.pool.num_free_blocks:
            raise InvariantError("sglang-evictable", f"{len(cached) - protected} unlocked "
                                 f"cached pages but the policy holds {self.pool.num_free_blocks}")
        free = _free_pages(self.token_to_kv_pool_allocator)
        if free is not None:
            free_set = set(free)
            if len(free_set) != len(free):
                raise InvariantError("sglang-double-free", "SGLang's allocator lists a page "
                                     "twice")
            both = [b.block_id for b in cached if b.block_id in free_set]
            if both:
                raise InvariantError("sglang-free-and-cached", f"pages {both[:8]} are both free "
                                     "in SGLang's allocator and cached", block_id=both[0])


def _free_pages(allocator: Any) -> list[int] | None:
    """The page ids free in SGLang's allocator (``None`` if it does not show them)."""
    get_all = getattr(allocator, "get_all_free_pages", None)
    free = get_all() if get_all is not None else None
    if free is None:
        return None
    out: list[int] = free.to("cpu").tolist()
    return out
