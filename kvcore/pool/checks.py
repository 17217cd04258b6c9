"""Validation of the block pool's inputs, apart from what it does with them.

:class:`PoolChecks` is the base class of :class:`~kvcore.block_pool.BlockPool`: each check raises
kvcore's typed error naming the bad value before anything changes.  The pool's own hot paths
(the managers' calls with blocks they hold) skip them.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvcore._mypyc import mypyc_attr
from kvcore.blocks import BlockHash, KVCacheBlock
from kvcore.errors import BlockStateError, InvalidArgumentError, InvalidGroupError
from kvcore.pool.maps import PrefixMaps

if TYPE_CHECKING:
    from kvcore.blocks import PrefixNode
    from kvcore.request import KVRequest


def check_count(name: str, value: object) -> int:
    """``value`` as a non-negative int, else :class:`InvalidArgumentError` naming ``name``: the
    one rule for every count kvcore is given (the pool's and the manager's).  Integers of other
    types (numpy's) are accepted and converted; bools are refused."""
    if type(value) is int and value >= 0:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        # (int(value) < 0: numpy's comparisons return numpy.bool, which the compiled build's
        # ``or`` refuses.)
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def check_hashes(hashes: object) -> list[BlockHash]:
    """A collection of block hashes as a list, or :class:`InvalidArgumentError` naming the bad
    value."""
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
        raise InvalidArgumentError(f"block hashes must be a collection of bytes, got {hashes!r:.80}")
    out = list(hashes)
    for h in out:
        if type(h) is not bytes:
            raise InvalidArgumentError(f"a block hash must be bytes, got {h!r:.80}")
    return out


@mypyc_attr(allow_interpreted_subclasses=True)
class PoolChecks:
    """The pool state the checks read (set by ``BlockPool.__init__``) and the checks."""

    __slots__ = ()

    blocks: list[KVCacheBlock]
    num_groups: int
    verify_hits: bool
    _maps: PrefixMaps

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

    def _check_takeable(self, blocks: Iterable[KVCacheBlock], op: str) -> list[KVCacheBlock]:
        """``blocks`` as a list, after checking each is one of this pool's and, if free, on the
        free side (what ``touch`` and ``pin`` take a reference on); raises
        :class:`BlockStateError` otherwise."""
        batch = blocks if type(blocks) is list else list(blocks)
        self._check_owned(batch, op)
        for block in batch:
            if block.ref_cnt == 0 and not block.is_null and block.prev_free is None:
                raise BlockStateError(f"{op}: block {block.block_id} has ref_cnt 0 but is not "
                                      "in the free queue")
        return batch

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
