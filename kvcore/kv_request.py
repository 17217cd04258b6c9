"""What the KV-cache manager reads from a request: the :class:`KVRequest` protocol (and the
:class:`MultiModalItem` it carries).  :class:`~kvcore.request.Request` implements it; hashing,
the pool and the managers read only this."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvcore._mypyc import mypyc_attr
from kvcore.blocks import BlockHash


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input occupying prompt positions ``[offset, offset + length)``; ``identifier``
    is a content hash of the item, so equal images give equal KV."""

    identifier: str
    offset: int
    length: int


@mypyc_attr(allow_interpreted_subclasses=True)  # as Request, which names it as its base
class KVRequest(Protocol):
    """What the KV-cache manager reads from a request."""

    __slots__ = ()

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    num_computed_tokens: int
    num_preemptions: int
    skip_reading_prefix_cache: bool
    lora_name: str | None
    cache_salt: str | None
    mm_items: tuple[MultiModalItem, ...]
    session_id: str | None  # sent in BlockStored events, as vLLM does
    lora_id: int | None  # the LoRA adapter's int id, sent in BlockStored events as vLLM does
    # Tokens of steps whose output is not processed yet, counted in num_computed_tokens
    # (vLLM's async scheduling): blocks leave a window only up to num_computed_tokens minus these.
    num_in_flight_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...
