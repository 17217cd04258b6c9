"""Random operation traces for the differential test (see replay.py for the op vocabulary).

Prompts come from a few shared prefix families over a tiny vocabulary, so requests share
prefixes and hit each other's blocks; pools are small, so allocations fail, blocks get evicted and
requests are preempted.  The generator steers with kvcore's answers (which requests are running),
so every op is valid; the vLLM side replays the same ops, and any disagreement — including on
whether an allocation succeeded — shows up as a different observation.
"""

from __future__ import annotations

import random
from typing import Any

from tests.differential.replay import KvcoreImpl

MAX_MODEL_LEN = 128


def random_config(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["full", "full", "swa", "swa", "chunked", "hybrid", "hybrid_bs", "nocache"])
    bs = rng.choice([2, 4, 8]) if kind in ("full", "nocache") else 4
    if kind in ("full", "nocache"):
        groups = [{"type": "full", "block_size": bs}]
    elif kind == "swa":
        bs = rng.choice([2, 4])
        groups = [{"type": "swa", "block_size": bs, "window": rng.choice([2, 3, 4, 5, 8, 9, 16])}]
    elif kind == "chunked":
        groups = [{"type": "chunked", "block_size": bs, "chunk": rng.choice([4, 8, 12])}]
    elif kind == "hybrid":
        groups = [{"type": "full", "block_size": bs},
                  {"type": "swa", "block_size": bs, "window": rng.choice([4, 5, 8, 12])}]
    else:
        groups = [{"type": "full", "block_size": 4},
                  {"type": "swa", "block_size": 8, "window": rng.choice([8, 9, 16, 24])}]
    num_blocks = rng.randint(8, 48) * len(groups)
    return {"kind": kind, "groups": groups, "num_blocks": num_blocks,
            "max_model_len": MAX_MODEL_LEN, "caching": kind != "nocache"}


def random_prompt(rng: random.Random, families: list[list[int]]) -> list[int]:
    base = rng.choice(families)
    keep = rng.randint(0, len(base))
    tail = [rng.randrange(5) for _ in range(rng.randint(1, 24))]
    return (base[:keep] + tail)[:60]


def generate_trace(seed: int, num_ops: int = 60) -> dict[str, Any]:
    rng = random.Random(seed)
    config = random_config(rng)
    families = [[rng.randrange(5) for _ in range(rng.randint(4, 40))] for _ in range(3)]
    impl = KvcoreImpl(config)
    requests: dict[str, Any] = {}
    running: list[str] = []
    waiting: list[str] = []
    ops: list[dict[str, Any]] = []
    counter = 0

    def admit(rid: str) -> None:
        req = requests[rid]
        op = {"op": "admit", "rid": rid, "chunk": rng.randint(1, 48)}
        ops.append(op)
        blocks, hit = impl.get_computed_blocks(req)
        n = min(op["chunk"], req.num_tokens - hit)
        if impl.allocate(req, n, hit, blocks) is not None:
            req.num_computed_tokens = hit + n
            running.append(rid)
            if rid in waiting:
                waiting.remove(rid)
        elif rid not in waiting:
            waiting.append(rid)

    while len(ops) < num_ops:
        r = rng.random()
        if r < 0.25 or not (running or waiting):
            counter += 1
            rid = f"r{counter}"
            prompt = random_prompt(rng, families)
            ops.append({"op": "add", "rid": rid, "prompt": prompt})
            requests[rid] = impl.make_request(rid, prompt)
            admit(rid)
        elif r < 0.33 and waiting:
            admit(rng.choice(waiting))
        elif r < 0.80 and running:
            rid = rng.choice(running)
            req = requests[rid]
            if req.num_computed_tokens >= req.num_tokens and req.num_tokens >= MAX_MODEL_LEN:
                continue
            op = {"op": "step", "rid": rid, "chunk": rng.randint(1, 16), "token": rng.randrange(5)}
            ops.append(op)
            if req.num_computed_tokens < req.num_tokens:
                n = min(op["chunk"], req.num_tokens - req.num_computed_tokens)
            else:
                req.append_output_token_ids(op["token"])
                n = 1
            if impl.allocate(req, n) is not None:
                req.num_computed_tokens += n
        elif r < 0.90 and running:
            rid = running.pop(rng.randrange(len(running)))
            impl.free(requests[rid])
            if rng.random() < 0.5:
                ops.append({"op": "free", "rid": rid})
            else:
                ops.append({"op": "preempt", "rid": rid})
                requests[rid].num_computed_tokens = 0
                requests[rid].num_preemptions += 1
                waiting.append(rid)
        elif r < 0.93:
            ops.append({"op": "reset"})
            impl.reset()
    return {"seed": seed, "config": config, "ops": ops}
