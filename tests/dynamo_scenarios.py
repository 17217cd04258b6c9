"""Hand-made event sequences that pin the rules of Dynamo's KV indexer (1.6.1): each ends with
what Dynamo holds of the prompt A B C D (blocks 1 2 3 4, 4 tokens each) and what kvcore's
index holds.  ``tests/test_dynamo_semantics.py`` checks kvcore's model of the rules against
them; ``tests/test_dynamo_interop.py`` checks the real indexer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.cluster.dynamo.semantics import COPIES, GROUP, ORPHAN
from kvcore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

BLOCK_SIZE = 4
TOKENS = list(range(100, 116))  # A B C D
KEYS = [1, 2, 3, 4]
FULL = {"kv_cache_spec_kind": "full_attention"}
WINDOW = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}


def stored(keys: list[int], parent: int | None, **kw: Any) -> BlockStored:
    first = KEYS.index(keys[0])
    tokens = TOKENS[first * BLOCK_SIZE:(first + len(keys)) * BLOCK_SIZE]
    return BlockStored(block_hashes=tuple(keys), parent_block_hash=parent,
                       token_ids=tuple(tokens), block_size=BLOCK_SIZE, **kw)


def removed(*keys: int, **kw: Any) -> BlockRemoved:
    return BlockRemoved(block_hashes=keys, **kw)


@dataclass(frozen=True)
class Scenario:
    name: str
    batches: list[list[KVCacheEvent]]
    dynamo_blocks: int  # leading blocks of A B C D that Dynamo holds
    kvcore_blocks: int  # ... that kvcore's index holds
    why: str | None = None  # why Dynamo lacks block dynamo_blocks (when kvcore holds it)


SCENARIOS = [
    Scenario("chain, last block evicted", [[stored([1, 2], None)], [stored([3], 2)],
                                           [removed(3)]], 2, 2),
    Scenario("a copy removed while another remains",
             [[stored([1, 2, 3], None), stored([1], None)], [removed(1)]], 0, 3, COPIES),
    Scenario("a removal drops the blocks below it",
             [[stored([1, 2, 3], None)], [removed(1)], [stored([1], None)]], 1, 3, ORPHAN),
    Scenario("a store under a dropped parent is skipped",
             [[stored([1, 2], None), stored([2], 1)], [removed(2)], [stored([3], 2)]],
             1, 3, COPIES),
    Scenario("a sliding-window group is not indexed",
             [[stored([1, 2, 3], None, group_id=1, **WINDOW)]], 0, 3, GROUP),
    Scenario("a kind-less group 1 is not indexed", [[stored([1, 2, 3], None, group_id=1)]],
             0, 3, GROUP),
    Scenario("removals of a group not indexed are ignored",
             [[stored([1, 2, 3], None, group_id=0, **FULL),
               stored([1, 2, 3], None, group_id=1, **WINDOW)], [removed(2, group_id=1)]], 3, 3),
    Scenario("the full group's copy removed, the window group's kept",
             [[stored([1, 2, 3], None, group_id=0, **FULL),
               stored([1, 2, 3], None, group_id=1, **WINDOW)], [removed(3, group_id=0)]],
             2, 3, GROUP),
    Scenario("copies across two full-attention groups are not counted",
             [[stored([1, 2, 3], None, group_id=0, **FULL),
               stored([1, 2, 3], None, group_id=1, **FULL)], [removed(2, group_id=1)]],
             1, 3, COPIES),
    Scenario("a main group other than 0", [[stored([1, 2], None, group_id=0, **WINDOW),
                                            stored([1, 2], None, group_id=1, **FULL)],
                                           [removed(2, group_id=0)]], 2, 2),
    Scenario("a host-tier removal leaves the device copy",
             [[stored([1, 2, 3], None)], [removed(3, medium="CPU")]], 3, 3),
    Scenario("a reset", [[stored([1, 2, 3], None)], [AllBlocksCleared()],
                         [stored([1], None)]], 1, 1),
]
