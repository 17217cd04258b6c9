"""KV-cache-manager request cycles, identical for kvcore and vLLM (``--impl kvcore|vllm``).

One cycle = ``get_computed_blocks`` -> ``allocate_slots`` (the prompt) ->
``record_prefix_cache_stats`` -> ``D`` decode steps
(append a token, ``allocate_slots(request, 1)``) -> ``free``, for requests run one after another
through one manager (block size 16, 4096 blocks, so the prefix cache fills up and allocation
evicts, as in steady state).  Request objects (and their prompt hashes) are built before the
clock starts on both sides; hashing of decode-time blocks is timed on both.  Both use xxh3-128
hashing (vLLM: ``xxhash``).  Prints JSON with the median over repeats of µs per cycle.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
MAX_MODEL_LEN = 8192
WINDOW = 64

# name -> (groups, caching, prompt kind, decode steps, kvcore verify_hits)
SCENARIOS: dict[str, tuple[tuple[str, ...], bool, str, int, bool]] = {
    "caching off, 128-token prompts": (("full",), False, "unique", 0, False),
    "unique 128-token prompts": (("full",), True, "unique", 0, False),
    "96 shared + 32 unique tokens": (("full",), True, "shared", 0, False),
    "96 shared + 32 unique, kvcore verify_hits": (("full",), True, "shared", 0, True),
    "128-token prompt + 32 decode steps": (("full",), True, "unique", 32, False),
    "128 + 32 decode, kvcore verify_hits": (("full",), True, "unique", 32, True),
    "hybrid full + SWA(64), 96 shared + 32 unique, 32 decode": (("full", "swa"), True, "shared",
                                                                32, False),
    "hybrid, kvcore verify_hits": (("full", "swa"), True, "shared", 32, True),
}
"""vLLM has no hit verification: in the verify_hits scenarios it runs the same cycles
unverified, so the ratio is what kvcore's proof of every hit costs against vLLM's trust in the
hash."""


def prompts(kind: str, n: int, rng: random.Random) -> list[list[int]]:
    shared = [rng.randrange(1, 50_000) for _ in range(96)]
    out = []
    for _ in range(n):
        if kind == "shared":
            out.append(shared + [rng.randrange(1, 50_000) for _ in range(32)])
        else:
            out.append([rng.randrange(1, 50_000) for _ in range(128)])
    return out


class _Side:
    """One implementation under test; ``lookup`` returns (hit blocks, hit tokens)."""

    manager: Any

    def __init__(self, groups: tuple[str, ...], caching: bool, verify: bool = False) -> None:
        raise NotImplementedError

    def make_request(self, rid: str, tokens: list[int]) -> Any:
        raise NotImplementedError

    def lookup(self, req: Any) -> tuple[Any, int]:
        raise NotImplementedError

    def cycle_fn(self) -> Callable[[Any, int], None]:
        m, lookup = self.manager, self.lookup

        def cycle(req: Any, decode_steps: int) -> None:
            blocks, hit = lookup(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
                raise RuntimeError("allocation failed")
            m.record_prefix_cache_stats(req, hit)  # as a scheduler does after admission
            req.num_computed_tokens = req.num_tokens
            for t in range(decode_steps):
                req.append_output_token_ids(t)
                m.allocate_slots(req, 1)
                req.num_computed_tokens += 1
            m.free(req)

        return cycle


class KvcoreSide(_Side):
    def __init__(self, groups: tuple[str, ...], caching: bool, verify: bool = False) -> None:
        import torch

        from kvcore.manager import KVCacheManager
        from kvcore.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

        common = dict(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16)
        specs = [FullAttentionSpec(**common) if g == "full"  # type: ignore[arg-type]
                 else SlidingWindowSpec(sliding_window=WINDOW, **common)  # type: ignore[arg-type]
                 for g in groups]
        config = KVCacheConfig(NUM_BLOCKS, tuple(KVCacheGroup((f"l{i}",), s)
                                                 for i, s in enumerate(specs)))
        self.manager = KVCacheManager(config, MAX_MODEL_LEN, enable_caching=caching,
                                      hash_algo="xxh3_128", verify_hits=verify)

    def make_request(self, rid: str, tokens: list[int]) -> Any:
        return self.manager.make_request(rid, tokens)

    def lookup(self, req: Any) -> tuple[Any, int]:
        return self.manager.get_computed_blocks(req)


class VllmSide(_Side):
    def __init__(self, groups: tuple[str, ...], caching: bool, verify: bool = False) -> None:
        import torch
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        common = dict(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16)
        specs = [FullAttentionSpec(**common) if g == "full"
                 else SlidingWindowSpec(sliding_window=WINDOW, **common) for g in groups]
        config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s)
                                                for i, s in enumerate(specs)])
        fn = get_hash_fn_by_name("xxhash")
        init_none_hash(fn)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, fn)
        self.manager = KVCacheManager(config, MAX_MODEL_LEN, scheduler_block_size=BLOCK_SIZE,
                                      hash_block_size=BLOCK_SIZE, enable_caching=caching,
                                      log_stats=True)
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._params = SamplingParams(max_tokens=64)
        self._request_cls = Request

    def make_request(self, rid: str, tokens: list[int]) -> Any:
        return self._request_cls(rid, tokens, self._params, None, block_hasher=self.hasher)

    def lookup(self, req: Any) -> tuple[Any, int]:
        blocks, hit, _ = self.manager.get_computed_blocks(req)  # vLLM 0.32 returns 3 values
        return blocks, hit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["kvcore", "vllm"], required=True)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    side_cls: type[_Side] = KvcoreSide if args.impl == "kvcore" else VllmSide
    out = []
    for name, (groups, caching, kind, decode_steps, verify) in SCENARIOS.items():
        samples = []
        for rep in range(args.repeats):
            side = side_cls(groups, caching, verify)
            rng = random.Random(rep)
            reqs = [side.make_request(f"r{i}", p)
                    for i, p in enumerate(prompts(kind, args.requests, rng))]
            cycle = side.cycle_fn()
            gc.collect()
            gc.disable()
            t0 = time.perf_counter_ns()
            for req in reqs:
                cycle(req, decode_steps)
            elapsed = time.perf_counter_ns() - t0
            gc.enable()
            samples.append(elapsed / 1e3 / len(reqs))
        out.append({"scenario": name, "us_per_cycle": statistics.median(samples),
                    "samples": samples, "decode_steps": decode_steps})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
