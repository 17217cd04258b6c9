"""Request traces for replay and policy simulation.

A :class:`TraceRequest` is what arrives when, how long its prompt is and how many tokens it
generates.  Its prompt is either explicit token ids (synthetic workloads) or, for the Mooncake
format, a chain of *hash ids*, one per 512-token block (equal ids mean an equal prefix up to and
including that block).  :class:`HashIdTokens` turns a hash id into a deterministic block of token
ids, so equal ids give equal tokens and the real manager can re-split them into its own block
size and hash them.  Prompts are materialised one request at a time (the shipped trace holds 61M
prompt tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcore.errors import InvalidArgumentError

MOONCAKE_BLOCK_TOKENS = 512


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic, identical on every platform)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class HashIdTokens:
    """Deterministic token ids for hash-id blocks: ``block(h)`` is ``block_tokens`` ids in
    ``[0, vocab_size)`` derived from ``(seed, h)`` only.  Blocks are memoised."""

    def __init__(self, block_tokens: int = MOONCAKE_BLOCK_TOKENS, vocab_size: int = 32_000,
                 seed: int = 0) -> None:
        if block_tokens <= 0 or vocab_size <= 1:
            raise InvalidArgumentError("block_tokens must be > 0 and vocab_size > 1")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._offsets = np.arange(block_tokens, dtype=np.uint64)
        self._cache: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        arr = self._cache.get(hash_id)
        if arr is None:
            with np.errstate(over="ignore"):
                base = np.uint64((self.seed * 0x100000001B3 + hash_id * 1_000_003) & (2**64 - 1))
                mixed = _splitmix64(base * np.uint64(1 << 20) + self._offsets)
            arr = (mixed % np.uint64(self.vocab_size)).astype(np.int64)
            self._cache[hash_id] = arr
        return arr

    def tokens(self, hash_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The first ``num_tokens`` tokens of the concatenated blocks."""
        if not hash_ids:
            return []
        return np.concatenate([self.block(h) for h in hash_ids])[:num_tokens].tolist()


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    request_id: str
    arrival_ms: float
    num_prompt_tokens: int
    output_len: int
    prompt: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    source: HashIdTokens | None = field(default=None, compare=False, repr=False)

    def prompt_token_ids(self) -> list[int]:
        if self.prompt is not None:
            return list(self.prompt)
        if self.hash_ids is None or self.source is None:
            raise InvalidArgumentError(f"request {self.request_id} has neither tokens nor hash ids")
        return self.source.tokens(self.hash_ids, self.num_prompt_tokens)

    def block_keys(self, block_size: int) -> list[object]:
        """One key per *full* prompt block at ``block_size``: equal keys mean equal prefixes.

        Hash-id prompts use (hash id, sub-block) when ``block_size`` divides the hash-id block
        (no tokens needed); otherwise keys are chained hashes of the token ids.
        """
        n = self.num_prompt_tokens // block_size
        if self.hash_ids is not None and self.source is not None:
            bt = self.source.block_tokens
            if bt % block_size == 0:
                per = bt // block_size
                return [(self.hash_ids[i // per], i % per) for i in range(n)]
        from kvcore.hashing import BlockHasher

        hasher = BlockHasher()
        tokens = self.prompt_token_ids()
        keys: list[object] = []
        parent = None
        for i in range(n):
            parent = hasher.hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
            keys.append(parent)
        return keys


def load_mooncake(path: str | Path, *, limit: int | None = None, vocab_size: int = 32_000,
                  seed: int = 0) -> list[TraceRequest]:
    """Load a Mooncake trace (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``,
    ``hash_ids``).  Raises :class:`InvalidArgumentError` naming the line of a malformed record."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"trace file not found: {path}")
    source = HashIdTokens(MOONCAKE_BLOCK_TOKENS, vocab_size, seed)
    out: list[TraceRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts, n_in, n_out = float(rec["timestamp"]), int(rec["input_length"]), int(rec["output_length"])
                ids = tuple(int(h) for h in rec["hash_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgumentError(f"{path}:{lineno}: malformed record ({exc})") from None
            if n_in <= 0 or n_out < 0 or len(ids) != -(-n_in // MOONCAKE_BLOCK_TOKENS):
                raise InvalidArgumentError(
                    f"{path}:{lineno}: input_length {n_in} needs {-(-n_in // MOONCAKE_BLOCK_TOKENS)} "
                    f"hash ids, got {len(ids)}")
            out.append(TraceRequest(f"mc{len(out)}", ts, n_in, n_out, hash_ids=ids, source=source))
            if limit is not None and len(out) >= limit:
                break
    return out


def default_trace_path() -> Path | None:
    """The shipped Mooncake trace, if present: ``$KVCORE_MOONCAKE_TRACE``, else
    ``../shared/data/mooncake/synthetic_trace.jsonl`` beside the working directory or the
    repository."""
    env = os.environ.get("KVCORE_MOONCAKE_TRACE")
    if env:
        return Path(env) if Path(env).is_file() else None
    here = Path(__file__).resolve()
    for base in (Path.cwd(), here.parents[2]):
        p = base.parent / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"
        if p.is_file():
            return p
    return None


def iter_prompts(requests: Sequence[TraceRequest]) -> Iterator[list[int]]:
    for r in requests:
        yield r.prompt_token_ids()
