"""PrefixMaps: per KV-cache group, block hash -> cached block, with duplicates and partial
prompt-tail entries.

Each group has its own map, so a hash cached in group 0 never hits in group 1.  A block table
is append-only, so equal content may be cached twice: the first block cached under a hash is the
one lookups find (``cached[g]``), later ones wait in ``dups[g]`` (insertion order) and the
earliest is promoted when the first leaves.

*Partial entries* (``BlockPool.cache_partial_block``): when a full-attention group's blocks are
larger than the hash block, vLLM registers the prompt's last hash boundary inside the last block.
Such an entry is the block's hash if it had none (``partial_primary``: block id -> tokens it
covers) or an extra key evicted with it (``secondary``).  Both stay empty unless that case
occurs, so the pool's hot paths test them for emptiness only.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvcore.types import BlockHash, KVCacheBlock


class PrefixMaps:
    """The prefix-cache maps of ``num_groups`` groups (see the module docstring)."""

    __slots__ = ("cached", "dups", "partial_primary", "secondary")

    def __init__(self, num_groups: int) -> None:
        self.cached: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.dups: list[dict[BlockHash, dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)]
        self.secondary: dict[int, list[BlockHash]] = {}
        self.partial_primary: dict[int, int] = {}

    def clear(self) -> None:
        for g in range(len(self.cached)):
            self.cached[g] = {}
            self.dups[g] = {}
        self.secondary.clear()
        self.partial_primary.clear()

    # -- queries ----------------------------------------------------------------------------------
    def iter_group(self, g: int) -> Iterator[tuple[BlockHash, KVCacheBlock]]:
        """Every ``(hash, block)`` entry of group ``g``, duplicates included."""
        for h, block in self.cached[g].items():
            yield h, block
        for h, dups in self.dups[g].items():
            for block in dups.values():
                yield h, block

    def __len__(self) -> int:
        """Entries in all groups, duplicates included."""
        return (sum(len(m) for m in self.cached)
                + sum(len(d) for dups in self.dups for d in dups.values()))

    # -- entries ----------------------------------------------------------------------------------
    def map(self, g: int, h: BlockHash, block: KVCacheBlock) -> None:
        cached = self.cached[g]
        if h not in cached:
            cached[h] = block
        else:
            self.dups[g].setdefault(h, {})[block.block_id] = block

    def unmap(self, g: int, h: BlockHash, block: KVCacheBlock) -> None:
        cached = self.cached[g]
        dups = self.dups[g]
        if cached.get(h) is block:
            more = dups.get(h)
            if more:
                promoted_id = next(iter(more))
                cached[h] = more.pop(promoted_id)
                if not more:
                    del dups[h]
            else:
                del cached[h]
        else:
            more = dups[h]
            del more[block.block_id]
            if not more:
                del dups[h]

    def drop_keys(self, block: KVCacheBlock) -> list[BlockHash]:
        """Unmap and clear ``block``'s hash and partial entries; returns them, primary first."""
        h = block.block_hash
        g = block.group_id
        assert h is not None
        self.unmap(g, h, block)
        removed = [h]
        if self.secondary:
            extra = self.secondary.pop(block.block_id, None)
            if extra:
                for key in extra:
                    self.unmap(g, key, block)
                removed.extend(extra)
        if self.partial_primary:
            self.partial_primary.pop(block.block_id, None)
        block.block_hash = None
        block.group_id = -1
        block.prefix_node = None
        return removed

    def add_partial(self, block: KVCacheBlock, key: BlockHash, num_tokens: int,
                    group_id: int) -> list[BlockHash] | None:
        """Register the partial entry ``key`` (covering ``num_tokens`` prefix tokens) on ``block``
        in group ``group_id``.  Returns ``None`` when it is already there, else the keys an older,
        shorter partial entry of the block lost (for ``BlockRemoved`` events; usually none)."""
        extra = self.secondary.get(block.block_id, ())
        if (block.block_hash == key and block.group_id == group_id) or key in extra:
            return None
        removed: list[BlockHash] = []
        covered = self.partial_primary.get(block.block_id)
        if covered is not None and covered < num_tokens:  # an older, shorter partial entry
            removed = self.drop_keys(block)
        if block.block_hash is None:
            block.block_hash = key
            block.group_id = group_id
            self.partial_primary[block.block_id] = num_tokens
        else:
            self.secondary.setdefault(block.block_id, []).append(key)
        self.map(group_id, key, block)
        return removed
