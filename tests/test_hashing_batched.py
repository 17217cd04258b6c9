"""The batched request hashing path (``BlockHasher.hash_blocks``, ``RequestBlockHasher``) gives
exactly the hashes of ``BlockHasher.hash_block`` chained one block at a time, keeps the hash
values pinned below, and rejects invalid token ids without touching ``block_hashes``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvcore import Request
from kvcore.errors import InvalidArgumentError
from kvcore.hashing import HASH_ALGORITHMS, BlockHasher, ExtraKeys, block_extra_keys
from kvcore.request import RequestBlockHasher
from kvcore.types import BlockHash, MultiModalItem


def one_by_one(hasher: BlockHasher, request: Request, block_size: int) -> list[BlockHash]:
    """The reference: every full block of ``request`` hashed with ``hash_block``, chained."""
    out: list[BlockHash] = []
    parent: BlockHash | None = None
    tokens = request.all_token_ids
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        end = start + block_size
        parent = hasher.hash_block(parent, tokens[start:end],
                                   block_extra_keys(request, start, end))
        out.append(parent)
    return out


KINDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "lora": {"lora_name": "adapter-x"},
    "salt": {"cache_salt": "tenant"},
    "mm": {"mm_items": (MultiModalItem("img-a", 3, 20), MultiModalItem("img-b", 23, 1),
                        MultiModalItem("img-c", 40, 9))},
    "all": {"lora_name": "l", "cache_salt": "s", "mm_items": (MultiModalItem("img", 0, 50),)},
}


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 33])
def test_batched_equals_one_block_at_a_time(algo: str, kind: str, block_size: int) -> None:
    hasher = BlockHasher(algo, "seed")
    req = Request("r", [(i * 7919) % 150_000 for i in range(61)],
                  block_hasher=RequestBlockHasher(block_size, hasher), **KINDS[kind])
    assert req.block_hashes == one_by_one(hasher, req, block_size)
    # Grow it the ways a scheduler does: single tokens, then bursts spanning several blocks.
    for extra in ([2**32 - 1], [0], list(range(5)), list(range(100, 100 + 3 * block_size + 2)),
                  [9] * block_size, [1]):
        req.append_output_token_ids(extra)
        assert req.block_hashes == one_by_one(hasher, req, block_size)
    assert len(req.block_hashes) == req.num_tokens // block_size


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300),
       block_size=st.integers(1, 40),
       growth=st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=90), max_size=4),
       algo=st.sampled_from(HASH_ALGORITHMS), kind=st.sampled_from(sorted(KINDS)))
def test_batched_equals_one_block_at_a_time_property(tokens: list[int], block_size: int,
                                                     growth: list[list[int]], algo: str,
                                                     kind: str) -> None:
    kw = dict(KINDS[kind])
    kw["mm_items"] = tuple(i for i in kw.get("mm_items", ()) if i.offset + i.length <= len(tokens))
    hasher = BlockHasher(algo)
    req = Request("r", tokens, block_hasher=RequestBlockHasher(block_size, hasher), **kw)
    for more in growth:
        req.append_output_token_ids(more)
    assert req.block_hashes == one_by_one(hasher, req, block_size)


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_hash_blocks_direct(algo: str) -> None:
    h = BlockHasher(algo)
    tokens = list(range(1000, 1023))  # 5 blocks of 4 and a partial one
    extras: list[ExtraKeys | None] = [None, (("lora", "x"),), None, (("mm", "i", -2),), None]
    parent = h.hash_block(None, [1, 2, 3, 4])
    expected: list[BlockHash] = []
    p = parent
    for i, extra in enumerate(extras):
        p = h.hash_block(p, tokens[4 * i:4 * i + 4], extra)
        expected.append(p)
    assert h.hash_blocks(parent, tokens, 4, extras) == expected
    assert h.hash_blocks(parent, tuple(tokens), 4, extras) == expected
    assert h.hash_blocks(None, tokens, 4) == h.hash_blocks(h.root, tokens, 4)
    assert h.hash_blocks(None, tokens[:3], 4) == []
    with pytest.raises(InvalidArgumentError, match="extra keys"):
        h.hash_blocks(None, tokens, 4, extras[:2])
    with pytest.raises(InvalidArgumentError, match="block_size"):
        h.hash_blocks(None, tokens, 0)


def test_hash_blocks_goes_through_an_overridden_hash_block() -> None:
    class Shifted(BlockHasher):
        __slots__ = ()

        def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                       extra_keys: ExtraKeys | None = None) -> BlockHash:
            return super().hash_block(parent, [t + 1 for t in token_ids], extra_keys)

    plain, shifted = BlockHasher(), Shifted()
    assert shifted.hash_blocks(None, [0, 1, 2, 3], 2) == plain.hash_blocks(None, [1, 2, 3, 4], 2)


# Hashes computed before the batched path existed: KV events and routers depend on them.
PINNED = {
    "xxh3_128": ("25df3b66e1f337e547680d812f4e938a",
                 "645a114c0ad1e176bf3b6cd7c2d2c1b5"),
    "sha256": ("31acdd3ba6a4333759bd2e2b9f533fced227e602cb7d4981f2e58140a3ead694",
               "f659d21c01d9c3021edd6c14062873c1638fccc26e164e304ca42f96ec589768"),
    "sha256_cbor": ("0a8a5132fe4c281d14d92798c03aa89eea54fb8f9dee974bcf5c0d6e2dfabd8c",
                    "a501f7121384b57ba4a6bbf52ce9218cddae8341efe6e044e82f382d656c9dc6"),
}


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_hash_values_are_pinned(algo: str) -> None:
    plain = Request("g", [7, 0, 2**32 - 1, 150000, 42, 1, 2, 3, 4, 5, 6],
                    block_hasher=RequestBlockHasher(5, BlockHasher(algo)))
    items = (MultiModalItem("img-a", 5, 12), MultiModalItem("img-b", 20, 3))
    extra = Request("g", list(range(1000, 1026)),
                    block_hasher=RequestBlockHasher(5, BlockHasher(algo, "s")),
                    lora_name="lx", cache_salt="salt", mm_items=items)
    assert (plain.block_hashes[-1].hex(), extra.block_hashes[-1].hex()) == PINNED[algo]


BAD_TOKENS = [-1, 2**32, 2**64, 1.5, "7", None]


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
@pytest.mark.parametrize("new_blocks", [1, 3])
def test_invalid_token_ids_raise_and_change_nothing(algo: str, bad: Any, new_blocks: int) -> None:
    req = Request("r", list(range(10)), block_hasher=RequestBlockHasher(4, BlockHasher(algo)))
    before = list(req.block_hashes)
    assert len(before) == 2
    # Slip the bad id past Request's own check, as a foreign request type could.
    req.all_token_ids[8:] = [8, bad, *range(4 * new_blocks - 2)]
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
        req.block_hashes.extend(RequestBlockHasher(4, BlockHasher(algo))(req))
    assert req.block_hashes == before
    # Through Request's own entry point the id is refused before it is stored.
    ok = Request("s", list(range(10)), block_hasher=RequestBlockHasher(4, BlockHasher(algo)))
    before = list(ok.block_hashes)
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
        ok.append_output_token_ids([1] * (4 * new_blocks - 3) + [bad])
    assert ok.block_hashes == before


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
def test_block_hasher_names_the_invalid_token(algo: str, bad: Any) -> None:
    h = BlockHasher(algo)
    for call in (lambda: h.hash_block(None, [1, 2, bad, 4]),
                 lambda: h.hash_blocks(None, [1, 2, 3, 4, 5, bad, 7, 8], 4)):
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
            call()
