"""Coordinator for several KV-cache groups of different types and block sizes.

A hit must be valid for every group.  Groups with equal specs are searched together (a block hit
must exist in all of them).  Hit lengths are multiples of the lcm of the block sizes.  The search
is a fixed point: each type either accepts the current candidate length or shrinks it, and any
shrink restarts the round, until a round changes nothing.  Types whose hits are downward closed
(a shorter prefix of a hit is still a hit: full attention) go first, since their left-to-right
hit bounds everything else, so with one other type a single round suffices.  A full-attention
group in ``retained_hit_groups`` keeps its own longer hit (the lookup's length is still the
agreed one; the allocation uses what the local and external tokens cover).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvcore.coordinator.base import KVCacheCoordinator
from kvcore.hashing import hashes_at
from kvcore.managers.base import HitQuery, SingleTypeKVCacheManager, cdiv
from kvcore.specs import KVCacheSpec
from kvcore.types import BlockHash, GroupBlocks, KVCacheBlock
from kvcore.verify import HitVerifier


@dataclass
class _SpecGroup:
    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    drops_eagle: bool = False
    """Whether this spec group's hits drop their last block under EAGLE (its groups' own
    ``use_eagle``: equal specs drop alike, see ``dropping_groups``)."""

    @property
    def is_full(self) -> bool:
        """Whether the type's hits are downward closed (full attention)."""
        return self.manager_cls.downward_closed_hits


class HybridCoordinator(KVCacheCoordinator):
    aligns_caching: ClassVar[bool] = True
    _spec_groups: list[_SpecGroup]
    _single_round: bool

    def _prepare(self) -> None:
        spec_groups: list[_SpecGroup] = []
        for i, manager in enumerate(self.managers):
            if not manager.enable_caching:
                continue  # cross attention: never part of a hit
            for sg in spec_groups:
                if sg.spec == manager.spec and sg.manager_cls is type(manager):
                    sg.group_ids.append(i)
                    break
            else:
                spec_groups.append(_SpecGroup(manager.spec, [i], type(manager),
                                              manager.use_eagle))
        spec_groups.sort(key=lambda sg: not sg.is_full)  # stable: full attention first
        self._spec_groups = spec_groups
        self._single_round = len(spec_groups) == 2 and spec_groups[0].is_full

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int,
                               verifier: HitVerifier | None) -> tuple[GroupBlocks, int, int]:
        n = len(self.managers)
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * n
        hit_lengths = [0] * n
        hit_length = max_length
        # EAGLE: each spec group that drops (all, or those of CacheSettings.eagle_groups) drops
        # its last block once per candidate length; it looks one block past the candidate
        # (except types that never drop) so the drop lands on it.
        eagle_done: set[int] = set()
        longest = 0  # the longest hit any group found (vLLM's uncached shared prefix)
        while True:
            curr = hit_length
            for idx, sg in enumerate(self._spec_groups):
                first = sg.group_ids[0]
                if sg.is_full and hit_blocks[first] is not None:
                    curr = min(curr, hit_lengths[first])  # downward closed: just trim later
                    continue
                drop = sg.drops_eagle and idx not in eagle_done
                blocks, length = self._search(sg, block_hashes, curr, verifier, drop)
                if drop:
                    eagle_done.add(idx)
                elif length < curr:
                    eagle_done.clear()
                curr = length
                if length > longest:
                    longest = length
                for gid, group_blocks in zip(sg.group_ids, blocks):
                    hit_blocks[gid] = group_blocks
                    hit_lengths[gid] = length
            if curr >= hit_length:
                break
            hit_length = curr
            if self._single_round:
                break
        retained = self.retained_hit_groups
        for sg in self._spec_groups:
            if sg.is_full:
                keep = cdiv(hit_length, sg.spec.block_size)
                for gid in sg.group_ids:
                    trimmed = hit_blocks[gid]
                    if trimmed is not None and gid not in retained:
                        del trimmed[keep:]
        return (tuple(b if b is not None else [] for b in hit_blocks), hit_length,
                longest if longest > hit_length else 0)

    def _search(self, sg: _SpecGroup, block_hashes: Sequence[BlockHash], max_length: int,
                verifier: HitVerifier | None, drop: bool) -> tuple[list[list[KVCacheBlock]], int]:
        """One spec group's own longest hit of at most ``max_length`` tokens; with ``drop``
        (EAGLE) it looks one block further (types that drop) so the drop lands on the bound."""
        limit = max_length
        bs = sg.spec.block_size
        fine = self.partial_hits and sg.manager_cls.fine_grained_hits
        if drop and not sg.spec.holds_state:  # (the manager's drops_eagle_block)
            # EAGLE's margin: one block, or one hash unit where hits may end inside a block.
            margin = self.hash_block_size if fine and bs > self.hash_block_size else bs
            limit = min(max_length + margin, len(block_hashes) * self.hash_block_size)
        return sg.manager_cls.find_longest_cache_hit(HitQuery(
            hashes_at(block_hashes, self.hash_block_size, bs), limit,
            sg.group_ids, self.pool, sg.spec, self.alignment_tokens, verifier, drop,
            block_hashes if fine else None))

    def find_longest_cache_hit_per_group(self, block_hashes: Sequence[BlockHash],
                                         max_length: int) -> tuple[GroupBlocks, tuple[int, ...]]:
        """Each group's own longest hit, without the agreement ``find_longest_cache_hit``
        enforces: per group the hit blocks and the hit length (0 for groups that never hit).
        Per-group hits diverge when one group's blocks were evicted and another's were not
        (vLLM's ``find_longest_cache_hit_per_group``: a KV connector can refill the lagging
        group, or the caller falls back to the agreed hit)."""
        n = len(self.managers)
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in range(n)]
        hit_lengths = [0] * n
        for sg in self._spec_groups:
            blocks, length = self._search(sg, block_hashes, max_length, None, sg.drops_eagle)
            for gid, group_blocks in zip(sg.group_ids, blocks):
                hit_blocks[gid] = group_blocks
                hit_lengths[gid] = length
        return tuple(hit_blocks), tuple(hit_lengths)

    @property
    def full_attention_group_id(self) -> int | None:
        """The first full-attention group when full attention leads the search (vLLM's)."""
        first = self._spec_groups[0] if self._spec_groups else None
        return first.group_ids[0] if first is not None and first.is_full else None

    def hint_hashes(self, block_hashes: Iterable[Sequence[BlockHash]]) -> list[list[BlockHash]]:
        """Per group, the hashes worth holding for these requests (most urgent first).

        With a group that holds state (Mamba), a hit can end only where every such group has
        a cached state block, so a request's blocks past its furthest such point cannot serve
        it: per request, each attention group's hashes up to that point and each state group's
        hash at it, nothing past it (nothing at all while no state of the request is cached).
        Declaring every hash instead held attention blocks no hit could use: inside vLLM 0.32's
        scheduler on the hybrid model at 1,024 blocks, queue hints 128 fell from LRU's 3.88%
        hit rate to 3.33%.  Without a state group, every hash (the base rule)."""
        if not any(m.spec.holds_state for m in self._caching):
            return super().hint_hashes(block_hashes)
        per_group: list[list[BlockHash]] = [[] for _ in self.managers]
        hbs = self.hash_block_size
        align = self.alignment_tokens
        for hashes in block_hashes:
            views = [hashes_at(hashes, hbs, m.block_size) for m in self._caching]
            end = len(hashes) * hbs
            for m, at in zip(self._caching, views):
                if m.spec.holds_state:
                    end = min(end, _last_cached_state(at, m.block_size, end, align,
                                                      self.pool.cached_blocks_map(m.group_id)))
            if not end:
                continue
            for m, at in zip(self._caching, views):
                n = end // m.block_size
                if m.spec.holds_state:
                    per_group[m.group_id].append(at[n - 1])
                else:
                    per_group[m.group_id].extend(at[:n])
        return per_group


def _last_cached_state(hashes: Sequence[BlockHash], block_size: int, end: int, align: int,
                       cached: dict[BlockHash, KVCacheBlock]) -> int:
    """The furthest token count, at most ``end`` and a multiple of ``align``, after which a
    state block of this group is cached (0: none)."""
    for j in range(min(end // block_size, len(hashes)) - 1, -1, -1):
        tokens = (j + 1) * block_size
        if tokens % align == 0 and hashes[j] in cached:
            return tokens
    return 0
