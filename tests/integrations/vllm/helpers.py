"""Builders shared by the vLLM integration tests: vLLM KV-cache configs, requests and a small
scripted scenario that both vLLM's ``KVCacheManager`` and kvcore's adapter can run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
from vllm.distributed.kv_events import KVEventBatch
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

from kvcore.integrations.vllm.manager import KVCacheManagerAdapter
from kvcore.integrations.vllm.settings import KvcoreSettings

_ENCODER = msgspec.msgpack.Encoder()


def full(block_size: int = 16, dtype: torch.dtype = torch.float16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=dtype)


def swa(window: int, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=32,
                             dtype=torch.float16, sliding_window=window)


def kv_config(*specs: Any, num_blocks: int = 64, **extra: Any) -> KVCacheConfig:
    specs = specs or (full(),)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s)
                                          for i, s in enumerate(specs)], **extra)


def hasher(block_size: int = 16) -> Callable[[Any], list[Any]]:
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(block_size, fn)


def request(rid: str, tokens: Sequence[int], block_size: int = 16, **kwargs: Any) -> Request:
    params = kwargs.pop("sampling_params", None) or SamplingParams(max_tokens=1000,
                                                                    ignore_eos=True)
    return Request(rid, list(tokens), params, None, block_hasher=hasher(block_size), **kwargs)


def managers(config: KVCacheConfig, *, block_size: int = 16, hash_block_size: int | None = None,
             settings: KvcoreSettings | None = None, **kwargs: Any
             ) -> tuple[KVCacheManager, KVCacheManagerAdapter]:
    """vLLM's manager and kvcore's adapter, built with the same arguments."""
    args: dict[str, Any] = dict(kv_cache_config=config, max_model_len=4096,
                                scheduler_block_size=block_size,
                                hash_block_size=hash_block_size or block_size,
                                enable_caching=True, log_stats=True, enable_kv_cache_events=True)
    args.update(kwargs)
    return KVCacheManager(**args), KVCacheManagerAdapter(**args, settings=settings)


def event_bytes(manager: Any) -> bytes:
    """The manager's pending events as vLLM's publisher would encode them (timestamp 0)."""
    return _ENCODER.encode(KVEventBatch(ts=0.0, events=manager.take_events()))


def admit(manager: Any, req: Request) -> tuple[int, Any]:
    """A scheduler's admission of a waiting request: lookup, allocate the rest, record."""
    blocks, hit, _ = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    assert new is not None
    manager.record_prefix_cache_stats(req, hit)
    req.num_computed_tokens = req.num_tokens
    return hit, new.get_block_ids()


def scenario(manager: Any, make: Callable[[str, list[int]], Request]) -> list[Any]:
    """Admit, decode, free, re-admit with a shared prefix, preempt, reset: everything a manager
    observably does, step by step (hits, block ids, tables, encoded events, stats)."""
    out: list[Any] = []
    a = make("a", list(range(40)))
    out.append(admit(manager, a))
    for t in range(30):
        a.append_output_token_ids(100 + t)
        new = manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        out.append(new.get_block_ids())
    out.append(event_bytes(manager))
    b = make("b", [*range(36), 7, 7, 7, 7, 7])
    out.append(admit(manager, b))
    manager.free(a)
    out.append((manager.get_block_ids("b"), event_bytes(manager)))
    c = make("c", [*range(40), *range(100, 130), 5])
    out.append(admit(manager, c))
    manager.free(b)
    b.num_computed_tokens = 0
    b.num_preemptions += 1
    out.append(admit(manager, b))
    manager.free(b)
    manager.free(c)
    stats = manager.make_prefix_cache_stats()
    out.append((stats.requests, stats.queries, stats.hits, stats.preempted_requests,
                stats.preempted_queries, stats.preempted_hits))
    out.append((manager.reset_prefix_cache(), event_bytes(manager)))
    return out
