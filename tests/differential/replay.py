"""Replay operation traces through a KV-cache manager and record what it does.

Run as a script in either implementation's environment::

    python replay.py --impl vllm   < traces.json > observations.json   (vLLM's own venv)
    python replay.py --impl kvcore < traces.json > observations.json

or import :func:`replay_all` (kvcore side, in-process).  The module imports only the
implementation under test, so it runs in the vLLM peer venv without kvcore.

A trace is ``{"config": {...}, "ops": [...]}``; ops act on requests by id, the way a scheduler
does:

    add      {rid, prompt}          create the request
    admit    {rid, chunk}           get_computed_blocks + allocate_slots(min(chunk, rest))
    step     {rid, chunk, token}    running request: next prefill chunk, or (prompt done) append
                                    ``token`` and allocate one decode slot
    free     {rid}                  finished
    preempt  {rid}                  free, num_computed_tokens = 0, num_preemptions += 1
    reset    {}                     reset_prefix_cache()

After every op the observation records the op's result (hit tokens and hit block ids, the new
block ids or None, the request's block table) and the whole free queue in eviction order.

One deliberate difference: when vLLM's ``allocate_slots`` returns ``None`` for a running request
it has already released the request's out-of-window blocks; kvcore's changes nothing.  The
kvcore side then calls ``remove_skipped_blocks`` itself, so the two stay comparable.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _ids(groups: Any) -> list[list[int]] | None:
    if groups is None:
        return None
    return [[b.block_id for b in g] for g in groups]


def _specs(cfg: dict[str, Any], full: Any, swa: Any, chunked: Any) -> list[Any]:
    """The trace's groups as specs of either implementation (the classes are passed in)."""
    import torch

    out = []
    for g in cfg["groups"]:
        common = dict(block_size=g["block_size"], num_kv_heads=1, head_size=8, dtype=torch.float16)
        if g["type"] == "full":
            out.append(full(**common))
        elif g["type"] == "swa":
            out.append(swa(sliding_window=g["window"], **common))
        else:
            out.append(chunked(attention_chunk_size=g["chunk"], **common))
    return out


class KvcoreImpl:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from kvcore.manager import KVCacheManager
        from kvcore.specs import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroup,
            SlidingWindowSpec,
        )

        specs = _specs(cfg, FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
        groups = [KVCacheGroup((f"layer{i}",), spec) for i, spec in enumerate(specs)]
        self.m = KVCacheManager(KVCacheConfig(cfg["num_blocks"], tuple(groups)),
                                cfg["max_model_len"], enable_caching=cfg.get("caching", True))

    def make_request(self, rid: str, prompt: list[int]) -> Any:
        return self.m.make_request(rid, prompt)

    def get_computed_blocks(self, req: Any) -> tuple[Any, int]:
        return self.m.get_computed_blocks(req)

    def allocate(self, req: Any, n: int, hit: int = 0, blocks: Any = None) -> Any:
        out = self.m.allocate_slots(req, n, hit, blocks)
        if out is None and req.request_id in self.m.requests():
            self.m.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        return out

    def free(self, req: Any) -> None:
        self.m.free(req)

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(x) for x in self.m.get_block_ids(rid)]

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.pool.free_queue]

    def reset(self) -> bool:
        return self.m.reset_prefix_cache()


class VllmImpl:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import math

        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        specs = _specs(cfg, FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
        groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
        sizes = [g["block_size"] for g in cfg["groups"]]
        hash_bs, sched_bs = math.gcd(*sizes), math.lcm(*sizes)
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        self.hasher = get_request_block_hasher(hash_bs, fn)
        self.m = KVCacheManager(KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
                                              kv_cache_groups=groups),
                                cfg["max_model_len"], scheduler_block_size=sched_bs,
                                hash_block_size=hash_bs, enable_caching=cfg.get("caching", True))
        self._params = SamplingParams(max_tokens=1 << 20)
        self._request_cls = Request

    def make_request(self, rid: str, prompt: list[int]) -> Any:
        return self._request_cls(rid, prompt, self._params, None, block_hasher=self.hasher)

    def get_computed_blocks(self, req: Any) -> tuple[Any, int]:
        blocks, hit, _ = self.m.get_computed_blocks(req)
        return blocks.blocks, hit

    def allocate(self, req: Any, n: int, hit: int = 0, blocks: Any = None) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        wrapped = None if blocks is None else KVCacheBlocks(tuple(blocks))
        if wrapped is not None and not any(blocks):
            wrapped = self.m.empty_kv_cache_blocks
        out = self.m.allocate_slots(req, n, hit, wrapped)
        return None if out is None else out.blocks

    def free(self, req: Any) -> None:
        self.m.free(req)

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(x) for x in self.m.get_block_ids(rid)]

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.block_pool.free_block_queue.get_all_free_blocks()]

    def reset(self) -> bool:
        return bool(self.m.reset_prefix_cache())


def replay(impl: Any, trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one trace; return one observation per op.  An exception becomes the op's observation
    (``{"op", "error"}``) and ends the trace, so a divergence shows where it started."""
    requests: dict[str, Any] = {}
    obs: list[dict[str, Any]] = []
    for op in trace["ops"]:
        try:
            obs.append(_apply(impl, requests, op))
        except Exception as exc:  # a crash is an observation too
            obs.append({"op": op["op"], "error": f"{type(exc).__name__}: {exc}"})
            break
    return obs


def _apply(impl: Any, requests: dict[str, Any], op: dict[str, Any]) -> dict[str, Any]:
    kind = op["op"]
    o: dict[str, Any] = {"op": kind}
    rid = op.get("rid")
    if kind == "add":
        requests[rid] = impl.make_request(rid, op["prompt"])
    elif kind == "admit":
        req = requests[rid]
        blocks, hit = impl.get_computed_blocks(req)
        n = min(op["chunk"], req.num_tokens - hit)
        out = impl.allocate(req, n, hit, blocks)
        o.update(hit=hit, hit_blocks=_ids(blocks), new=_ids(out))
        if out is not None:
            req.num_computed_tokens = hit + n
            o["table"] = impl.block_ids(rid)
    elif kind == "step":
        req = requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            n = min(op["chunk"], req.num_tokens - req.num_computed_tokens)
        else:
            req.append_output_token_ids(op["token"])
            n = 1
        out = impl.allocate(req, n)
        o["new"] = _ids(out)
        if out is not None:
            req.num_computed_tokens += n
        o["table"] = impl.block_ids(rid)
    elif kind in ("free", "preempt"):
        req = requests[rid]
        impl.free(req)
        if kind == "preempt":
            req.num_computed_tokens = 0
            req.num_preemptions += 1
    elif kind == "reset":
        o["ok"] = impl.reset()
    else:
        raise ValueError(f"unknown op {kind!r}")
    o["free_queue"] = impl.free_queue()
    return o


def replay_all(impl_name: str, traces: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    cls = KvcoreImpl if impl_name == "kvcore" else VllmImpl
    return [replay(cls(t["config"]), t) for t in traces]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["kvcore", "vllm"], required=True)
    args = ap.parse_args()
    traces = json.load(sys.stdin)
    json.dump(replay_all(args.impl, traces), sys.stdout)


if __name__ == "__main__":
    main()
