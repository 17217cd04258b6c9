"""A nano-vllm ``BlockManager`` implemented on :class:`~kvcore.manager.KVCacheManager`.

nano-vllm's scheduler talks to its block manager through five calls over ``Sequence`` objects
(``seq_id``, ``token_ids``, ``len(seq)``, ``block_table``, ``num_cached_tokens``):

    can_allocate(seq) / allocate(seq)     admit a waiting sequence (whole prompt, prefix hits)
    can_append(seq)   / may_append(seq)   before a decode step (slot for the last token)
    deallocate(seq)                        finish or preempt

This adapter keeps that contract, so a nano-vllm-style scheduler switches to kvcore unchanged and
gains kvcore's LRU prefix cache, verified hits and invariant checks.  nano-vllm numbers blocks
from 0 and has no null block; kvcore's block 0 is the null block, so ``block_table`` holds
``kvcore_id - 1`` and ``num_blocks`` usable blocks map to ids ``0..num_blocks-1``.  Unlike
nano-vllm, the last prompt token is never a hit (its logits are needed), so a fully cached prompt
recomputes its last block.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvcore.blocks import BlockHash
from kvcore.errors import InvalidArgumentError, NoFreeBlocksError, UnknownRequestError
from kvcore.manager import KVCacheBlocks, KVCacheManager
from kvcore.request import MultiModalItem
from kvcore.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroup


class Sequence(Protocol):
    """The part of nano-vllm's ``Sequence`` the block manager uses."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int

    def __len__(self) -> int: ...


class _SeqRequest:
    """A kvcore request view over a nano-vllm sequence (shares its token list)."""

    __slots__ = ("all_token_ids", "block_hashes", "num_computed_tokens", "num_preemptions",
                 "num_prompt_tokens", "request_id")

    skip_reading_prefix_cache = False
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()

    def __init__(self, seq: Sequence) -> None:
        self.request_id = str(seq.seq_id)
        self.all_token_ids = seq.token_ids
        self.num_prompt_tokens = getattr(seq, "num_prompt_tokens", len(seq.token_ids))
        self.block_hashes: list[BlockHash] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class BlockManager:
    """nano-vllm's block-manager interface over a one-group full-attention KVCacheManager.

    Args:
        num_blocks: usable blocks (ids ``0..num_blocks-1`` in block tables).
        block_size: tokens per block.
        max_model_len: longest sequence (default: all blocks' worth of tokens).
        **manager_kwargs: passed to :class:`KVCacheManager` (``enable_caching``,
            ``verify_hits``, ``hash_algo``, ...).
    """

    def __init__(self, num_blocks: int, block_size: int, *, max_model_len: int | None = None,
                 **manager_kwargs: Any) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidArgumentError(f"num_blocks must be a positive int, got {num_blocks!r}")
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                 dtype=torch.float16)
        config = KVCacheConfig(num_blocks + 1, (KVCacheGroup(("model",), spec),))
        self.block_size = block_size
        self.manager = KVCacheManager(config, max_model_len or num_blocks * block_size,
                                      **manager_kwargs)
        self._requests: dict[int, _SeqRequest] = {}
        self._lookups: dict[int, tuple[KVCacheBlocks, int]] = {}

    def _request(self, seq: Sequence) -> _SeqRequest:
        req = self._requests.get(seq.seq_id)
        if req is None or req.all_token_ids is not seq.token_ids:
            req = self._requests[seq.seq_id] = _SeqRequest(seq)
        return req

    def _lookup(self, seq: Sequence) -> tuple[KVCacheBlocks, int]:
        req = self._request(seq)
        cached = self._lookups.get(seq.seq_id)
        if cached is not None:
            blocks, _hit = cached
            # Still valid only if every hit block still carries the hash it was found under.
            if all(b.block_hash == req.block_hashes[i] for i, b in enumerate(blocks[0])):
                return cached
        found = self.manager.get_computed_blocks(req)
        self._lookups[seq.seq_id] = found
        return found

    # -- admission ------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``allocate(seq)`` will succeed now (prefix hits taken into account)."""
        blocks, _ = self._lookup(seq)
        hits = blocks[0]
        needed = -(-len(seq) // self.block_size) - len(hits)
        needed += sum(1 for b in hits if b.ref_cnt == 0)
        return needed <= self.manager.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence blocks for its whole prompt, reusing cached prefix blocks; sets
        ``block_table`` and ``num_cached_tokens``."""
        if seq.block_table:
            raise InvalidArgumentError(f"sequence {seq.seq_id} already has blocks")
        req = self._request(seq)
        blocks, hit = self._lookup(seq)
        self._lookups.pop(seq.seq_id, None)
        if self.manager.allocate_slots(req, len(seq) - hit, hit, blocks) is None:
            raise NoFreeBlocksError(f"not enough free blocks for sequence {seq.seq_id}; "
                                    "call can_allocate first")
        self.manager.record_prefix_cache_stats(req, hit)
        req.num_computed_tokens = len(seq)
        seq.num_cached_tokens = hit
        seq.block_table[:] = [i - 1 for i in self.manager.get_block_ids(req.request_id)[0]]

    def deallocate(self, seq: Sequence) -> None:
        """Release the sequence's blocks (finished, or preempted for recompute)."""
        req = self._requests.get(seq.seq_id)
        if req is None:
            raise UnknownRequestError(f"sequence {seq.seq_id} holds no blocks")
        self.manager.free(req)
        status = getattr(getattr(seq, "status", None), "name", "")
        if status == "WAITING":  # nano-vllm marks a preempted sequence WAITING first
            req.num_preemptions += 1
            req.num_computed_tokens = 0
        else:
            del self._requests[seq.seq_id]
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    # -- decode ---------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Whether a slot for the sequence's newest token is available."""
        needed = -(-len(seq) // self.block_size) - len(seq.block_table)
        return needed <= self.manager.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Make room for the newest token (a new block when the last one is full) and cache the
        block it completes."""
        req = self._requests.get(seq.seq_id)
        if req is None:
            raise UnknownRequestError(f"sequence {seq.seq_id} holds no blocks")
        new = len(seq) - req.num_computed_tokens
        if new <= 0:
            return
        out = self.manager.allocate_slots(req, new)
        if out is None:
            raise NoFreeBlocksError(f"no free block for sequence {seq.seq_id}; call can_append first")
        req.num_computed_tokens = len(seq)
        seq.block_table.extend(b.block_id - 1 for b in out[0])

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks
