"""kvcore's KV events made as vLLM's own event objects.

Inside vLLM the adapter's pool records through :class:`VllmEventRecorder`: the same events
kvcore's :class:`~kvcore.events.EventRecorder` records (what, when, with which fields), built
directly as ``vllm.distributed.kv_events`` objects with hashes already in the form vLLM
publishes (64-bit ints or bytes, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so vLLM's publisher
sends them as they are and nothing is converted per ``take_events``.  A request with prompt
embeddings publishes, after kvcore's extra keys, the digest of each block's embeddings that
vLLM hashed with the block (vLLM's own function computes it, cached on vLLM's request).  Not
part of the compiled build (it subclasses an interpreted class).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import _gen_prompt_embeds_extra_hash_keys

from kvcore.events import EventRecorder
from kvcore.specs import KVCacheConfig
from kvcore.types import BlockHash, KVRequest


def int_hash(h: bytes) -> int:
    """A block hash as vLLM publishes it by default: its bytes read big-endian, cut to 64 bits
    (``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, without
    reading the environment once per hash)."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


class VllmEventRecorder(EventRecorder):
    """An :class:`~kvcore.events.EventRecorder` whose events are vLLM's objects; ``convert``
    turns a hash into what vLLM publishes (``None``: the bytes themselves)."""

    __slots__ = ("_convert",)

    def __init__(self, config: KVCacheConfig, lookahead: int,
                 convert: Callable[[bytes], Any] | None) -> None:
        super().__init__(tuple(g.spec.event_stamp() for g in config.groups), lookahead=lookahead)
        self._convert = convert

    def _extra_keys(self, request: KVRequest, start: int, end: int) -> tuple[object, ...] | None:
        """kvcore's keys, then for a vLLM request with prompt embeddings the digest of
        ``prompt_embeds[start:end]`` (vLLM's ``("prompt_embeds", digest)`` key, untagged), as
        vLLM's pool publishes them (its window: with lookahead hashes ``end`` covers the
        lookahead tokens)."""
        keys = super()._extra_keys(request, start, end)
        vllm_request = getattr(request, "vllm", None)
        if vllm_request is None or vllm_request.prompt_embeds is None:
            return keys
        embeds = tuple(key[1] for key in _gen_prompt_embeds_extra_hash_keys(
            vllm_request, start, end))
        return embeds if keys is None else (*keys, *embeds)

    def _stored_event(self, hashes: list[BlockHash], parent: BlockHash | None,
                      token_ids: Sequence[int], block_size: int, lora_id: int | None,
                      lora_name: str | None, extra_keys: list[tuple[object, ...] | None] | None,
                      group_id: int, kind: str | None, window: int | None,
                      session_id: str | None,
                      lookahead_token_ids: list[tuple[int, ...]] | None) -> object:
        convert = self._convert
        block_hashes: list[Any] = hashes
        if convert is not None:
            block_hashes = [convert(h) for h in hashes]
            parent = None if parent is None else convert(parent)
        # The fields both versions have, in their order (positional: cheaper than keywords);
        # then the session and vLLM 0.33's lookahead tokens (only with lookahead hashes, which
        # 0.32 refuses at start), when there are any.
        optional: dict[str, Any] = {}
        if session_id is not None:
            optional["session_id"] = session_id
        if lookahead_token_ids is not None:
            optional["lookahead_token_ids"] = [list(t) for t in lookahead_token_ids]
        return BlockStored(block_hashes, parent, list(token_ids), block_size, lora_id,
                           self.medium, lora_name, extra_keys, group_id, kind, window,
                           **optional)

    def _removed_event(self, block_hash: BlockHash, group_id: int) -> object:
        convert = self._convert
        return BlockRemoved([block_hash if convert is None else convert(block_hash)],
                            self.medium, group_id)

    def _cleared_event(self) -> object:
        return AllBlocksCleared()
