"""Chained block hashing: determinism, seeds, chaining, extra keys, partial blocks, algorithms."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcore import Request
from kvcore.errors import InvalidArgumentError, UnknownHashAlgorithmError
from kvcore.hashing import HASH_ALGORITHMS, BlockHasher, block_extra_keys, random_seed
from kvcore.request import RequestBlockHasher
from kvcore.types import MultiModalItem
from tests.factories import make_request

TOKENS = list(range(100, 164))

_CHILD = """
import sys
from kvcore import BlockHasher, Request, RequestBlockHasher
algo, seed = sys.argv[1], sys.argv[2]
r = Request("x", list(range(100, 164)), block_hasher=RequestBlockHasher(16, BlockHasher(algo, seed)))
print(",".join(h.hex() for h in r.block_hashes))
"""


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_hashes_are_identical_across_processes_for_a_fixed_seed(algo: str) -> None:
    here = make_request("x", TOKENS, 16, algorithm=algo, seed="s1")
    outs = []
    for _ in range(2):
        # A different PYTHONHASHSEED per child proves nothing depends on Python's str hashing.
        env = {"PYTHONHASHSEED": str(len(outs) + 7)}
        import os
        env.update({k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"})
        res = subprocess.run([sys.executable, "-c", _CHILD, algo, "s1"], capture_output=True,
                             text=True, check=True, env=env)
        outs.append(res.stdout.strip())
    assert outs[0] == outs[1] == ",".join(h.hex() for h in here.block_hashes)


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_default_seed_is_fixed_and_different_seeds_differ(algo: str) -> None:
    a = make_request("a", TOKENS, 16, algorithm=algo)
    b = make_request("b", TOKENS, 16, algorithm=algo)
    assert a.block_hashes == b.block_hashes
    c = make_request("c", TOKENS, 16, algorithm=algo, seed=1234)
    d = make_request("d", TOKENS, 16, algorithm=algo, seed=random_seed())
    assert not set(a.block_hashes) & set(c.block_hashes)
    assert not set(c.block_hashes) & set(d.block_hashes)
    assert BlockHasher(algo, b"k").root != BlockHasher(algo, b"j").root


def test_seed_kinds_and_bad_seed() -> None:
    assert BlockHasher(seed="7").root == BlockHasher(seed=b"7").root == BlockHasher(seed=7).root
    assert random_seed() != random_seed()
    with pytest.raises(InvalidArgumentError):
        BlockHasher(seed=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_chaining_same_block_after_different_prefix(algo: str) -> None:
    block = list(range(500, 516))
    a = make_request("a", list(range(16)) + block, 16, algorithm=algo)
    b = make_request("b", list(range(1, 17)) + block, 16, algorithm=algo)
    assert a.block_hashes[1] != b.block_hashes[1]
    c = make_request("c", list(range(16)) + block, 16, algorithm=algo)
    assert a.block_hashes == c.block_hashes
    h = BlockHasher(algo)
    assert a.block_hashes[1] == h.hash_block(a.block_hashes[0], block)
    assert a.block_hashes[0] == h.hash_block(None, list(range(16)))


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_hash_sizes(algo: str) -> None:
    (h,) = make_request("a", list(range(16)), 16, algorithm=algo).block_hashes
    assert isinstance(h, bytes) and len(h) == (16 if algo == "xxh3_128" else 32)


def test_salt_isolates_tenants_and_only_changes_first_block_key() -> None:
    plain = make_request("p", TOKENS, 16)
    salted = make_request("s", TOKENS, 16, cache_salt="tenant-a")
    other = make_request("o", TOKENS, 16, cache_salt="tenant-b")
    same = make_request("t", TOKENS, 16, cache_salt="tenant-a")
    assert salted.block_hashes == same.block_hashes
    # Every hash differs: the salt enters block 0 and chaining carries it forward.
    assert not set(plain.block_hashes) & set(salted.block_hashes)
    assert not set(salted.block_hashes) & set(other.block_hashes)
    assert block_extra_keys(salted, 0, 16) == (("salt", "tenant-a"),)
    assert block_extra_keys(salted, 16, 32) is None


def test_lora_and_multimodal_extra_keys() -> None:
    lora = make_request("l", TOKENS, 16, lora_name="adapter-x")
    assert not set(lora.block_hashes) & set(make_request("p", TOKENS, 16).block_hashes)
    assert block_extra_keys(lora, 16, 32) == (("lora", "adapter-x"),)
    items = (MultiModalItem("img-a", 10, 20), MultiModalItem("img-b", 40, 4))
    mm = make_request("m", TOKENS, 16, mm_items=items)
    assert block_extra_keys(mm, 0, 16) == (("mm", "img-a", 10),)
    assert block_extra_keys(mm, 16, 32) == (("mm", "img-a", -6),)
    assert block_extra_keys(mm, 32, 48) == (("mm", "img-b", 8),)
    assert block_extra_keys(mm, 48, 64) is None
    mm2 = make_request("n", TOKENS, 16, mm_items=(MultiModalItem("img-z", 10, 20),
                                                   MultiModalItem("img-b", 40, 4)))
    assert mm.block_hashes[0] != mm2.block_hashes[0]
    assert mm.block_hashes[1] != mm2.block_hashes[1]
    both = make_request("b", TOKENS, 16, lora_name="x", cache_salt="s", mm_items=items[:1])
    assert block_extra_keys(both, 0, 16) == (("lora", "x"), ("mm", "img-a", 10), ("salt", "s"))


def test_partial_blocks_are_not_hashed_until_full() -> None:
    req = make_request("a", list(range(10)), 4)
    assert len(req.block_hashes) == 2
    first_two = list(req.block_hashes)
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11])
    assert len(req.block_hashes) == 3
    assert req.block_hashes[:2] == first_two
    whole = make_request("b", list(range(12)), 4)
    assert whole.block_hashes == req.block_hashes


def test_request_block_hasher_only_hashes_new_blocks() -> None:
    calls = []

    class CountingHasher(BlockHasher):
        __slots__ = ()

        def hash_block(self, parent, token_ids, extra_keys=None):  # type: ignore[no-untyped-def]
            calls.append(tuple(token_ids))
            return super().hash_block(parent, token_ids, extra_keys)

    req = Request("a", list(range(8)), block_hasher=RequestBlockHasher(4, CountingHasher()))
    assert len(calls) == 2
    req.append_output_token_ids([8, 9, 10])
    assert len(calls) == 2
    req.append_output_token_ids([11, 12, 13, 14, 15, 16])
    assert calls[2:] == [(8, 9, 10, 11), (12, 13, 14, 15)]


def test_unknown_algorithm_and_aliases() -> None:
    with pytest.raises(UnknownHashAlgorithmError, match="md5"):
        BlockHasher("md5")
    assert BlockHasher("xxhash").algorithm == "xxh3_128"


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_out_of_range_token_ids_raise(algo: str) -> None:
    h = BlockHasher(algo)
    with pytest.raises(InvalidArgumentError):
        h.hash_block(None, [1, 2, 2**32])
    with pytest.raises(InvalidArgumentError):
        h.hash_block(None, [1, -2])


def test_bad_block_size() -> None:
    with pytest.raises(InvalidArgumentError):
        RequestBlockHasher(0)
