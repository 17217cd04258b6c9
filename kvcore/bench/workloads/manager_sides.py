"""The two implementations under test, behind one small interface, for ``manager_cycle``.

A side builds a KV-cache manager for a list of groups (``"full"`` or a sliding-window size in
tokens, block size 16, 8 KV heads x 128, fp16: every group has the same page size, as vLLM's
grouping makes them) and exposes exactly what the timed loops call:

* ``manager``: the manager (``allocate_slots``, ``record_prefix_cache_stats``, ``free``);
* ``lookup(request)``: ``manager.get_computed_blocks`` (kvcore returns (blocks, hit tokens);
  vLLM 0.32 returns (blocks, hit tokens, shared-prefix boundary); the loops read items 0 and 1);
* ``hash_request(request)``: compute and store the block hashes of a request built unhashed.

Both sides hash with xxh3-128 (kvcore ``xxh3_128``, vLLM ``xxhash``).  Only the side asked for is
imported, so this module loads under either interpreter.

``eviction_policy`` picks kvcore's pool policy; it is passed only when it is not ``"lru"`` (the
default), so a kvcore without eviction policies (an older ``--baseline`` tree) still runs the LRU
scenarios, and raises :class:`Unsupported` for the others.  vLLM has LRU only and ignores it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

BLOCK_SIZE = 16
Group = str | int
"""``"full"`` or a sliding window in tokens."""


class Unsupported(Exception):
    """The kvcore under test lacks what the scenario needs (e.g. an older tree without eviction
    policies): the scenario is skipped for it, not failed."""


class Side:
    manager: Any
    lookup: Callable[[Any], Any]
    _hasher: Callable[[Any], list[Any]]

    def make_request(self, rid: str, tokens: list[int], hashed: bool) -> Any:
        raise NotImplementedError

    def hash_request(self, request: Any) -> None:
        request.block_hashes.extend(self._hasher(request))


def _spec_args() -> dict[str, Any]:
    import torch

    return {"block_size": BLOCK_SIZE, "num_kv_heads": 8, "head_size": 128,
            "dtype": torch.float16}


class KvcoreSide(Side):
    def __init__(self, groups: Sequence[Group], num_blocks: int, max_model_len: int,
                 caching: bool, verify: bool, eviction_policy: str = "lru") -> None:
        from kvcore.manager import KVCacheManager
        from kvcore.request import Request
        from kvcore.specs import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroup,
            KVCacheSpec,
            SlidingWindowSpec,
        )

        common = _spec_args()
        specs: list[KVCacheSpec] = [
            FullAttentionSpec(**common) if g == "full"
            else SlidingWindowSpec(sliding_window=int(g), **common) for g in groups]
        config = KVCacheConfig(num_blocks, tuple(KVCacheGroup((f"l{i}",), s)
                                                 for i, s in enumerate(specs)))
        extra: dict[str, Any] = {}
        if eviction_policy != "lru":
            extra["eviction_policy"] = eviction_policy
        try:
            self.manager = KVCacheManager(config, max_model_len, enable_caching=caching,
                                          hash_algo="xxh3_128", verify_hits=verify, **extra)
        except (TypeError, ValueError) as exc:
            if extra and ("eviction_policy" in str(exc) or "eviction policy" in str(exc)):
                raise Unsupported(f"this kvcore has no eviction policy {eviction_policy!r} "
                                  f"({type(exc).__name__}: {exc})") from None
            raise
        self.lookup = self.manager.get_computed_blocks
        self._hasher = self.manager.block_hasher
        self._request = Request

    def make_request(self, rid: str, tokens: list[int], hashed: bool) -> Any:
        if hashed:
            return self.manager.make_request(rid, tokens)
        return self._request(rid, tokens)


class VllmSide(Side):
    def __init__(self, groups: Sequence[Group], num_blocks: int, max_model_len: int,
                 caching: bool, verify: bool, eviction_policy: str = "lru") -> None:
        # vLLM has no hit verification: with ``verify`` it runs the same cycles unverified; and
        # one eviction policy, LRU, whatever ``eviction_policy`` says.
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        common = _spec_args()
        specs = [FullAttentionSpec(**common) if g == "full"
                 else SlidingWindowSpec(sliding_window=int(g), **common) for g in groups]
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s)
                                                for i, s in enumerate(specs)])
        fn = get_hash_fn_by_name("xxhash")
        init_none_hash(fn)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, fn)
        self.manager = KVCacheManager(config, max_model_len, scheduler_block_size=BLOCK_SIZE,
                                      hash_block_size=BLOCK_SIZE, enable_caching=caching,
                                      log_stats=True)
        self.lookup = self.manager.get_computed_blocks
        self._params = SamplingParams(max_tokens=max_model_len)
        self._request = Request

    def make_request(self, rid: str, tokens: list[int], hashed: bool) -> Any:
        return self._request(rid, tokens, self._params, None,
                             block_hasher=self._hasher if hashed else None)


def make_side(impl: str, groups: Sequence[Group], num_blocks: int, max_model_len: int,
              caching: bool, verify: bool, eviction_policy: str = "lru") -> Side:
    cls: type[KvcoreSide] | type[VllmSide] = KvcoreSide if impl == "kvcore" else VllmSide
    return cls(groups, num_blocks, max_model_len, caching, verify, eviction_policy)
