"""Request block-hashing throughput, identical for kvcore and vLLM (``--impl kvcore|vllm``).

For each algorithm and block size, a request of ``--num-tokens`` random token ids is built with no
hashes, and the request block hasher (kvcore's ``RequestBlockHasher``, vLLM's
``get_request_block_hasher``) is timed computing all its full-block hashes.  Request construction
is not timed.  Algorithms are paired by role: kvcore's xxh3_128 with vLLM's ``xxhash`` (pickle +
xxh3_128), and sha256 / sha256_cbor with their namesakes.  Prints JSON to stdout.
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

PAIRS = [("xxh3_128", "xxhash"), ("sha256", "sha256"), ("sha256_cbor", "sha256_cbor")]


def kvcore_case(algorithm: str, block_size: int,
                tokens: list[int]) -> tuple[Callable[[Any], Any], Callable[[], Any]]:
    from kvcore.hashing import BlockHasher, RequestBlockHasher
    from kvcore.request import Request

    hasher = RequestBlockHasher(block_size, BlockHasher(algorithm))
    return hasher, lambda: Request("bench", tokens)


def vllm_case(algorithm: str, block_size: int,
              tokens: list[int]) -> tuple[Callable[[Any], Any], Callable[[], Any]]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algorithm)
    init_none_hash(fn)
    hasher = get_request_block_hasher(block_size, fn)
    params = SamplingParams(max_tokens=1)
    return hasher, lambda: Request("bench", tokens, params, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["kvcore", "vllm"], required=True)
    ap.add_argument("--block-sizes", default="16,256")
    ap.add_argument("--num-tokens", type=int, default=1 << 16)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(0, 150_000) for _ in range(args.num_tokens)]
    out = []
    for ours, theirs in PAIRS:
        for bs in (int(x) for x in args.block_sizes.split(",")):
            case = kvcore_case if args.impl == "kvcore" else vllm_case
            hasher, make_request = case(ours if args.impl == "kvcore" else theirs, bs, tokens)
            samples = []
            for _ in range(args.repeats):
                req = make_request()
                gc.disable()
                t0 = time.perf_counter_ns()
                hashes = hasher(req)
                dt = time.perf_counter_ns() - t0
                gc.enable()
                assert len(hashes) == args.num_tokens // bs
                samples.append(args.num_tokens / (dt / 1e9))
            out.append({"algorithm": ours, "peer_algorithm": theirs, "block_size": bs,
                        "tokens_per_s": statistics.median(samples), "samples": samples})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
