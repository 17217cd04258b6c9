"""Page hashes and KV events: kvcore's chain is SGLang's own (checked against SGLang's native
hash), and the event batches of the backend are byte-identical to those of SGLang's
``RadixCache`` on the same operations, in both of SGLang's event formats, namespaces included.

Where evictions differ (SGLang evicts whole leaf nodes, kvcore the pages its policy picks; see
test_identity.py), the ``BlockRemoved`` batches differ with them: this file compares traces
without eviction, and checks that every page kvcore removes was stored before, under the hash
its ``BlockStored`` carried."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import msgspec
import pytest
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

from kvcore.integrations.sglang.hashing import page_digest, storage_seed
from tests.integrations.sglang.helpers import NAMESPACES, Driver, make_cache, random_ops, run


def chain(tokens: list[int], page_size: int, prior: bytes | None) -> list[str]:
    out = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prior = page_digest(prior, tokens[start:start + page_size])
        out.append(prior.hex())
    return out


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_hashes_are_sglangs(page_size: int) -> None:
    rng = random.Random(page_size)
    for wide in (False, True):
        top = 2**40 if wide else 150_000
        tokens = [rng.randrange(0, top) for _ in range(page_size * 5)]
        assert chain(tokens, page_size, None) == get_hash_str(tokens, None, page_size=page_size)
        for namespace in NAMESPACES:
            key = RadixKey(array("q", tokens), namespace[0], cache_salt=namespace[1])
            assert chain(tokens, page_size, storage_seed(namespace)) == get_storage_hash_str(
                key, None, page_size=page_size), namespace


def encoded(events: list[object]) -> list[bytes]:
    return [msgspec.msgpack.encode(e) for e in events]


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_event_batches_byte_identical(page_size: int, dynamo: bool) -> None:
    ops = random_ops(11, page_size, 80, evictions=False)
    drivers = []
    for kind in ("sglang", "kvcore:lru"):
        cache = make_cache(kind, 1000, page_size, events=True)
        cache.kv_events.dynamo_format = dynamo
        # The namespace "lora-a" is a LoRA adapter with a public name: its pages' event hashes
        # are namespace-seeded in both formats.
        cache.kv_events.lora_names.register(SimpleNamespace(lora_id="a" * 32,
                                                            extra_key="lora-a"), "adapter-a")
        drivers.append(Driver(cache, deep=False))
    batches: list[list[list[bytes]]] = [[], []]
    for i in range(0, len(ops), 5):
        for d, driver in enumerate(drivers):
            run(driver, ops[i:i + 5])
            batches[d].append(encoded(driver.cache.take_events()))
    assert sum(len(b) for b in batches[0]) > 5
    names = {type(e).__name__ for e in drivers[1].cache.take_events()}
    assert names <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert any(b"adapter-a" in e for batch in batches[1] for e in batch)
    assert batches[0] == batches[1]


def test_removed_pages_were_stored() -> None:
    cache = make_cache("kvcore:lru", 30, 4, events=True)
    cache.kv_events.dynamo_format = True
    run(Driver(cache), random_ops(3, 4, 120))
    stored: set[int] = set()
    removed: list[int] = []
    for event in cache.take_events():
        name = type(event).__name__
        if name == "BlockStored":
            stored.update(event.block_hashes)
        elif name == "BlockRemoved":
            removed.extend(event.block_hashes)
    assert removed and set(removed) <= stored
