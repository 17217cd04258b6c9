"""The eviction-policy registry: one place names every policy, and a policy defined outside
kvcore is one class and one ``register_policy`` call away from every entry point."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

import pytest

from kvcore import KVCacheManager
from kvcore.block_pool import BlockPool
from kvcore.cli import main as cli_main
from kvcore.errors import InvalidArgumentError
from kvcore.eviction import (
    REGISTRY,
    EvictionPolicy,
    FreeBlockQueue,
    FreeList,
    make_policy,
    register_policy,
    unregister_policy,
)
from kvcore.sim.policies import BlockRequest, simulate
from kvcore.types import KVCacheBlock
from tests.factories import full_spec, make_config


class MRUPolicy(EvictionPolicy):
    """most recently freed cached block first (a test policy).

    A policy of one's own subclasses EvictionPolicy (the compiled build's FreeBlockQueue is a
    native class, not subclassable from Python) and links its blocks in a FreeBlockQueue."""

    name: ClassVar[str] = "mru"

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._q = FreeBlockQueue(blocks)  # uncached at the head, cached at the tail

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._q)

    def first(self) -> KVCacheBlock | None:
        return self._q.first()

    def queues(self) -> Sequence[FreeList]:
        return (self._q,)

    def check(self) -> list[str]:
        return []

    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        self._q.on_free(uncached, cached)

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._q.on_touch(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        self._q.remove(block)

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        # Uncached blocks (at the head) first, then cached ones from the tail end.
        blocks = list(self._q)
        out = [b for b in blocks if b.block_hash is None][:n]
        out += [b for b in reversed(blocks) if b.block_hash is not None][:n - len(out)]
        for block in out:
            self._q.remove(block)
            block.ref_cnt = ref_cnt
        return out


@pytest.fixture
def mru() -> Iterator[str]:
    register_policy("mru", MRUPolicy)
    try:
        yield "mru"
    finally:
        unregister_policy("mru")


def test_the_builtin_names_come_from_the_registry() -> None:
    assert REGISTRY.names(offline=False) == ("lru", "slru", "s3fifo", "arc", "learned")
    assert REGISTRY.names() == ("lru", "slru", "s3fifo", "arc", "learned", "fifo", "lfu",
                              "belady", "reuse_oracle")
    assert all(REGISTRY.info(n).offline for n in ("fifo", "lfu", "belady"))


def test_a_policy_registered_from_outside_reaches_every_entry_point(
        mru: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The pool and the manager run it by name.
    pool = BlockPool(6, eviction_policy=mru)
    assert isinstance(pool.policy, MRUPolicy) and pool.eviction_policy == "mru"
    mgr = KVCacheManager(make_config(full_spec(block_size=2), num_blocks=6), 64,
                         eviction_policy=mru)
    a = mgr.make_request("a", list(range(7)))
    assert mgr.allocate_slots(a, 7) is not None
    first = mgr.get_blocks("a")[0][0]
    mgr.free(a)  # tail first: the prefix's first block is freed last, the most recent
    mgr.check_invariants()
    # Three blocks for another prompt: the two uncached free blocks, then one cached block,
    # which under mru is the most recently freed one (lru would take a's last full block).
    b = mgr.make_request("b", list(range(100, 105)))
    blocks = mgr.allocate_slots(b, 5)
    assert blocks is not None and first in blocks[0]
    mgr.check_invariants()
    assert mgr.get_computed_blocks(mgr.make_request("a2", list(range(7))))[1] == 0
    # The simulator runs it, and the command line names it in --policy and --eviction-policy.
    result = simulate([BlockRequest((1, 2, 3), 7, 1)], 8, mru, 2)
    assert result.policy == "mru"
    with pytest.raises(SystemExit):
        cli_main(["replay", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "mru (most recently freed cached block first" in help_text
    assert cli_main(["replay", "--eviction-policy", mru, "--limit", "4", "--no-progress",
                     "--policy", f"lru,{mru}"]) == 0


def test_registering_is_checked(mru: str) -> None:
    with pytest.raises(InvalidArgumentError, match="already registered"):
        register_policy("mru", MRUPolicy)
    with pytest.raises(InvalidArgumentError, match="EvictionPolicy subclass"):
        register_policy("other", dict)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="identifier"):
        register_policy("recommended", MRUPolicy)
    with pytest.raises(InvalidArgumentError, match="no eviction policy 'nope'"):
        unregister_policy("nope")


def test_the_pool_refuses_simulator_only_policies() -> None:
    for name in ("fifo", "lfu", "belady"):
        with pytest.raises(InvalidArgumentError, match=f"'{name}' is simulator-only"):
            BlockPool(6, eviction_policy=name)
        blocks: Sequence[KVCacheBlock] = [KVCacheBlock(i) for i in range(1, 4)]
        assert isinstance(make_policy(name, blocks, offline=True), EvictionPolicy)


def test_an_unregistered_policy_is_gone(mru: str) -> None:
    unregister_policy(mru)
    try:
        with pytest.raises(InvalidArgumentError, match="unknown eviction policy 'mru'"):
            BlockPool(6, eviction_policy=mru)
    finally:
        register_policy(mru, MRUPolicy)


class BuggyPolicy(MRUPolicy):
    """a policy whose constructor has a bug (a test policy)."""

    def __init__(self, blocks: Sequence[KVCacheBlock], *, depth: float = 1.0) -> None:
        super().__init__(blocks)
        self.depth = len(depth)  # type: ignore[arg-type]  # the bug: a float has no len()


def test_a_type_error_inside_a_policy_is_the_policys_own(mru: str) -> None:
    """A ``TypeError`` raised inside a policy's ``__init__`` is its author's bug and reaches
    them as it is; only an option the class does not take is a usage error."""
    register_policy("buggy", BuggyPolicy)
    try:
        for spec in ("buggy", "buggy:depth=2"):
            with pytest.raises(TypeError, match="has no len") as excinfo:
                make_policy(spec, [KVCacheBlock(1)])
            assert not isinstance(excinfo.value, InvalidArgumentError)
        with pytest.raises(TypeError, match="has no len"):
            BlockPool(6, eviction_policy="buggy")
        with pytest.raises(InvalidArgumentError,
                           match=r"'buggy' takes no option width \(its options: depth\)"):
            make_policy("buggy:width=2", [KVCacheBlock(1)])
        with pytest.raises(InvalidArgumentError,
                           match=r"'mru' takes no option depth \(its options: none\)"):
            BlockPool(6, eviction_policy="mru:depth=2")
    finally:
        unregister_policy("buggy")
