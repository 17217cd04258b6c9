"""The request type kvcore's manager reads, and the protocol it needs from any request type.

``KVRequest`` is what ``KVCacheManager`` and ``BlockPool`` read from a request; a scheduler can
use its own type if it provides these attributes.  :class:`Request` is the default
implementation: it keeps prompt and output tokens in one list and, when built with a
:class:`RequestBlockHasher`, keeps ``block_hashes`` up to date as tokens arrive.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import SupportsIndex

from kvcore._mypyc import mypyc_attr
from kvcore.errors import InvalidArgumentError
from kvcore.hashing import (
    BlockHasher,
    EngineHashes,
    ExtraKeys,
    block_extra_keys,
    has_extra_keys,
    hash_extra_keys,
)
from kvcore.types import BlockHash, KVRequest, MultiModalItem


class RequestStatus(enum.Enum):
    """Where a request is in its life (set by ``kvcore.scheduler``)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its KV is being loaded by a connector
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS or a stop token
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"  # can never fit in the KV cache

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "rejected")


def _check_tokens(token_ids: Iterable[int], what: str) -> list[int]:
    """Copy ``token_ids`` into a list, checking in C that each is an int in [0, 2**32); anything
    that is not an iterable of them raises :class:`InvalidArgumentError` naming it."""
    try:
        out = list(token_ids)
    except TypeError:  # not iterable (an int, a float, None, ...)
        raise InvalidArgumentError(f"{what} must be a sequence of ints in [0, 2**32), got "
                                   f"{token_ids!r} ({type(token_ids).__name__})") from None
    try:
        array("I", out)
        if bool in map(type, out):  # array("I") takes True and False as 1 and 0
            raise TypeError
    except (OverflowError, TypeError):
        items: Sequence[object] = out  # the compiled build would check an int on each
        for bad in items:
            if type(bad) is bool or not isinstance(bad, int) or not 0 <= bad < 1 << 32:
                break
        raise _bad_token(what, bad) from None
    return out


def _bad_token(what: str, bad: object) -> InvalidArgumentError:
    return InvalidArgumentError(f"{what} must be ints in [0, 2**32), got {bad!r}")


def _check_name(name: str, value: object) -> str | None:
    # "" would hash like no salt / no adapter at all: refuse it rather than share KV.
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidArgumentError(f"{name} must be a non-empty str or None, got {value!r}")
    return value


# Subclasses defined outside the compiled build (a scheduler's own request type) are allowed.
# It implements the KVRequest protocol structurally: naming the protocol as a base would put a
# Python class (typing.Protocol) in the compiled class's bases, and mypyc 2.4 then gives it a
# __weakref__ slot that its deallocator never clears (a weak reference to a freed Request, e.g.
# Hypothesis', dangles: a segfault at the next garbage collection; BENCHMARKS.md, 2026-11-26).
@mypyc_attr(allow_interpreted_subclasses=True)
class Request:
    """A generation request.

    ``all_token_ids`` is prompt followed by output; ``num_computed_tokens`` counts tokens whose KV
    is in the cache (the scheduler advances it; under async scheduling it may count one
    position past ``all_token_ids``, a token sampled but not reported yet:
    ``num_output_placeholders``); ``block_hashes`` holds one hash per full block of
    ``all_token_ids`` when a block hasher was given.  ``max_tokens``, ``eos_token_id``,
    ``ignore_eos`` and ``stop_token_ids`` are the stop conditions ``kvcore.scheduler`` applies;
    ``sampling_params`` is carried for the engine that samples.  ``session_id`` names the
    conversation a request belongs to (multi-turn chat): a retention hint, see
    :class:`kvcore.scheduler.SchedulerConfig` ``retain_sessions``.  ``lora_name`` keys the
    block hashes (different adapters never share KV); ``lora_id`` is the adapter's int id, only
    published in ``BlockStored`` events (vLLM's deprecated field).  ``num_encoder_tokens``: the
    encoder output the cross-attention layers of an encoder-decoder model read (0 for
    decoder-only models); ``kvcore.scheduler`` allocates its cross-attention blocks at each
    admission.
    """

    __slots__ = ("_block_hasher", "all_token_ids", "arrival_time", "block_hashes", "cache_salt",
                 "eos_token_id", "ignore_eos", "lora_id", "lora_name", "max_tokens", "mm_items",
                 "num_cached_tokens", "num_computed_tokens", "num_encoder_tokens",
                 "num_in_flight_tokens",
                 "num_output_placeholders", "num_preemptions",
                 "num_prompt_tokens", "request_id", "sampling_params", "session_id",
                 "skip_reading_prefix_cache", "status", "stop_token_ids")

    num_prompt_tokens: int  # an attribute here (KVRequest only needs it readable)

    def __init__(
        self,
        request_id: object,
        prompt_token_ids: Sequence[int],
        *,
        block_hasher: RequestBlockHasher | None = None,
        max_tokens: SupportsIndex | None = None,
        cache_salt: object = None,
        lora_name: object = None,
        mm_items: Sequence[MultiModalItem] = (),
        skip_reading_prefix_cache: bool = False,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        arrival_time: float = 0.0,
        sampling_params: object = None,
        session_id: object = None,
        lora_id: object = None,
        num_encoder_tokens: object = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        prompt = _check_tokens(prompt_token_ids, "prompt token ids")
        if not prompt:
            raise InvalidArgumentError(f"request {request_id!r}: the prompt is empty")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 0):
            raise InvalidArgumentError(f"max_tokens must be a non-negative int, got {max_tokens!r}")
        if type(num_encoder_tokens) is not int or num_encoder_tokens < 0:
            raise InvalidArgumentError(
                f"num_encoder_tokens must be a non-negative int, got {num_encoder_tokens!r}")
        cache_salt = _check_name("cache_salt", cache_salt)
        lora_name = _check_name("lora_name", lora_name)
        session_id = _check_name("session_id", session_id)
        if lora_id is not None and (type(lora_id) is not int or lora_id <= 0):
            raise InvalidArgumentError(f"lora_id must be a positive int or None, got {lora_id!r}")
        items = tuple(mm_items)
        for prev, item in pairwise(items):
            if item.offset < prev.offset:
                raise InvalidArgumentError("multimodal items must be sorted by offset")
        for item in items:
            if item.offset < 0 or item.length <= 0 or item.offset + item.length > len(prompt):
                raise InvalidArgumentError(f"multimodal item {item} lies outside the prompt")
        self.request_id = request_id
        self.all_token_ids: list[int] = prompt
        self.num_prompt_tokens = len(prompt)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.mm_items = items
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.eos_token_id = eos_token_id
        self.ignore_eos = ignore_eos
        self.stop_token_ids = frozenset(stop_token_ids)
        self.arrival_time = arrival_time
        self.sampling_params = sampling_params
        self.session_id = session_id
        self.lora_id = lora_id
        self.num_encoder_tokens = num_encoder_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-hit tokens at the latest admission
        self.num_preemptions = 0
        # Tokens sampled by steps still in flight (async scheduling): their positions are
        # already scheduled, their ids not known yet (see kvcore.scheduler).
        self.num_output_placeholders = 0
        # kvcore's scheduler releases window blocks at num_computed_tokens: nothing in flight.
        self.num_in_flight_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash any block they complete."""
        tokens = self.all_token_ids
        if type(token_ids) is int and 0 <= token_ids < 0x1_0000_0000:
            tokens.append(token_ids)
        elif type(token_ids) is bool:  # before narrowing to int: compiled, True would become 1
            raise _bad_token("output token ids", token_ids)
        else:
            tokens.extend(_check_tokens(
                (token_ids,) if isinstance(token_ids, int) else token_ids, "output token ids"))
        hasher = self._block_hasher
        if hasher is not None and len(tokens) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.block_hashes.extend(hasher(self))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, hashes={len(self.block_hashes)})")


RequestLike = Request | KVRequest
"""What the manager's hot paths take: any :class:`KVRequest`, spelled with :class:`Request` first
so that the compiled build reads a ``Request``'s attributes natively (one type check) instead of
looking each one up by name.  (``Request`` implements the protocol structurally, so mypyc cannot
reach it through the protocol: see the class comment.)"""


class RequestBlockHasher:
    """Computes the hashes of a request's newly completed full blocks.

    ``hasher(request)`` returns the hashes of full blocks past ``len(request.block_hashes)``;
    partial blocks are never hashed, nor, with ``lookahead`` L > 0, a block before the L tokens
    after it exist (see the module docstring).  A :class:`kvcore.request.Request` built with a
    block hasher calls it at construction and whenever output tokens are appended.
    """

    __slots__ = ("block_size", "engine_hashes", "hasher", "lookahead")

    def __init__(self, block_size: int, hasher: BlockHasher | None = None,
                 lookahead: object = 0) -> None:
        # (lookahead: object, checked here: the compiled build would turn an ``int`` parameter's
        # check into its own TypeError, and let a bool through as an int.)
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        if type(lookahead) is not int or lookahead < 0:
            raise InvalidArgumentError(f"lookahead must be an int >= 0, got {lookahead!r}")
        self.block_size = block_size
        self.hasher = hasher if hasher is not None else BlockHasher()
        self.lookahead: int = lookahead
        # The engine hashes the requests (EngineHashes): nothing to compute here, ever.
        self.engine_hashes = isinstance(self.hasher, EngineHashes)

    def __call__(self, request: RequestLike) -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        start = len(hashes) * bs
        lookahead = self.lookahead
        n = (len(tokens) - lookahead - start) // bs
        if n <= 0 or self.engine_hashes:
            return []
        parent = hashes[-1] if hashes else None
        end = start + n * bs
        if lookahead:
            extra: list[ExtraKeys | None] | None = [
                hash_extra_keys(request, s, s + bs, lookahead) for s in range(start, end, bs)]
            return self.hasher.hash_blocks(parent, tokens[start:end], bs, extra)
        plain = not has_extra_keys(request)
        if n == 1:  # decoding completes one block at a time
            return [self.hasher.hash_block(parent, tokens[start:end],
                                           None if plain else block_extra_keys(request, start, end))]
        extra = None if plain else [block_extra_keys(request, s, s + bs)
                                    for s in range(start, end, bs)]
        # From the start, the list itself (its partial last block is left out) rather than a copy.
        return self.hasher.hash_blocks(parent, tokens if start == 0 else tokens[start:end], bs,
                                       extra)
