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
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import cbor2
import xxhash

from kvcore.blocks import BlockHash
from kvcore.errors import InvalidArgumentError, UnknownHashAlgorithmError

if TYPE_CHECKING:
    from kvcore.request import KVRequest

HASH_ALGORITHMS: tuple[str, ...] = ("xxh3_128", "sha256", "sha256_cbor")
_ALIASES = {"xxhash": "xxh3_128", "xxh3": "xxh3_128"}
DEFAULT_SEED = b"kvcore/prefix-cache/v1"

ExtraKeys = tuple[tuple[Any, ...], ...]
Seed = bytes | str | int | None


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


def _seed_bytes(seed: Seed) -> bytes:
    if seed is None:
        return DEFAULT_SEED
    if isinstance(seed, bytes):
        return seed
    if isinstance(seed, str):
        return seed.encode()
    if isinstance(seed, int) and not isinstance(seed, bool):
        return str(seed).encode()
    raise InvalidArgumentError(f"hash seed must be bytes, str, int or None, got {type(seed).__name__}")


class BlockHasher:
    """One hash algorithm plus the root derived from a seed.

    ``hash_block(parent, token_ids, extra_keys)`` returns the chained hash of one full block;
    ``parent=None`` chains onto the root.
    """

    __slots__ = ("_hash", "_structs", "algorithm", "root")

    def __init__(self, algorithm: str = "xxh3_128", seed: Seed = None) -> None:
        self.algorithm = resolve_algorithm(algorithm)
        self._structs: dict[int, struct.Struct] = {}
        self._hash: Callable[[bytes, Sequence[int], ExtraKeys | None], bytes] = {
            "xxh3_128": self._hash_xxh3,
            "sha256": self._hash_sha256,
            "sha256_cbor": self._hash_sha256_cbor,
        }[self.algorithm]
        seed_b = _seed_bytes(seed)
        if self.algorithm == "xxh3_128":
            root = xxhash.xxh3_128_digest(b"kvcore-root\x00" + seed_b)
        elif self.algorithm == "sha256":
            root = hashlib.sha256(b"kvcore-root\x00" + seed_b).digest()
        else:
            root = hashlib.sha256(cbor2.dumps(["kvcore-root", seed_b], canonical=True)).digest()
        self.root = BlockHash(root)

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: ExtraKeys | None = None) -> BlockHash:
        """Hash one block chained onto ``parent`` (``None``: the root)."""
        return BlockHash(self._hash(self.root if parent is None else parent, token_ids, extra_keys))

    # -- algorithms -----------------------------------------------------------------------------
    def _pack(self, token_ids: Sequence[int]) -> bytes:
        n = len(token_ids)
        st = self._structs.get(n)
        if st is None:
            st = self._structs[n] = struct.Struct(f"<{n}I")
        try:
            return st.pack(*token_ids)
        except struct.error as exc:
            raise InvalidArgumentError(
                f"token ids must be integers in [0, 2**32): {exc} in {list(token_ids)[:8]}...") from None

    def _hash_xxh3(self, parent: bytes, token_ids: Sequence[int], extra: ExtraKeys | None) -> bytes:
        data = parent + self._pack(token_ids)
        if extra:
            data += cbor2.dumps(extra, canonical=True)
        return xxhash.xxh3_128_digest(data)

    def _hash_sha256(self, parent: bytes, token_ids: Sequence[int], extra: ExtraKeys | None) -> bytes:
        data = parent + self._pack(token_ids)
        if extra:
            data += cbor2.dumps(extra, canonical=True)
        return hashlib.sha256(data).digest()

    def _hash_sha256_cbor(self, parent: bytes, token_ids: Sequence[int],
                          extra: ExtraKeys | None) -> bytes:
        try:
            array("I", token_ids)
        except (OverflowError, TypeError):
            raise InvalidArgumentError(
                f"token ids must be integers in [0, 2**32): {list(token_ids)[:8]}...") from None
        return hashlib.sha256(
            cbor2.dumps([parent, list(token_ids), list(extra) if extra else None], canonical=True)
        ).digest()


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


class RequestBlockHasher:
    """Computes the hashes of a request's newly completed full blocks.

    ``hasher(request)`` returns the hashes of full blocks past ``len(request.block_hashes)``;
    partial blocks are never hashed.  A :class:`kvcore.request.Request` built with a block hasher
    calls it at construction and whenever output tokens are appended.
    """

    __slots__ = ("block_size", "hasher")

    def __init__(self, block_size: int, hasher: BlockHasher | None = None) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.hasher = hasher if hasher is not None else BlockHasher()

    def __call__(self, request: KVRequest) -> list[BlockHash]:
        bs = self.block_size
        hashes = request.block_hashes
        start = len(hashes) * bs
        num_tokens = request.num_tokens
        if start + bs > num_tokens:
            return []
        tokens = request.all_token_ids
        hash_block = self.hasher.hash_block
        parent = hashes[-1] if hashes else None
        plain = (request.lora_name is None and not request.mm_items
                 and request.cache_salt is None)
        out: list[BlockHash] = []
        while start + bs <= num_tokens:
            end = start + bs
            extra = None if plain else block_extra_keys(request, start, end)
            parent = hash_block(parent, tokens[start:end], extra)
            out.append(parent)
            start = end
        return out


class BlockHashView(Sequence[BlockHash]):
    """A request's hashes seen at a coarser block size.

    Hashes are computed every ``hash_block_size`` tokens and each one chains over the whole
    prefix, so the hash of a ``scale * hash_block_size`` block is simply the fine hash at its last
    boundary: view[i] = hashes[(i + 1) * scale - 1].  The view is live (it follows the list).
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


def hashes_at(hashes: Sequence[BlockHash], hash_block_size: int,
              block_size: int) -> Sequence[BlockHash]:
    """``hashes`` (one per ``hash_block_size`` tokens) seen at ``block_size``."""
    if block_size == hash_block_size:
        return hashes
    return BlockHashView(hashes, block_size // hash_block_size)
