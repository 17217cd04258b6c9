"""A vLLM ``Request`` seen as a :class:`kvcore.request.KVRequest`.

vLLM's request already carries what kvcore's manager reads under the same names — id, token
ids, ``block_hashes`` (computed by vLLM's engine with vLLM's hash function, so kvcore caches and
publishes vLLM's own hashes), computed and in-flight tokens, preemptions, cache salt, session —
except three that vLLM spells differently: the LoRA name and id (``lora_request``) and the
multimodal items (``mm_features``).  The view reads the live values through to the vLLM request
and converts those three once, when it is made.
"""

from __future__ import annotations

from typing import Any

from kvcore.blocks import BlockHash
from kvcore.request import MultiModalItem


def _mm_items(features: Any) -> tuple[MultiModalItem, ...]:
    items = []
    for f in features or ():
        pos = f.mm_position
        items.append(MultiModalItem(str(f.identifier), int(pos.offset), int(pos.length)))
    return tuple(items)


class VllmRequestView:
    """:class:`~kvcore.request.KVRequest` over vLLM request ``request`` (``.vllm``)."""

    __slots__ = ("cache_salt", "lora_id", "lora_name", "mm_items", "request_id", "session_id",
                 "vllm")

    def __init__(self, request: Any) -> None:
        self.vllm = request
        self.request_id: str = request.request_id
        lora = request.lora_request
        self.lora_name: str | None = lora.lora_name if lora else None
        self.lora_id: int | None = lora.adapter_id if lora else None
        # vLLM hashes the salt only when it is non-empty.
        self.cache_salt: str | None = request.cache_salt or None
        self.session_id: str | None = getattr(request, "session_id", None)
        self.mm_items = _mm_items(request.mm_features)

    @property
    def all_token_ids(self) -> list[int]:
        return self.vllm._all_token_ids  # the list behind vLLM's read-only view

    @property
    def block_hashes(self) -> list[BlockHash]:
        return self.vllm.block_hashes

    @property
    def num_computed_tokens(self) -> int:
        return self.vllm.num_computed_tokens

    @property
    def num_in_flight_tokens(self) -> int:
        return self.vllm.num_in_flight_tokens

    @property
    def num_preemptions(self) -> int:
        return self.vllm.num_preemptions

    @property
    def skip_reading_prefix_cache(self) -> bool:
        return self.vllm.skip_reading_prefix_cache

    @property
    def num_tokens(self) -> int:
        return len(self.vllm._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.vllm.num_prompt_tokens

    def __repr__(self) -> str:
        return f"VllmRequestView({self.vllm!r})"
