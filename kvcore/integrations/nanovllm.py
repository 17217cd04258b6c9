"""A nano-vllm ``BlockManager`` implemented on :class:`~kvcore.manager.KVCacheManager`.

It follows the block-manager API of nano-vllm's current scheduler (GeeeekExplorer/nano-vllm after
its chunked-prefill refactor, ``nanovllm/engine/block_manager.py`` at bb823b3, April 2026)::

    can_allocate(seq) -> int          -1 if the whole sequence cannot get blocks now, else how
                                      many of its leading blocks the prefix cache serves
    allocate(seq, num_cached_blocks)  blocks for the whole sequence, the first num_cached_blocks
                                      from the cache; sets block_table and num_cached_tokens
    can_append(seq) / may_append(seq) before a decode step: a block for the newest token when
                                      it starts one
    hash_blocks(seq)                  after a step, before num_cached_tokens advances: cache the
                                      blocks the step's num_scheduled_tokens filled
    deallocate(seq)                   finish or preempt: release the blocks, clear block_table
                                      and num_cached_tokens

and is driven the way that scheduler drives it: a waiting sequence without blocks is admitted by
``can_allocate`` then ``allocate(seq, n)``, its prompt computed in one or more chunks of
``num_scheduled_tokens`` (``seq.num_cached_tokens`` counts the tokens computed so far), and
``postprocess`` calls ``hash_blocks`` for every scheduled sequence; running sequences decode with
``can_append``/``may_append``, preempting the newest running one when no block is free.

Semantics compared with nano-vllm's own block manager:

* Hit length: the same.  nano-vllm looks up all blocks but the one holding the last token;
  kvcore caps a hit at ``num_tokens - 1`` tokens.  Either way the last token's block is
  recomputed (its logits are needed), and ``num_cached_tokens`` is ``num_cached_blocks *
  block_size``.
* Confirming a hit: nano-vllm compares the cached block's tokens with the sequence's; kvcore
  trusts its chained 128-bit hash, or with ``verify_hits=True`` proves the whole prefix token by
  token (a block equal at another prefix passes nano-vllm's check, never kvcore's).
* Hashes are computed on the block-manager side in both (here by the kvcore manager, chained
  from its seed, incrementally).  A block enters the prefix cache only in ``hash_blocks``, after
  the step that writes its KV, as in nano-vllm; allocation never caches anything.
* Block ids: kvcore's block 0 is the null block, so ``block_table`` holds ``kvcore_id - 1`` and
  ``num_blocks`` usable blocks map to ids ``0..num_blocks-1``.  Which free block is reused first
  differs (kvcore: blocks without a hash, then cached ones in LRU order; nano-vllm: FIFO), and
  when equal content is cached twice kvcore's map keeps the first block, nano-vllm's the latest.
* Misuse raises a typed ``kvcore.errors`` exception instead of an assertion or ``KeyError``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvcore.errors import (
    InvalidArgumentError,
    InvalidHitError,
    NoFreeBlocksError,
    UnknownRequestError,
)
from kvcore.manager import KVCacheManager
from kvcore.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from kvcore.types import BlockHash, KVCacheBlocks, MultiModalItem


class Sequence(Protocol):
    """The part of nano-vllm's ``Sequence`` the block manager uses (``status`` optional: a
    sequence whose ``status.name`` is ``"WAITING"`` when deallocated counts as preempted)."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int
    num_scheduled_tokens: int

    def __len__(self) -> int: ...


class _SeqRequest:
    """A kvcore request view over a nano-vllm sequence (shares its token list)."""

    __slots__ = ("all_token_ids", "block_hashes", "num_computed_tokens", "num_preemptions",
                 "num_prompt_tokens", "request_id")

    skip_reading_prefix_cache = False
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    session_id: str | None = None
    lora_id: int | None = None
    num_in_flight_tokens = 0

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

    def _request(self, seq: Sequence) -> _SeqRequest:
        req = self._requests.get(seq.seq_id)
        if req is None or req.all_token_ids is not seq.token_ids:
            req = self._requests[seq.seq_id] = _SeqRequest(seq)
        return req

    def _holding(self, seq: Sequence) -> _SeqRequest:
        req = self._requests.get(seq.seq_id)
        if req is None or not seq.block_table:
            raise UnknownRequestError(f"sequence {seq.seq_id} holds no blocks")
        return req

    # -- admission ------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> int:
        """``-1`` if blocks for the whole sequence cannot be had now (prefix hits taken into
        account), else the number of leading blocks the prefix cache serves, to pass to
        ``allocate``.  Changes nothing."""
        hits = self.manager.get_computed_blocks(self._request(seq))[0][0]
        needed = -(-len(seq) // self.block_size) - len(hits)
        needed += sum(1 for b in hits if b.ref_cnt == 0)  # a free cached block leaves the queue
        return -1 if needed > self.manager.num_free_blocks else len(hits)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Give the sequence blocks for all its tokens, the first ``num_cached_blocks`` taken
        from the prefix cache (as ``can_allocate`` just returned, or fewer); sets ``block_table``
        and ``num_cached_tokens``.  Nothing is cached until ``hash_blocks``."""
        if seq.block_table:
            raise InvalidArgumentError(f"sequence {seq.seq_id} already has blocks")
        if num_cached_blocks.__class__ is not int or num_cached_blocks < 0:
            raise InvalidArgumentError(
                f"num_cached_blocks must be a non-negative int, got {num_cached_blocks!r}")
        req = self._request(seq)
        blocks, num_hit = self.manager.get_computed_blocks(req)
        hits = blocks[0]
        if num_cached_blocks > len(hits):
            raise InvalidHitError(
                f"sequence {seq.seq_id}: {num_cached_blocks} cached blocks asked for, the prefix "
                f"cache serves {len(hits)} now (call can_allocate right before allocate)")
        if num_cached_blocks < len(hits):
            blocks = KVCacheBlocks((hits[:num_cached_blocks],))
            num_hit = num_cached_blocks * self.block_size
        out = self.manager.allocate_slots(req, len(seq) - num_hit, num_hit, blocks,
                                          delay_cache_blocks=True)
        if out is None:
            raise NoFreeBlocksError(f"not enough free blocks for sequence {seq.seq_id}; "
                                    "call can_allocate first")
        self.manager.record_prefix_cache_stats(req, num_hit)
        req.num_computed_tokens = num_hit
        seq.num_cached_tokens = num_hit
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

    # -- steps ----------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Whether a slot for the sequence's newest token is available."""
        needed = -(-len(seq) // self.block_size) - len(seq.block_table)
        return needed <= self.manager.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        """Make room for the newest token: a new block when it starts one."""
        req = self._holding(seq)
        new = len(seq) - req.num_computed_tokens
        if new <= 0:
            return
        out = self.manager.allocate_slots(req, new, delay_cache_blocks=True)
        if out is None:
            raise NoFreeBlocksError(f"no free block for sequence {seq.seq_id}; call can_append first")
        seq.block_table.extend(b.block_id - 1 for b in out[0])

    def hash_blocks(self, seq: Sequence) -> None:
        """After a step computed ``seq.num_scheduled_tokens`` tokens from ``num_cached_tokens``
        on (and before ``num_cached_tokens`` advances): put the blocks those tokens filled into
        the prefix cache."""
        req = self._holding(seq)
        start = seq.num_cached_tokens
        end = start + seq.num_scheduled_tokens
        if not 0 <= start <= end <= len(seq):
            raise InvalidArgumentError(
                f"sequence {seq.seq_id}: num_cached_tokens={start} and num_scheduled_tokens="
                f"{seq.num_scheduled_tokens} do not fit its {len(seq)} tokens")
        if end // self.block_size > start // self.block_size:
            self.manager.cache_blocks(req, end)
        req.num_computed_tokens = end

    @property
    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks
