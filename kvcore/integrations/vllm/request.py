"""A vLLM ``Request`` seen as a :class:`kvcore.request.KVRequest`.

vLLM's request already carries what kvcore's manager reads under the same names — id, token
ids, ``block_hashes`` (computed by vLLM's engine with vLLM's hash function, so kvcore caches and
publishes vLLM's own hashes), computed and in-flight tokens, preemptions, cache salt, session —
except three that vLLM spells differently: the LoRA name and id (``lora_request``) and the
multimodal items (``mm_features``).  The view holds vLLM's token and hash lists themselves
(vLLM only ever changes them in place, a streaming-input session included), reads the counters
through to the vLLM request, converts the LoRA adapter once and the multimodal items whenever
their number changed (a streaming session adds items).

This module does not import vLLM.  It is part of the compiled build: the view then is a native
class implementing the protocol, which compiled kvcore reads without a Python call per attribute.
"""

from __future__ import annotations

from typing import Any

from kvcore._mypyc import mypyc_attr
from kvcore.types import BlockHash, MultiModalItem


def _mm_items(features: Any) -> tuple[MultiModalItem, ...]:
    items = []
    for f in features or ():
        pos = f.mm_position
        items.append(MultiModalItem(str(f.identifier), int(pos.offset), int(pos.length)))
    return tuple(items)


@mypyc_attr(allow_interpreted_subclasses=True)
class VllmRequestView:
    """:class:`~kvcore.request.KVRequest` over vLLM request ``request`` (``.vllm``).  Writes go
    through to the vLLM request too (kvcore's manager writes none of these).  (It does not name
    the protocol as its base: mypyc cannot yet override a protocol attribute with a property.)"""

    __slots__ = ("_mm_features", "_mm_items", "all_token_ids", "block_hashes", "cache_salt",
                 "lora_id", "lora_name", "request_id", "session_id", "vllm")

    def __init__(self, request: Any) -> None:
        lora = request.lora_request
        self.vllm: Any = request
        self.request_id: str = request.request_id
        self.lora_name: str | None = lora.lora_name if lora else None
        self.lora_id: int | None = lora.adapter_id if lora else None
        self.cache_salt: str | None = request.cache_salt or None  # vLLM hashes only a non-empty one
        self.session_id: str | None = getattr(request, "session_id", None)
        self.all_token_ids: list[int] = request._all_token_ids  # behind vLLM's read-only view
        self.block_hashes: list[BlockHash] = request.block_hashes
        self._mm_features: int = -1
        self._mm_items: tuple[MultiModalItem, ...] = ()

    @property
    def mm_items(self) -> tuple[MultiModalItem, ...]:
        features = self.vllm.mm_features
        n = len(features) if features else 0
        if n != self._mm_features:
            self._mm_items = _mm_items(features)
            self._mm_features = n
        return self._mm_items

    @mm_items.setter
    def mm_items(self, value: tuple[MultiModalItem, ...]) -> None:
        raise AttributeError("a vLLM request's multimodal items are vLLM's mm_features")

    # The counters are read through to vLLM's request (protocol attributes, so settable).
    @property
    def num_computed_tokens(self) -> int:
        n: int = self.vllm.num_computed_tokens
        return n

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.vllm.num_computed_tokens = value

    @property
    def num_in_flight_tokens(self) -> int:
        n: int = self.vllm.num_in_flight_tokens
        return n

    @num_in_flight_tokens.setter
    def num_in_flight_tokens(self, value: int) -> None:
        self.vllm.num_in_flight_tokens = value

    @property
    def num_preemptions(self) -> int:
        n: int = self.vllm.num_preemptions
        return n

    @num_preemptions.setter
    def num_preemptions(self, value: int) -> None:
        self.vllm.num_preemptions = value

    @property
    def skip_reading_prefix_cache(self) -> bool:
        skip: bool = self.vllm.skip_reading_prefix_cache
        return skip

    @skip_reading_prefix_cache.setter
    def skip_reading_prefix_cache(self, value: bool) -> None:
        self.vllm.skip_reading_prefix_cache = value

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        n: int = self.vllm.num_prompt_tokens
        return n

    def __repr__(self) -> str:
        return f"VllmRequestView({self.vllm!r})"
