"""Chained block hashes for prefix caching.

A block's hash covers its parent's hash, its tokens and its extra keys::

    h_0 = H(root, tokens_0, extra_0)     h_i = H(h_{i-1}, tokens_i, extra_i)

so equal hashes mean equal prefixes.  ``root`` is derived from a seed that belongs to the
:class:`BlockHasher` instance (no module-global state): the default seed is fixed, so hashes are
stable across processes (KV events, routers); pass :func:`random_seed` for per-instance secrecy.

Algorithms: ``xxh3_128`` (default, fast, 16-byte hashes), ``sha256`` (cryptographic) and
``sha256_cbor`` (CBOR-serialised input, reproducible from any language).  Token ids are packed as
little-endian uint32; extra keys, in order, are the LoRA name, each multimodal item overlapping the
block (id, offset of the item relative to the block start) and the cache salt (first block only).

Lookahead hashes (``lookahead`` L > 0, vLLM 0.33's ``num_hash_lookahead_tokens``): an EAGLE/MTP
drafter's KV at a block's last position depends on the L tokens after the block, so the block's
hash also covers them.  A block is hashed only once those tokens exist; its extra keys then cover
the window ``[start, end + L)`` and end with ``("next", t_end, ..., t_end+L-1)``
(:func:`hash_extra_keys`).  The block's tokens are still only its own.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast, overload

import cbor2
import xxhash

from kvcore._mypyc import mypyc_attr
from kvcore.errors import InvalidArgumentError, UnknownHashAlgorithmError
from kvcore.types import BlockHash, KVRequest

HASH_ALGORITHMS: tuple[str, ...] = ("xxh3_128", "sha256", "sha256_cbor")
_ALIASES = {"xxhash": "xxh3_128", "xxh3": "xxh3_128"}
DEFAULT_SEED = b"kvcore/prefix-cache/v1"
_BIG_ENDIAN = sys.byteorder == "big"  # token words are hashed little-endian everywhere

ExtraKeys = tuple[tuple[Any, ...], ...]
Seed = bytes | str | int | None
"""What a seed may be.  Parameters taking one are annotated ``object``: the hasher checks the
seed itself (a typed error), which the compiled build's check of a ``Seed`` annotation would
pre-empt."""


def random_seed() -> bytes:
    """A fresh 32-byte seed: hashes become unpredictable to anyone without it."""
    return os.urandom(32)


def resolve_algorithm(name: str) -> str:
    """Canonical algorithm name; raises :class:`UnknownHashAlgorithmError` for unknown names."""
    algo = _ALIASES.get(name, name)
    if algo not in HASH_ALGORITHMS:
        raise UnknownHashAlgorithmError(
            f"unknown hash algorithm {name!r}; choose one of {', '.join(HASH_ALGORITHMS)}")
    return algo


def _seed_bytes(seed: object) -> bytes:
    if seed is None:
        return DEFAULT_SEED
    if isinstance(seed, bytes):
        return seed
    if isinstance(seed, str):
        return seed.encode()
    if isinstance(seed, int) and not isinstance(seed, bool):
        return str(seed).encode()
    raise InvalidArgumentError(f"hash seed must be bytes, str, int or None, got {type(seed).__name__}")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _cbor(extra: ExtraKeys) -> bytes:
    return cbor2.dumps(extra, canonical=True)


def _u32_words(token_ids: Sequence[int]) -> array[int]:
    """``token_ids`` as little-endian uint32 words, packed and checked in one C-level pass.

    Raises :class:`InvalidArgumentError` naming the first token id that is not an int in
    ``[0, 2**32)``.  (A C ``unsigned int``, array typecode ``I``, is 32 bits on every platform
    CPython supports.)
    """
    try:
        if isinstance(token_ids, list):
            words = array("I")
            words.fromlist(token_ids)  # faster than array("I", token_ids)
        else:
            words = array("I", token_ids)
    except (OverflowError, TypeError):
        items: Sequence[object] = token_ids  # the compiled build would check an int on each
        for t in items:
            try:
                array("I", (cast(Any, t),))
            except (OverflowError, TypeError):
                raise InvalidArgumentError(
                    f"token ids must be ints in [0, 2**32), got {t!r}") from None
        raise  # unreachable: some token failed above
    if _BIG_ENDIAN:
        words.byteswap()
    return words


# Subclasses are allowed outside the compiled build (kvcore.testing's colliding hashers).
@mypyc_attr(allow_interpreted_subclasses=True)
class BlockHasher:
    """One hash algorithm plus the root derived from a seed.

    ``hash_block(parent, token_ids, extra_keys)`` returns the chained hash of one full block;
    ``parent=None`` chains onto the root.  ``hash_blocks`` hashes consecutive blocks in one call,
    with exactly the values chained ``hash_block`` calls give.
    """

    __slots__ = ("_digest", "_own_hash_block", "algorithm", "root")

    def __init__(self, algorithm: str = "xxh3_128", seed: object = None) -> None:
        self.algorithm = resolve_algorithm(algorithm)
        # False in a subclass that redefines hash_block (kvcore.testing's fault injection):
        # hash_blocks then goes through it, block by block.
        self._own_hash_block = type(self).hash_block is BlockHasher.hash_block
        seed_b = _seed_bytes(seed)
        digest: Callable[[bytes], bytes] = (
            xxhash.xxh3_128_digest if self.algorithm == "xxh3_128" else _sha256)
        # A BlockHash is bytes at run time: digests are block hashes as they are, unwrapped.
        self._digest = cast("Callable[[bytes], BlockHash]", digest)
        self.root = self._digest(
            cbor2.dumps(["kvcore-root", seed_b], canonical=True) if self.algorithm == "sha256_cbor"
            else b"kvcore-root\x00" + seed_b)

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: ExtraKeys | None = None) -> BlockHash:
        """Hash one block chained onto ``parent`` (``None``: the root)."""
        prev = self.root if parent is None else parent
        words = _u32_words(token_ids)
        if self.algorithm == "sha256_cbor":
            return self._digest(cbor2.dumps(
                [prev, list(token_ids), list(extra_keys) if extra_keys else None], canonical=True))
        data = prev + words
        if extra_keys:
            data += _cbor(extra_keys)
        return self._digest(data)

    def hash_blocks(self, parent: BlockHash | None, token_ids: Sequence[int], block_size: int,
                    extra_keys: Sequence[ExtraKeys | None] | None = None) -> list[BlockHash]:
        """Chained hashes of the ``len(token_ids) // block_size`` full blocks of ``token_ids``.

        Equal to chaining :meth:`hash_block` block by block from ``parent`` (a trailing partial
        block is not hashed); ``extra_keys[i]`` belongs to block ``i``, ``None``: no block has
        any.  All of ``token_ids`` is checked and packed at once, before anything is hashed.
        """
        bs = block_size
        if bs <= 0:
            raise InvalidArgumentError(f"block_size must be positive, got {bs!r}")
        words = _u32_words(token_ids)
        n = len(words) // bs
        del words[n * bs:]
        if extra_keys is not None and len(extra_keys) != n:
            raise InvalidArgumentError(f"{len(extra_keys)} extra keys for {n} blocks")
        prev: bytes = self.root if parent is None else parent
        out: list[Any] = []  # of BlockHash: digests are plain bytes at run time
        if not self._own_hash_block:
            for i in range(n):
                parent = self.hash_block(parent, token_ids[i * bs:(i + 1) * bs],
                                         extra_keys[i] if extra_keys else None)
                out.append(parent)
            return out
        if self.algorithm == "sha256_cbor":
            tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
            for i in range(n):
                extra = extra_keys[i] if extra_keys else None
                prev = _sha256(cbor2.dumps([prev, tokens[i * bs:(i + 1) * bs],
                                            list(extra) if extra else None], canonical=True))
                out.append(prev)
            return out
        # Each block's packed tokens as one bytes object, split off in C.
        blocks = struct.iter_unpack(f"{4 * bs}s", words)
        if extra_keys is not None:
            digest = self._digest
            for (chunk,), extra in zip(blocks, extra_keys):
                data = prev + chunk
                if extra:
                    data += _cbor(extra)
                prev = digest(data)
                out.append(prev)
        elif self.algorithm == "xxh3_128":
            # The hot loops: one concatenation and one C hash call per block.
            xxh3 = xxhash.xxh3_128_digest
            for (chunk,) in blocks:
                prev = xxh3(prev + chunk)
                out.append(prev)
        else:
            sha256 = hashlib.sha256
            for (chunk,) in blocks:
                prev = sha256(prev + chunk).digest()
                out.append(prev)
        return out


def has_extra_keys(request: KVRequest) -> bool:
    """Whether any block of ``request`` may have extra keys (:func:`block_extra_keys`'s sources:
    a LoRA adapter, multimodal items, a cache salt); without, every block's are ``None``."""
    return (request.lora_name is not None or request.cache_salt is not None
            or bool(request.mm_items))


def block_extra_keys(request: KVRequest, start: int, end: int) -> ExtraKeys | None:
    """The extra keys of the block covering tokens ``[start, end)``, or ``None``.

    Order: ``("lora", name)``; one ``("mm", id, offset_in_block)`` per multimodal item
    overlapping the block (offset may be negative when the item began in an earlier block);
    ``("salt", salt)`` on the first block only.
    """
    keys: list[tuple[Any, ...]] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    for item in request.mm_items:
        if item.offset >= end:
            break
        if item.offset + item.length > start:
            keys.append(("mm", item.identifier, item.offset - start))
    if start == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys) if keys else None


def hash_extra_keys(request: KVRequest, start: int, end: int,
                    lookahead: int = 0) -> ExtraKeys | None:
    """The extra keys the hash of the block ``[start, end)`` covers: :func:`block_extra_keys`;
    with ``lookahead`` L > 0, those of the window ``[start, end + L)`` followed by
    ``("next", *tokens[end:end + L])`` (the request must hold those tokens)."""
    if not lookahead:
        return block_extra_keys(request, start, end)
    keys = block_extra_keys(request, start, end + lookahead) or ()
    return (*keys, ("next", *request.all_token_ids[end:end + lookahead]))


def num_hashable_blocks(num_tokens: int, block_size: int, lookahead: int = 0) -> int:
    """How many leading blocks of a ``num_tokens``-token request can be hashed: the full ones,
    each with ``lookahead`` tokens after it."""
    return (num_tokens - lookahead) // block_size if num_tokens > lookahead else 0


class EngineHashes(BlockHasher):
    """The block hasher of a manager whose requests arrive hashed by their engine (vLLM's engine
    hashes every request with its own algorithm and seed): the manager never hashes a request
    itself, and caches only the full blocks the request has hashes for — as vLLM's own manager
    does, also when the engine hashed with a different lookahead than the manager's."""

    __slots__ = ()

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: ExtraKeys | None = None) -> BlockHash:
        raise InvalidArgumentError("EngineHashes hashes nothing: the engine hashes its requests")


class BlockHashView:
    """A request's hashes seen at a coarser block size.

    Hashes are computed every ``hash_block_size`` tokens and each one chains over the whole
    prefix, so the hash of a ``scale * hash_block_size`` block is simply the fine hash at its last
    boundary: view[i] = hashes[(i + 1) * scale - 1].  The view is live (it follows the list).

    A ``Sequence`` registered as one, not derived from it: a compiled class with a Python base
    gets a ``__weakref__`` slot that mypyc 2.4's deallocator never clears (see
    docs/mypyc_weakref_bug.md), so a weak reference to a freed view would dangle.
    """

    __slots__ = ("_hashes", "_scale")

    def __init__(self, hashes: Sequence[BlockHash], scale: int) -> None:
        self._hashes = hashes
        self._scale = scale

    def __len__(self) -> int:
        return len(self._hashes) // self._scale

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self._hashes[(idx + 1) * self._scale - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        return itertools.islice(self._hashes, self._scale - 1, None, self._scale)

    # Sequence's other mixins (``in``, ``reversed``) work from the methods above.
    def index(self, value: object) -> int:
        for i, h in enumerate(self):
            if h == value:
                return i
        raise ValueError(f"{value!r} is not in the view")

    def count(self, value: object) -> int:
        return sum(1 for h in self if h == value)


Sequence.register(BlockHashView)


def hashes_at(hashes: Sequence[BlockHash], hash_block_size: int,
              block_size: int) -> Sequence[BlockHash]:
    """``hashes`` (one per ``hash_block_size`` tokens) seen at ``block_size``."""
    if block_size == hash_block_size:
        return hashes
    # (A cast: the view is a Sequence by registration, which mypy does not see.)
    return cast("Sequence[BlockHash]", BlockHashView(hashes, block_size // hash_block_size))
