"""SGLang's page hashes, computed the way SGLang 0.5.23 computes them, without SGLang.

Every page of ``page_size`` tokens gets a SHA-256 digest chained on the digest of the page before
it: ``sha256(prior_digest + page)``, the page packed as little-endian uint32 token ids, or as
uint64 ids after a ``0xff`` byte when one of its ids does not fit in 32 bits.  Two chains:

* the *storage* chain (SGLang's ``hash_value``): the first page's prior digest is SGLang's
  namespace seed of ``(extra_key, cache_salt)``, none without a namespace.  The backend keys its
  pages by these full 32-byte digests: a page's key names its namespace and its whole prefix.
* the *event* chain (``event_hash_value``): seeded only by ``cache_salt`` (SGLang's legacy salt
  seed), the storage chain itself for a page without a namespace.  SGLang's event recorder turns
  its digests into the int64 block hashes of ``BlockStored`` / ``BlockRemoved``.

This module does not import SGLang; the tests check it against SGLang's own functions.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kvcore.errors import InvalidArgumentError

Namespace = tuple[str | None, str | None]
"""A request's ``(extra_key, cache_salt)``; ``(None, None)`` is no namespace."""

_U32_MAX = 0xFFFFFFFF


def storage_seed(namespace: Namespace) -> bytes | None:
    """The storage chain's prior digest for the first page of ``namespace``."""
    if namespace == (None, None):
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in namespace:
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def event_seed(namespace: Namespace) -> bytes | None:
    """The event chain's prior digest for the first page of ``namespace``."""
    cache_salt = namespace[1]
    if cache_salt is None:
        return None
    return hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).digest()


def page_digest(prior: bytes | None, tokens: Sequence[int]) -> bytes:
    """The digest of one page of ``tokens`` chained on ``prior`` (``None`` for a chain's first
    page without a seed)."""
    n = len(tokens)
    try:
        if max(tokens, default=0) > _U32_MAX:
            body = b"\xff" + struct.pack(f"<{n}Q", *tokens)
        else:
            body = struct.pack(f"<{n}I", *tokens)
    except struct.error:
        raise InvalidArgumentError(f"token ids must be non-negative int64s, got a page of "
                                   f"{list(tokens)[:8]!r}") from None
    digest = hashlib.sha256(prior) if prior is not None else hashlib.sha256()
    digest.update(body)
    return digest.digest()
