"""Request block-hashing throughput, identical for kvcore and vLLM (run in a benchmark worker).

For each algorithm and block size, a request of ``num_tokens`` random token ids (the same ids
on both sides) is built with no hashes, and the request block hasher (kvcore's
``RequestBlockHasher``, vLLM's ``get_request_block_hasher``) is timed computing all its
full-block hashes, in thread CPU time with the GC off.  Request construction is not timed.
Algorithms are paired by role: kvcore's xxh3_128 with vLLM's ``xxhash`` (pickle + xxh3_128), and
sha256 / sha256_cbor with their namesakes.  One sample = one hashing of the whole request;
``units`` is its token count.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from .timing import Sample, cpu_timed

PAIRS = [("xxh3_128", "xxhash"), ("sha256", "sha256"), ("sha256_cbor", "sha256_cbor")]
DEFAULT_BLOCK_SIZES = "16,256"
DEFAULT_NUM_TOKENS = 1 << 16
_tokens: dict[int, list[int]] = {}


def kvcore_case(algorithm: str, block_size: int,
                tokens: list[int]) -> tuple[Callable[[Any], Any], Callable[[], Any]]:
    from kvcore.hashing import BlockHasher
    from kvcore.request import Request, RequestBlockHasher

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


def cases(impl: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    sizes = [int(x) for x in str(params.get("block_sizes", DEFAULT_BLOCK_SIZES)).split(",")]
    return [{"name": f"{ours} / block {bs}", "algorithm": ours, "peer_algorithm": theirs,
             "block_size": bs} for ours, theirs in PAIRS for bs in sizes]


def measure(impl: str, case: str, params: dict[str, Any], repeat: int,
            warmup: bool = False) -> Sample:
    by_name = {c["name"]: c for c in cases(impl, params)}
    if case not in by_name:
        raise KeyError(f"unknown hashing case {case!r}")
    c = by_name[case]
    num_tokens = int(params.get("num_tokens", DEFAULT_NUM_TOKENS))
    if num_tokens not in _tokens:
        rng = random.Random(0)
        _tokens[num_tokens] = [rng.randrange(0, 150_000) for _ in range(num_tokens)]
    tokens = _tokens[num_tokens]
    make_case = kvcore_case if impl == "kvcore" else vllm_case
    algorithm = c["algorithm"] if impl == "kvcore" else c["peer_algorithm"]
    hasher, make_request = make_case(algorithm, c["block_size"], tokens)
    req = make_request()

    def run() -> dict[str, Any]:
        return {"blocks": len(hasher(req))}

    sample = cpu_timed(run, num_tokens)
    if sample["info"]["blocks"] != num_tokens // c["block_size"]:
        raise RuntimeError(f"{case}: {sample['info']['blocks']} hashes for {num_tokens} tokens")
    return sample
