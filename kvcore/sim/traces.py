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
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcore.errors import InvalidArgumentError

MOONCAKE_BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MOONCAKE_SYNTHETIC = "mooncake-synthetic"
"""The built-in name of the Mooncake trace shipped with the package
(``kvcore/data/mooncake/synthetic_trace.jsonl``, package data: in a clone and in every install)."""
_SHIPPED = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"


class _RecordError(Exception):
    """A malformed trace record (internal: :func:`load_mooncake` adds the path and line)."""


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
    session_id: str | None = None  # the conversation it continues (a retention hint)

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


def _show(value: object) -> str:
    """``value`` as it reads in JSON, on one line and shortened (for error messages)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_field(rec: dict[str, Any], name: str, minimum: int) -> int:
    value = rec[name]
    if type(value) is not int or value < minimum:  # bool and float (even 5.0) are not lengths
        raise _RecordError(f"{name} must be an integer >= {minimum}, got {_show(value)}")
    return value


def _parse_record(text: str, max_model_len: int | None = None
                  ) -> tuple[float, int, int, tuple[int, ...]]:
    """``(timestamp, input_length, output_length, hash_ids)`` of one JSONL record, or
    :class:`_RecordError` saying which field is wrong and how (a request longer than
    ``max_model_len`` included)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _RecordError(f"malformed record: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise _RecordError("malformed record: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer over Python's digit limit
        raise _RecordError(f"malformed record: invalid JSON ({exc})") from None
    if not isinstance(rec, dict):
        raise _RecordError(f"malformed record: expected a JSON object, got {_show(rec)}")
    missing = [k for k in _FIELDS if k not in rec]
    if missing:
        raise _RecordError(f"malformed record: missing field {', '.join(map(repr, missing))}")
    ts = rec["timestamp"]
    if type(ts) is int:
        try:
            ts = float(ts)
        except OverflowError:
            raise _RecordError(f"timestamp {_show(ts)} is too large") from None
    if type(ts) is not float or not math.isfinite(ts) or ts < 0:
        raise _RecordError(f"timestamp must be a finite number >= 0 (ms), got {_show(ts)}")
    n_in = _int_field(rec, "input_length", 1)
    n_out = _int_field(rec, "output_length", 0)
    ids = rec["hash_ids"]
    if type(ids) is not list:
        raise _RecordError(f"hash_ids must be a list of integers, got {_show(ids)}")
    if not all(type(h) is int for h in ids):
        i, bad = next((i, h) for i, h in enumerate(ids) if type(h) is not int)
        raise _RecordError(f"hash_ids[{i}] must be an integer, got {_show(bad)}")
    need = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != need:
        raise _RecordError(f"hash_ids: input_length {n_in} needs {need} hash ids (one per "
                           f"{MOONCAKE_BLOCK_TOKENS} tokens), got {len(ids)}")
    # The replay generates at least one token (max_tokens = max(output_length, 1)).
    if max_model_len is not None and n_in + max(n_out, 1) > max_model_len:
        raise _RecordError(f"request of {n_in:,} prompt + {n_out:,} output tokens is longer than "
                           f"the model length (max_model_len {max_model_len:,})")
    return ts, n_in, n_out, tuple(ids)


def load_mooncake(path: str | Path, *, limit: int | None = None, vocab_size: int = 32_000,
                  seed: int = 0, max_model_len: int | None = None) -> list[TraceRequest]:
    """Load a Mooncake trace: UTF-8 JSONL, one object per line with ``timestamp`` (arrival, ms,
    a finite number >= 0), ``input_length`` (an integer >= 1), ``output_length`` (an integer
    >= 0) and ``hash_ids`` (integers, exactly ``ceil(input_length / 512)`` of them); other keys
    are ignored, blank lines skipped.  Requests come back in file order: timestamps need not be
    monotone (:func:`~kvcore.sim.replay.replay` sorts by arrival).  ``path`` may be the built-in
    name :data:`MOONCAKE_SYNTHETIC` (``"mooncake-synthetic"``): the shipped trace.  With
    ``max_model_len``, a request whose prompt plus output (at least one token) is longer is a
    malformed record, refused before any of its tokens is made.

    Raises :class:`InvalidArgumentError` for a missing, unreadable or empty file, and for the
    first malformed record, as ``<path>:<line>: <what is wrong>`` (one line; physical lines
    counted from 1, blank ones included)."""
    if isinstance(path, str) and not path.strip():
        raise InvalidArgumentError("trace file path is empty")
    if max_model_len is not None and (type(max_model_len) is not int or max_model_len < 2):
        raise InvalidArgumentError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    path = resolve_trace(path)
    if not path.is_file():
        if path.is_dir():
            raise InvalidArgumentError(f"trace file is a directory: {path}")
        if path.exists():
            raise InvalidArgumentError(f"trace file is not a regular file: {path}")
        raise InvalidArgumentError(f"trace file not found: {path}")
    source = HashIdTokens(MOONCAKE_BLOCK_TOKENS, vocab_size, seed)
    out: list[TraceRequest] = []
    try:
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InvalidArgumentError(
                        f"{path}:{lineno}: malformed record: invalid UTF-8 (byte "
                        f"0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
                if lineno == 1:  # a byte-order mark is tolerated at the start of the file
                    line = line.removeprefix("\ufeff")
                if not line.strip():
                    continue
                try:
                    ts, n_in, n_out, ids = _parse_record(line, max_model_len)
                except _RecordError as exc:
                    raise InvalidArgumentError(f"{path}:{lineno}: {exc}") from None
                out.append(TraceRequest(f"mc{len(out)}", ts, n_in, n_out, hash_ids=ids,
                                        source=source))
                if limit is not None and len(out) >= limit:
                    break
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot read trace file {path}: {exc.strerror or exc}") from None
    if not out:
        raise InvalidArgumentError(f"{path}: the trace has no requests")
    return out


def default_trace_path() -> Path | None:
    """The shipped Mooncake trace, if present: ``$KVCORE_MOONCAKE_TRACE``, else the package's
    own copy (``kvcore/data/mooncake/``, installed with kvcore: found from any directory)."""
    env = os.environ.get("KVCORE_MOONCAKE_TRACE")
    if env:
        return Path(env) if Path(env).is_file() else None
    return _SHIPPED if _SHIPPED.is_file() else None


def resolve_trace(trace: str | Path) -> Path:
    """``trace`` as a path: the built-in name :data:`MOONCAKE_SYNTHETIC` stands for the shipped
    trace (:func:`default_trace_path`); anything else is a path, checked by the loader."""
    if trace != MOONCAKE_SYNTHETIC:
        return Path(trace)
    path = default_trace_path()
    if path is None:
        where = os.environ.get("KVCORE_MOONCAKE_TRACE")
        raise InvalidArgumentError(
            f"{MOONCAKE_SYNTHETIC}: the shipped trace is not at $KVCORE_MOONCAKE_TRACE={where}"
            if where else
            f"{MOONCAKE_SYNTHETIC}: the shipped trace ({_SHIPPED}) is missing from this kvcore "
            "install (set KVCORE_MOONCAKE_TRACE to a copy)")
    return path
