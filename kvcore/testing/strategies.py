"""Hypothesis strategies for KV-cache tests (needs ``hypothesis``: ``pip install kvcore[testing]``).

* :func:`kv_configs`: small ``KVCacheConfig`` s of the attention types kvcore manages (full,
  sliding window, chunked local with chunk sizes that need not be multiples of the block size,
  Mamba, hybrids), pools small enough that allocations fail and blocks get evicted;
* :func:`prompts`: token lists that share prefixes (a few families over a tiny vocabulary, so
  equal blocks also appear at other positions), with lengths near block boundaries;
* :func:`request_streams`: lists of :class:`RequestSpec` (prompt, output length, cache salt).
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st

from kvcore.specs import KVCacheConfig, KVCacheGroup, KVCacheSpec
from kvcore.testing.setups import chunked, full, mamba, swa

SPEC_KINDS = ("full", "swa", "chunked", "mamba", "hybrid", "hybrid-chunked")


def _specs(kind: str, block_size: int, window: int, chunk: int) -> tuple[KVCacheSpec, ...]:
    return {
        "full": (full(block_size),),
        "swa": (swa(window, block_size),),
        "chunked": (chunked(chunk, block_size),),
        "mamba": (full(block_size), mamba(block_size)),
        "hybrid": (full(block_size), swa(window, block_size)),
        "hybrid-chunked": (full(block_size), chunked(chunk, block_size)),
    }[kind]


@st.composite
def kv_configs(draw: st.DrawFn, kinds: tuple[str, ...] = SPEC_KINDS,
               block_sizes: tuple[int, ...] = (2, 4, 8)) -> KVCacheConfig:
    """A small config: one of ``kinds`` at one of ``block_sizes``, 16–64 blocks."""
    kind = draw(st.sampled_from(kinds))
    bs = draw(st.sampled_from(block_sizes))
    specs = _specs(kind, bs, window=draw(st.integers(2, 4 * bs)),
                   chunk=draw(st.integers(bs, 4 * bs)))
    num_blocks = draw(st.integers(16, 64)) * len(specs)
    return KVCacheConfig(num_blocks, tuple(KVCacheGroup((f"layer{i}",), s)
                                           for i, s in enumerate(specs)))


_FAMILIES = tuple(tuple((7 * f + 3 * i + i // 5) % 3 for i in range(48)) for f in range(3))


@st.composite
def prompts(draw: st.DrawFn, block_size: int = 4, max_len: int = 48) -> list[int]:
    """A prompt: a prefix of one of three shared families, then its own tail; lengths cluster
    around multiples of ``block_size`` (one token short, exact, one over)."""
    family = draw(st.sampled_from(_FAMILIES))
    blocks = draw(st.integers(0, max(1, max_len // block_size - 1)))
    length = max(1, min(max_len, blocks * block_size + draw(st.sampled_from((-1, 0, 1, 2)))))
    keep = draw(st.integers(0, length))
    tail = draw(st.lists(st.integers(0, 3), min_size=length - keep, max_size=length - keep))
    return list(family[:keep]) + tail


@dataclass(frozen=True)
class RequestSpec:
    """What a test submits: the prompt, how many tokens to generate, and an optional salt."""

    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None


@st.composite
def request_streams(draw: st.DrawFn, block_size: int = 4, max_len: int = 48,
                    max_requests: int = 12) -> list[RequestSpec]:
    """Requests with shared prefixes, a few salts (tenants) and short outputs."""
    n = draw(st.integers(1, max_requests))
    out = []
    for _ in range(n):
        prompt = draw(prompts(block_size, max_len - 8))
        out.append(RequestSpec(tuple(prompt), draw(st.integers(1, 6)),
                               draw(st.sampled_from((None, None, "tenant-a", "tenant-b")))))
    return out
