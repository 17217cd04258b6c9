"""kvcore's KV events made as vLLM's own event objects.

Inside vLLM the adapter's pool records through :class:`VllmEventRecorder`: the same events
kvcore's :class:`~kvcore.events.EventRecorder` records (what, when, with which fields), built
directly as ``vllm.distributed.kv_events`` objects with hashes already in the form vLLM
publishes (64-bit ints or bytes, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so vLLM's publisher
sends them as they are and nothing is converted per ``take_events``.  A request with prompt
embeddings publishes, after kvcore's extra keys, the digest of each block's embeddings that
vLLM hashed with the block (vLLM's own function computes it, cached on vLLM's request).  Part
of the compiled build, as the recorder it extends (vLLM's event types stay opaque to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import _gen_prompt_embeds_extra_hash_keys

from kvcore.events import EventRecorder
from kvcore.specs import KVCacheConfig
from kvcore.types import BlockHash, KVRequest


def int_hash(h: bytes) -> int:
    """A block hash as vLLM publishes it by default: its bytes read big-endian, cut to 64 bits
    (``maybe_convert_block_hash`` with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, without
    reading the environment once per hash)."""
    return _FROM_BYTES(h[-8:], "big")  # (the last 8 bytes: the low 64 bits, no big int made)


# (Bound once: the compiled build calls it directly instead of looking the method up per hash.)
_FROM_BYTES: Final = int.from_bytes


class VllmEventRecorder(EventRecorder):
    """An :class:`~kvcore.events.EventRecorder` whose events are vLLM's objects; hashes are
    published as :func:`int_hash` makes them (``int_hashes``, vLLM's default) or as the bytes
    themselves."""

    __slots__ = ("_int_hashes",)

    def __init__(self, config: KVCacheConfig, lookahead: int, int_hashes: bool) -> None:
        super().__init__(tuple(g.spec.event_stamp() for g in config.groups), lookahead=lookahead)
        self._int_hashes = int_hashes

    def _has_extra_keys(self, request: KVRequest) -> bool:
        """kvcore's sources, or prompt embeddings (a vLLM request's)."""
        if super()._has_extra_keys(request):
            return True
        vllm_request = getattr(request, "vllm", None)
        return vllm_request is not None and vllm_request.prompt_embeds is not None

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
        block_hashes: list[Any] = hashes
        published_parent: Any = parent  # (an int once converted: not a BlockHash)
        if self._int_hashes:
            block_hashes = [int_hash(h) for h in hashes]
            published_parent = None if parent is None else int_hash(parent)
        # The fields both versions have, in their order (positional: cheaper than keywords);
        # then the session and vLLM 0.33's lookahead tokens (only with lookahead hashes, which
        # 0.32 refuses at start), when there are any.
        optional: dict[str, Any] = {}
        if session_id is not None:
            optional["session_id"] = session_id
        if lookahead_token_ids is not None:
            optional["lookahead_token_ids"] = [list(t) for t in lookahead_token_ids]
        return BlockStored(block_hashes, published_parent, list(token_ids), block_size, lora_id,
                           self.medium, lora_name, extra_keys, group_id, kind, window,
                           **optional)

    def _removed_event(self, block_hash: BlockHash, group_id: int) -> object:
        return BlockRemoved([int_hash(block_hash) if self._int_hashes else block_hash],
                            self.medium, group_id)

    def _cleared_event(self) -> object:
        return AllBlocksCleared()
