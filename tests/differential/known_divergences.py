"""Minimal reproductions of kvcore's known divergences from vLLM 0.32, one per name in
``traces.KVCORE_PENDING``.

Each is a trace (see replay.py) replayed with every *other* pending divergence masked, so it shows
exactly one difference.  test_vs_vllm.py runs them: while the name is pending the divergence must
still be there (an xfail showing it); once kvcore is fixed the test asks for the name to be
removed from ``KVCORE_PENDING``, after which the repro must match like any other trace.
"""

from __future__ import annotations

from typing import Any


def _config(kind: str, groups: list[dict[str, Any]], num_blocks: int, **extra: Any
            ) -> dict[str, Any]:
    return {"kind": kind, "groups": groups, "num_blocks": num_blocks, "max_model_len": 128,
            "caching": True, "eagle": False, "budget": None, **extra}


def _add(rid: str, prompt: list[int]) -> dict[str, Any]:
    return {"op": "add", "rid": rid, "prompt": prompt}


def _admit(rid: str, chunk: int, **extra: Any) -> dict[str, Any]:
    return {"op": "admit", "rid": rid, "chunk": chunk, **extra}


def _decode(rid: str, token: int) -> dict[str, Any]:
    return {"op": "step", "rid": rid, "chunk": 1, "token": token}


FULL4 = [{"type": "full", "block_size": 4}]
P9 = [1, 2, 3, 4, 5, 6, 7, 8, 9]

REPROS: dict[str, dict[str, Any]] = {
    # vLLM: r2 hits 4 tokens (8 minus the dropped eagle block); kvcore: no use_eagle argument.
    "use_eagle": {
        "config": _config("full", FULL4, 10, eagle=True),
        "ops": [_add("r1", P9), _admit("r1", 9), {"op": "free", "rid": "r1"},
                _add("r2", [*P9, 10, 11, 12, 13]), _admit("r2", 13)],
    },
    # r2's first admission fails (3 usable blocks, r1 holds them); kvcore counts that lookup
    # too: requests 3 / queries 29 / hits 16 against vLLM's 2 / 19 / 8.
    "stats_per_admission": {
        "config": _config("full", FULL4, 4),
        "ops": [_add("r1", P9), _admit("r1", 9), _add("r2", [*P9, 9]), _admit("r2", 9),
                {"op": "free", "rid": "r1"}, _admit("r2", 9), {"op": "stats"}],
    },
    # Prompt of 13 tokens, hash block 4: vLLM registers the boundary at 12 (inside full block
    # [8, 16)) once 16 tokens are cached (BlockStored block_size 4, tokens 9..12, parent r1@8)
    # and emits BlockRemoved for it when the block is evicted.
    "partial_tail_entries": {
        "config": _config("hybrid_partial", [{"type": "full", "block_size": 8},
                                             {"type": "swa", "block_size": 4, "window": 4}], 7),
        "ops": [_add("r1", list(range(1, 14))), _admit("r1", 13), _decode("r1", 14),
                _decode("r1", 15), _decode("r1", 16), {"op": "free", "rid": "r1"},
                _add("r2", [0] * 25), _admit("r2", 16)],
    },
    # BlockStored.extra_keys: vLLM [None], kvcore None.
    "event_extra_keys": {
        "config": _config("full", FULL4, 4),
        "ops": [_add("r1", [1, 2, 3, 4, 5]), _admit("r1", 5)],
    },
    # BlockStored.kv_cache_spec_kind / kv_cache_spec_sliding_window: vLLM 'full_attention' /
    # None and 'sliding_window' / 5; kvcore has neither.
    "event_spec_metadata": {
        "config": _config("hybrid", [{"type": "full", "block_size": 4},
                                     {"type": "swa", "block_size": 4, "window": 5}], 8),
        "ops": [_add("r1", [1, 2, 3, 4, 5]), _admit("r1", 5)],
    },
    # A caches the state at 8 (step 1).  In step 2, B (prompt of exactly 8 tokens, so its hit
    # stops at 4) recomputes and caches the same hash again; C's hit on A's older block is then
    # refused by vLLM (hash cached this step) and admitted by kvcore (block not cached this step).
    "mamba_cached_this_step_by_hash": {
        "config": _config("mamba", [{"type": "mamba", "block_size": 4}], 16),
        "ops": [_add("A", P9), _admit("A", 9), {"op": "new_step"},
                _add("B", P9[:8]), _admit("B", 8),
                _add("C", [*P9, 10]), _admit("C", 10)],
    },
    # full_sequence_must_fit: vLLM needs cdiv(30, 4) = 8 Mamba blocks (5 free) and refuses;
    # kvcore caps the request at cdiv(8, 4) + 1 = 3 blocks and admits it.
    "mamba_admission_cap": {
        "config": _config("mamba", [{"type": "mamba", "block_size": 4}], 6, budget=8),
        "ops": [_add("r1", [i % 5 for i in range(30)]), _admit("r1", 8, fit=True)],
    },
}


def repro_traces(pending: list[str]) -> list[dict[str, Any]]:
    """The repros as traces, each masking the pending divergences other than its own."""
    out = []
    for name, trace in sorted(REPROS.items()):
        config = {**trace["config"], "pending": [p for p in pending if p != name]}
        out.append({"seed": f"repro:{name}", "name": name, "config": config,
                    "ops": trace["ops"]})
    return out
