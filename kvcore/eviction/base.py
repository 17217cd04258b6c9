"""The eviction-policy interface (the free side of a :class:`~kvcore.block_pool.BlockPool`) and
the intrusive free list every policy links its blocks in.

A policy holds every free block (``ref_cnt == 0``) and decides which one is reused next.  Blocks in
use are not in it; the pool tells it when a block enters (``on_free``), leaves because a prefix
hit resurrects it (``on_touch``), leaves to be reused (``pick_victims``: the pool then drops the
victims' hashes) and loses its hash while it stays (``on_evict``, for ``evict_blocks``).  Every policy keeps two rules the pool relies on:

* blocks freed without a hash (no cache value) are reused before any cached block (``lru``
  leaves a free block whose hash ``evict_blocks`` dropped where it is, as vLLM does; the other
  policies move it to their uncached list);
* ``pick_victims(n)`` succeeds whenever ``n <= len(policy)``: a policy orders blocks, it never
  refuses one (so allocation never fails while free blocks exist).

Policies are built from intrusive lists (:class:`~kvcore.eviction.lru.FreeBlockQueue` threads its list
through the blocks' ``prev_free`` / ``next_free``), so a block is in at most one list and every
operation is O(1) per block (amortized where a policy re-queues blocks).  ``lru`` *is* the
pool's historical free queue, with no extra layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar, Final, Protocol, final

from kvcore._mypyc import mypyc_attr
from kvcore.types import KVCacheBlock


class FreeList(Protocol):
    """What ``check_invariants`` and snapshots read of an intrusive free list
    (``FreeBlockQueue``): its two sentinels, between which the blocks are linked, its cached
    length, and its blocks in order."""

    @property
    def head(self) -> KVCacheBlock: ...

    @property
    def tail(self) -> KVCacheBlock: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[KVCacheBlock]: ...


@final
class Release:
    """What a request tells the policy when it releases its blocks
    (:meth:`EvictionPolicy.on_release`): its prompt and generated token counts, and each
    KV-cache group's block size (to tell prompt blocks from generated ones).  A value: compared
    and hashed by its fields, read-only in the compiled build (``Final`` attributes).

    A small class rather than a ``NamedTuple``: the manager builds one per released request,
    and a named tuple's constructor is interpreted Python even in the compiled build (its
    ``__new__``: about 2,400 instructions a release on ``kvcore bench manager``'s
    eviction-heavy row, against about 50 ns for a compiled class)."""

    __slots__ = ("block_sizes", "num_output_tokens", "num_prompt_tokens")

    def __init__(self, num_prompt_tokens: int, num_output_tokens: int,
                 block_sizes: tuple[int, ...]) -> None:
        self.num_prompt_tokens: Final = num_prompt_tokens
        self.num_output_tokens: Final = num_output_tokens
        self.block_sizes: Final = block_sizes

    def _fields(self) -> tuple[int, int, tuple[int, ...]]:
        return self.num_prompt_tokens, self.num_output_tokens, self.block_sizes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Release) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (f"Release(num_prompt_tokens={self.num_prompt_tokens}, "
                f"num_output_tokens={self.num_output_tokens}, block_sizes={self.block_sizes})")


@mypyc_attr(allow_interpreted_subclasses=True)  # the simulator's offline policies subclass it
class EvictionPolicy:
    """Base class of eviction policies (see the module docstring for the contract).

    Subclasses set ``name`` and implement every method below that raises
    ``NotImplementedError``.
    """

    __slots__ = ()
    name: ClassVar[str] = "policy"
    reads_releases: ClassVar[bool] = False
    """Whether :meth:`on_release` is worth calling: the manager gathers a request's blocks for
    it only then (a policy that ignores releases costs nothing on the free path)."""

    # -- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Free blocks the policy holds."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks in the order the policy would reuse them if nothing changed (in order of
        the segments it takes victims from; a policy that re-queues blocks while picking may
        deviate from it)."""
        raise NotImplementedError

    def first(self) -> KVCacheBlock | None:
        """The free block ``pick_victims(1)`` would try first, or ``None`` if empty."""
        raise NotImplementedError

    def queues(self) -> Sequence[FreeList]:
        """The intrusive lists the policy's blocks are linked in (for ``check_invariants``)."""
        raise NotImplementedError

    def check(self) -> list[str]:
        """Violations of the policy's own invariants (segment sizes, membership tables), one
        message each; empty when consistent.  Called by ``check_invariants``."""
        raise NotImplementedError

    # -- transitions ----------------------------------------------------------------------------
    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        """Blocks whose reference count reached 0, each list in eviction priority order (first
        = evict first): ``uncached`` carry no hash, ``cached`` are prefix-cache entries."""
        raise NotImplementedError

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit takes one more reference on each block (null blocks skipped): free ones
        leave the policy, and the policy records the access.  The reference count is raised in
        the same pass (this is the pool's hit path)."""
        raise NotImplementedError

    def on_release(self, groups: Sequence[Sequence[KVCacheBlock]], release: Release) -> None:
        """A request is about to free its blocks (``groups``: one list per KV-cache group, in
        table order, null blocks included), or to hand them back for a deferred free.  Called
        only when :attr:`reads_releases`; nothing changes hands here.  A policy may remember
        what it needs to place each block when it is freed."""

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A prefix hit on blocks the policy does not hold (the pool's hint reserve hands them
        out directly): record the access only.  The pool sets their reference counts."""

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        """Remove ``n`` blocks (``0 < n <= len(self)``, checked by the caller) for reuse, setting
        each one's ``ref_cnt``; uncached blocks first.  The pool then evicts every returned
        block that carries a hash: a policy that remembers evictions records them here, in the
        same pass (no separate ``on_evict`` call on the allocation path)."""
        raise NotImplementedError

    def remove(self, block: KVCacheBlock) -> None:
        """Take one free ``block`` out of the policy without an access (the pool reserves it for
        a scheduler hint, or ``pin`` takes a reference on it)."""
        raise NotImplementedError

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``blocks`` (each hashed, free or in use) are about to lose their hashes outside
        ``pick_victims`` (``evict_blocks``).  Policies with a memory of evicted hashes record
        them here."""

    def on_uncache(self, block: KVCacheBlock) -> None:
        """A free ``block`` lost its hash while linked (``evict_blocks``): it now has no cache
        value, and a policy that keeps uncached blocks apart moves it there."""

    def reset(self) -> None:
        """The prefix cache was cleared (every block is free and unhashed): forget history."""
