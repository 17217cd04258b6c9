"""``learned``: eviction by the reuse value each category of block has shown in this run.

Every cached block that becomes free is put in a *category* from what the pool and the manager
know when its request releases it (:meth:`LearnedPolicy.on_release`, no knowledge of the
future):

* whether it holds prompt tokens or generated ones (generated blocks of a finished request come
  back only when a client sends the answer back verbatim);
* whether it was hit while cached (a prefix that was shared once is shared again);
* the request's turn: fresh (no prefix hit), a prefix hit, or a *later turn* whose hit reached
  the tail of an earlier finished request (a conversation that continued once continues again,
  and sooner);
* the request's output length (short answers are followed by another turn more often than
  long ones);
* for a prompt block that was not hit, whether it lies ``deep_after`` (8) or more blocks past
  the end of its request's hit prefix: *deep* (a prompt's blocks far past what it shared are
  its own, a question or documents in a combination seen once, and rarely come back; where
  they do come back, as a new conversation's long prompt does, the learned counts say so);
* on a layout of more than one KV-cache group (a hybrid model's state group, sliding windows)
  none of this: a hit needs every group's block at its end, which no per-block category sees,
  so there every cached block ranks in one category, in LRU order (:meth:`LearnedPolicy.on_release`).

Per category the policy learns, online, the share of its freed blocks that were reused: a hit on
the free block, or a *ghost return* (the block was evicted and the same hash was computed
again while the ghost table remembered it, i.e. a larger cache would have hit).  The counts
decay by half every ``half_life`` x capacity evictions, so the estimate follows the workload.

Each category is an LRU list (freed tail first, so a chain's prefix outlives its tail), and the
victim is the head (least recently freed block) of the category with the lowest value::

    value(c) = ln p(c) - age(head of c) / (tau * capacity)

where ``p(c)`` is the learned reuse probability (for a deep category at most that of the
shallow not-hit category of the same turn and output length: a hit on a deep block needs the
blocks before it, so it must not outlive them) and the age counts blocks allocated since the
head was freed: a category twice as likely to be reused keeps its blocks ``tau * capacity * ln
2`` allocations longer.  That is an exponential model of the reuse probability in age with the
same rate for every category (docs/eviction.md in the repository explains the choice, what was
measured and what it leaves out).  Uncached blocks are reused first, as under every policy.

Cost: O(1) per freed or hit block; a victim costs one comparison per non-empty category (at most
:data:`NUM_CATEGORIES`), done once per ``pick_victims`` call and once more per category a victim
came from (none while one category holds every cached free block).  A request's blocks are
linked into their category in runs (its blocks are mostly of one category), counted once per
run, and a refresh recomputes only the values of the categories whose counts changed since the
last one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import ClassVar, Final

from kvcore.errors import InvalidArgumentError
from kvcore.eviction.base import Release
from kvcore.eviction.segmented import CLEAN, NOT_FREE, SegmentedPolicy
from kvcore.types import BlockHash, KVCacheBlock
from kvcore.validation import check_share

# -- categories ----------------------------------------------------------------------------------
# (Final: the compiled build inlines them; a plain module constant is a globals lookup per use)
FRESH: Final = 0
HIT: Final = 1
LATER_TURN: Final = 2
SHORT_OUTPUT_TOKENS: Final = 16  # below: a short answer
LONG_OUTPUT_TOKENS: Final = 128  # from here: a long answer
GENERATED: Final = 0  # then UNTAGGED, then prompt blocks by (hit, turn, output length),
UNTAGGED: Final = 1
DEEP: Final = 2 + 2 * 3 * 3  # then the deep prompt blocks (not hit), by (turn, output length)
NUM_CATEGORIES: Final = DEEP + 3 * 3

_AWAY: Final = -2  # a pending tag of _AWAY - c: category c, already counted, away from the policy


def category(generated: bool, was_hit: bool, turn: int, output_tokens: int,
             deep: bool = False) -> int:
    """The category index of a block (see the module docstring); ``deep``: a prompt block that
    was not hit, ``deep_after`` or more blocks past its request's hit prefix."""
    if generated:
        return GENERATED
    length = (0 if output_tokens < SHORT_OUTPUT_TOKENS
              else 1 if output_tokens < LONG_OUTPUT_TOKENS else 2)
    if deep and not was_hit:
        return DEEP + 3 * turn + length
    return 2 + (9 if was_hit else 0) + 3 * turn + length


def _promoted(index: int) -> int:
    """The category a block of category ``index`` moves to when it is (or was) hit: a not-hit
    prompt block's, deep or not, is the hit one of its turn and output length."""
    if 2 <= index < 2 + 9:
        return index + 9
    if index >= DEEP:
        return index - DEEP + 2 + 9
    return index


def _prior(index: int) -> float:
    """The reuse probability a category starts from, worth one freed block: a block that was
    hit is likelier to be hit again (what ``slru`` assumes), a generated one rarely is."""
    if index == GENERATED:
        return 0.1
    if index == UNTAGGED:
        return 0.5
    return 0.75 if 2 + 9 <= index < DEEP else 0.25


def describe_category(index: int) -> str:
    """A category index in words (for reports and tests)."""
    if index == GENERATED:
        return "generated"
    if index == UNTAGGED:
        return "freed without a release (or on a layout of more than one group)"
    if index >= DEEP:
        return describe_category(index - DEEP + 2) + ", deep"
    local = index - 2
    hit = "hit" if local >= 9 else "not hit"
    turn = ("fresh", "prefix hit", "later turn")[(local % 9) // 3]
    output = ("short", "medium", "long")[local % 3]
    return f"prompt, {hit}, {turn}, {output} output"


class LearnedPolicy(SegmentedPolicy):
    """``learned``: categories of blocks ranked by the reuse probability and reuse time learned
    in this run, LRU within a category (see the module docstring).

    Args:
        blocks: the pool's usable blocks, in initial reuse order.
        tau: the age, in capacities of allocations, over which a block's value falls by a
            factor e (a category e times as likely to be reused keeps its blocks that much
            longer).
        half_life: the learned counts halve every ``half_life`` x capacity evictions.
        ghost_factor: ghost-table generation size in multiples of the capacity (evicted hashes
            remembered to learn the reuses a larger cache would have had).
        deep_after: a prompt block that was not hit and lies this many blocks or more past the
            end of its request's hit prefix ranks in a deep category of its own; 0: none does.
    """

    __slots__ = ("_decay_every", "_evictions", "_freed", "_ghost_cls", "_ghost_cls_old",
                 "_heads", "_is_stale", "_live", "_promote", "_rate", "_refresh_every",
                 "_reused", "_stale", "_tails", "_value", "deep_after", "half_life", "tau")
    name: ClassVar[str] = "learned"
    reads_releases: ClassVar[bool] = True

    def __init__(self, blocks: Sequence[KVCacheBlock], *, tau: object = 2.0,
                 half_life: object = 1.0, ghost_factor: object = 2.0,
                 deep_after: object = 8) -> None:
        self.tau = check_share("tau", tau, 0.01, 100.0)
        after = check_share("deep_after", deep_after, 0.0, 1e6)
        if not after.is_integer():
            raise InvalidArgumentError(f"deep_after must be a whole number of blocks, got "
                                       f"{deep_after!r}")
        self.deep_after = int(after)
        self._promote = [_promoted(c) for c in range(NUM_CATEGORIES)]
        self.half_life = check_share("half_life", half_life, 0.01, 1000.0)
        super().__init__(blocks, 1 + NUM_CATEGORIES, ghost_factor, max_mark=1)
        # Per block, on the block: the category its latest release gave it (policy_tag: until
        # it is freed; -1 for none, or _AWAY - c while the pool holds it apart, reserve or pin,
        # after it was in category c) and whether it is the last full block of a finished
        # request (policy_tail: 1).
        for block in self._blocks:
            block.policy_tag = -1
            block.policy_tail = 0
        # Decayed per-category counts: blocks freed, and of them reused (hit while free, or a
        # ghost return).
        self._freed = [1.0] * NUM_CATEGORIES
        self._reused = [_prior(c) for c in range(NUM_CATEGORIES)]
        # What ranking reads: ln p(c) (refreshed from the counts every _refresh_every
        # evictions), and the value a block loses per eviction of age.
        self._value = [0.0] * NUM_CATEGORIES
        self._rate = 1.0 / max(self.tau * self.capacity, 1.0)
        self._evictions = 0
        self._decay_every = max(int(self.half_life * self.capacity), 1)
        self._refresh_every = max(self.capacity // 8, 64)
        # Categories that may hold blocks (emptied ones linger until a victim search drops
        # them): a short list, as a set's copy and updates are generic calls when compiled.
        self._live: list[int] = []
        # The ghost table, in two generations: evicted hash -> its category.  Keyed by the hash
        # alone, not by (group, hash) as the other policies' ghosts: the group is read per
        # block otherwise, and it matters only on a layout of more than one group, where every
        # block ranks in one category and a return changes no decision, only that category's
        # count (a hash evicted in one group and computed again in another counts as returned).
        self._ghost_cls: dict[BlockHash, int] = {}  # (young)
        self._ghost_cls_old: dict[BlockHash, int] = {}
        # Each segment's sentinels (fixed for the policy's life), read by index on the hot
        # paths: a property read is a Python call per use in the pure build.
        self._heads = [segment.head for segment in self._segments]
        self._tails = [segment.tail for segment in self._segments]
        # The categories whose counts changed since the last refresh (a flag per category and
        # their list): a refresh recomputes only their values.
        self._is_stale = [False] * NUM_CATEGORIES
        self._stale: list[int] = []
        self._refresh()

    # -- what the policy has learned ------------------------------------------------------------
    def reuse_probability(self, index: int) -> float:
        """The learned share of category ``index``'s freed blocks that were reused (at most 1:
        a late ghost return can outlive its own count's decay)."""
        return min(self._reused[index] / self._freed[index], 1.0)

    def category_of(self, block: KVCacheBlock) -> int | None:
        """The category a free cached ``block`` is ranked in, or ``None``."""
        segment = block.policy_segment
        return segment - 1 if segment > CLEAN else None

    def _refresh(self) -> None:
        """Recompute every category's value from its counts."""
        for c in range(NUM_CATEGORIES):
            self._stale_changed(c)
        self._refresh_stale()

    def _stale_changed(self, c: int) -> None:
        """Category ``c``'s counts changed: the next refresh recomputes its value."""
        if not self._is_stale[c]:
            self._is_stale[c] = True
            self._stale.append(c)

    def _refresh_stale(self) -> None:
        """Recompute the values of the categories whose counts changed since the last refresh
        (and of the deep categories ranked against them): the others' values are still exact,
        as a value reads the ratio of the counts only, which the decay keeps bit for bit
        (halving both is exact in binary floating point, and where the floor applies the
        ratio is kept as the count of reuses over one freed block)."""
        stale = self._stale
        if not stale:
            return
        is_stale = self._is_stale
        value = self._value
        reused = self._reused
        freed = self._freed
        # value(c) = ln min(p, 1), p the ratio of the counts (min() of two floats written out:
        # native when compiled, min() is not)
        for c in stale:
            is_stale[c] = False
            p = reused[c] / freed[c]
            value[c] = math.log((1.0 if p > 1.0 else p) + 1e-6)
        # A deep block is worth at most the shallow not-hit blocks of its release's category
        # (a hit on it needs theirs), and of equal worth it goes first.  Ranked by its own
        # count alone, a deep category that shows more reuse than the shallow one (a new
        # conversation's long prompt on Mooncake) outlived the blocks it extends: the first
        # half of the Mooncake trace at 8,192 blocks fell from 21.4% to 16.6%.  Recomputed
        # for the pairs a stale category is in.
        for c in stale:
            local = c - DEEP if c >= DEEP else c - 2
            if 0 <= local < 9:
                deep = DEEP + local
                p = reused[deep] / freed[deep]
                own = math.log((1.0 if p > 1.0 else p) + 1e-6)
                shallow = value[2 + local]
                value[deep] = (shallow if shallow < own else own) - 1e-9
        self._stale = []

    def _decay(self) -> None:
        """Halve the statistics (the prior's weight, one freed block, stays as a floor)."""
        freed = self._freed
        reused = self._reused
        for c in range(NUM_CATEGORIES):
            f = freed[c]
            if f == 1.0:  # at the floor (never freed, or decayed to it): halving and flooring
                continue  # give back the very same counts
            f *= 0.5
            r = reused[c] * 0.5
            if f < 1.0:
                r, f = r / f, 1.0
            freed[c] = f
            reused[c] = r

    # -- transitions ----------------------------------------------------------------------------
    def on_release(self, groups: Sequence[Sequence[KVCacheBlock]], release: Release) -> None:
        """A request is about to free (or hand back) the blocks of ``groups``, one list per
        KV-cache group in table order: tag each with its category, and mark the request's last
        full blocks as a tail a later turn can extend."""
        if len(groups) > 1:
            # More than one group: a hit needs every group's block at its end (a state
            # group's, a window's), so a block's worth depends on blocks of other groups that
            # its category does not see.  Ranked apart by category, a hybrid model's Mamba
            # states were evicted before the attention blocks they end and the hit rate fell
            # below LRU's (vLLM's replay of the shipped trace at 8,192 blocks: 21.0% against
            # 30.0%).  There every cached block ranks in one category: LRU order.
            for each in groups:
                for block in each:
                    if block.block_hash is not None:
                        block.policy_tag = UNTAGGED
            return
        if not groups:
            return
        group = groups[0]
        # (A typed list: the compiled build then slices and iterates it natively.)
        blocks: list[KVCacheBlock] = group if isinstance(group, list) else list(group)
        prompt_tokens = release.num_prompt_tokens
        output_tokens = release.num_output_tokens
        # The turn: a request whose leading blocks were hit, and among them the tail of an
        # earlier finished request, is a later turn (the null block, id 0, is never marked);
        # the frontier: the end of its hit prefix.
        turn = FRESH
        frontier = 0
        for block in blocks:
            if not block.policy_mark:
                break
            frontier += 1
            if block.policy_tail:
                turn = LATER_TURN
            elif turn == FRESH:
                turn = HIT
        bs = release.block_sizes[0]
        full_blocks = (prompt_tokens + output_tokens) // bs
        if full_blocks > len(blocks):  # (min() is a generic call per release)
            full_blocks = len(blocks)
        prompt_blocks = prompt_tokens // bs
        if prompt_blocks > full_blocks:
            prompt_blocks = full_blocks
        # Each block's category but its hit mark, read when it is freed (a hit one is
        # promoted).  Uncached blocks are tagged too: freed uncached, they lose the tag.  Prompt
        # blocks from ``deep_after`` past the frontier on are deep.
        # (category(False, False, turn, output_tokens[, deep]) written out: a call per release)
        prompt = 2 + 3 * turn + (0 if output_tokens < SHORT_OUTPUT_TOKENS
                                 else 1 if output_tokens < LONG_OUTPUT_TOKENS else 2)
        deep_from = frontier + self.deep_after if self.deep_after else prompt_blocks
        if deep_from < prompt_blocks:
            for block in blocks[:deep_from]:
                block.policy_tag = prompt
            deep = prompt - 2 + DEEP
            for block in blocks[deep_from:prompt_blocks]:
                block.policy_tag = deep
        else:
            for block in blocks[:prompt_blocks]:
                block.policy_tag = prompt
        if full_blocks > prompt_blocks:
            for block in blocks[prompt_blocks:full_blocks]:
                block.policy_tag = GENERATED
        # Where a later turn continues: after the answer, or after the prompt (the last cached
        # block of each; the null block, id 0, is never cached).  The last full block is
        # mostly cached: marked here without _mark_tail's call and loop.
        if full_blocks:
            last = blocks[full_blocks - 1]
            if last.block_hash is not None:
                last.policy_tail = 1
            else:
                self._mark_tail(blocks, full_blocks - 1)
        if prompt_blocks < full_blocks:
            self._mark_tail(blocks, prompt_blocks)

    def _mark_tail(self, blocks: Sequence[KVCacheBlock], end: int) -> None:
        """Mark the last cached block of ``blocks[:end]`` as a request's tail."""
        for j in range(end - 1, -1, -1):
            block = blocks[j]
            if block.block_hash is not None:
                block.policy_tail = 1
                return

    def on_free(self, uncached: Sequence[KVCacheBlock], cached: Sequence[KVCacheBlock]) -> None:
        if uncached:
            for block in uncached:  # no cache value: no category either
                block.policy_tag = -1
            super().on_free(uncached, ())
        if not cached:
            return
        tails = self._tails
        now = self._evictions
        promote = self._promote
        ghost = self._ghost_cls
        old = self._ghost_cls_old
        remembered = bool(ghost or old)
        # The blocks come in runs of one category (a request's blocks, tail first, are mostly
        # of one): each run is linked as a chain at its category's tail (``FreeBlockQueue``'s
        # append, inlined: the pool passes blocks whose count just reached 0), and its
        # category's counts are kept once per run.
        # (A typed list: the compiled build then iterates it natively; the pool passes lists.)
        batch: list[KVCacheBlock] = cached if isinstance(cached, list) else list(cached)
        run_c = -1  # the category of the run of blocks being linked,
        run = 0  # its length,
        away = 0  # and how many of them come back from the reserve or a pin (counted before)
        last: KVCacheBlock = tails[CLEAN]  # (replaced before use: run_c starts at -1)
        for block in batch:
            c = block.policy_tag
            if c >= 0:  # tagged by its release (not-hit prompt blocks: promoted if hit)
                block.policy_tag = -1
                if block.policy_mark:
                    c = promote[c]
                elif remembered:  # (a block that was hit was cached all along)
                    key: BlockHash = block.block_hash  # type: ignore[assignment]  # cached
                    # (membership tests, not pop(key, default): a miss, the common case, is
                    # then two lookups and no method call, interpreted or compiled)
                    if key in ghost or key in old:
                        c = self._ghost_return(key, c, block)
            else:
                back = 0
                if c == -1:  # freed without a release
                    c = UNTAGGED
                else:  # back from the hint reserve or a pin: counted when it was freed
                    block.policy_tag = -1
                    c = _AWAY - c
                    back = 1
                if remembered and not block.policy_mark:
                    key = block.block_hash  # type: ignore[assignment]  # cached
                    if key in ghost or key in old:
                        c = self._ghost_return(key, c, block)
                if c != run_c:  # (the run switch below, done here so that ``away`` counts
                    if run:  # this block in its own run)
                        self._close_run(run_c, last, run, run - away)
                    run_c = c
                    run = away = 0
                    last = tails[c + 1].prev_free  # type: ignore[assignment]  # linked
                away += back
            block.policy_segment = c + 1
            block.free_stamp = now
            if c != run_c:
                if run:
                    self._close_run(run_c, last, run, run - away)
                run_c = c
                run = away = 0
                last = tails[c + 1].prev_free  # type: ignore[assignment]  # linked
            last.next_free = block
            block.prev_free = last
            last = block
            run += 1
        self._close_run(run_c, last, run, run - away)
        self._num_free += len(batch)

    def _ghost_return(self, key: BlockHash, c: int, block: KVCacheBlock) -> int:
        """A freed block of category ``c`` whose hash ``key`` the ghost table remembers (a
        larger cache would have hit it): forget the key, count the reuse in the category it
        was evicted from, and mark the block hit; returns the category to rank it in (the hit
        one)."""
        ghost = self._ghost_cls
        entry = ghost.pop(key) if key in ghost else self._ghost_cls_old.pop(key)
        self._reused[entry] += 1.0
        self._stale_changed(entry)
        block.policy_mark = 1
        return self._promote[c]

    def _close_run(self, c: int, last: KVCacheBlock, run: int, new: int) -> None:
        """End ``on_free``'s run of ``run`` blocks of category ``c`` (``last`` its last block,
        ``new`` of them freed now): link it to the segment's tail sentinel, count the blocks in
        the segment and the new ones as freed in the category, and make it live."""
        tail = self._tails[c + 1]
        last.next_free = tail
        tail.prev_free = last
        self._segments[c + 1]._num_free += run  # (FreeBlockQueue.linked, inlined)
        if new:
            self._freed[c] += float(new)  # (float: a native add when compiled)
            self._stale_changed(c)
        if c not in self._live:
            self._make_live(c)

    def _make_live(self, c: int) -> None:
        """Add category ``c`` to the live list, kept in category order (the victim search takes
        the first of equal values)."""
        live = self._live
        live.append(c)
        live.sort()

    def on_touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A hit on free blocks: a reuse of each one's category, which the block keeps as its tag
        until a release retags it, so that a block freed again without a release (a caller
        that refreshes recency by touching and freeing, as kvcore's SGLang backend does on a
        lookup; a sliding window's drop) returns to its category, not to the untagged one."""
        batch = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        reused = self._reused
        for block in batch:
            if block.ref_cnt == 0:
                segment = block.policy_segment
                if segment > CLEAN:
                    reused[segment - 1] += 1.0
                    self._stale_changed(segment - 1)
                    block.policy_tag = segment - 1
        super().on_touch(batch)

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A hit on blocks the policy does not hold: those a scheduler hint kept in the pool's
        reserve since their release count as freed and reused in the category the release gave
        them (else a category whose blocks come back while their request waits would look
        unused)."""
        for block in blocks:
            c = block.policy_tag
            if c >= 0:  # released into the reserve: never freed into the policy
                block.policy_tag = -1
                if block.policy_mark:  # (its mark at release)
                    c = self._promote[c]
                self._freed[c] += 1.0
                self._reused[c] += 1.0
                self._stale_changed(c)
            elif c < -1:  # taken from the policy into the reserve: counted as freed then
                block.policy_tag = -1
                self._reused[_AWAY - c] += 1.0
                self._stale_changed(_AWAY - c)
        super().on_hit(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        """The pool takes a free block out (into the hint reserve, or a pin): it keeps its
        category, to be ranked in it again when it comes back."""
        segment = block.policy_segment
        if segment > CLEAN:
            block.policy_tag = _AWAY - (segment - 1)
        super().remove(block)

    def pick_victims(self, n: int, ref_cnt: int) -> list[KVCacheBlock]:
        """The ``n`` victims: uncached blocks first, then cached ones, each the head of the live
        category of the lowest value ``ln p(c) - age(head) * rate`` (values are compared at the
        call's clock).  Within a category values rise from head to tail, so the victims come
        in runs: the best category's blocks are taken while they are worth at most the
        runner-up's head, and unlinked in one splice (``FreeBlockQueue``'s logic, inlined as
        in ``slru``).  With one live category there is nothing to compare: its blocks are
        taken in order.  (One method: a second frame per call costs the pure build about as
        much as a victim.)"""
        heads = self._heads
        tails = self._tails
        value = self._value
        rate = self._rate
        now = self._evictions
        live = self._live
        ghost = self._ghost_cls
        remember = self.ghost_capacity > 0
        out: list[KVCacheBlock] = [heads[CLEAN]] * n  # (filled in order: no appends)
        k = 0
        self._num_free -= n
        if heads[CLEAN].next_free is not tails[CLEAN]:  # uncached blocks: those first
            clean = self._segments[CLEAN]
            k = n if n < len(clean) else len(clean)
            out[:k] = uncached = clean.pick_victims(k, ref_cnt)
            for block in uncached:
                block.policy_segment = NOT_FREE
            if k == n:
                return out
        cached = need = n - k
        while need:
            if len(live) == 1:  # (no runner-up: every block is worth at most infinity)
                best = live[0]
                limit = now
            else:
                # The best category (lowest head value) and the runner-up's head value, one
                # pass.
                best = -1
                best_key = bar = math.inf
                for c in live[:]:
                    first: KVCacheBlock = heads[c + 1].next_free  # type: ignore[assignment]
                    if first is tails[c + 1]:
                        live.remove(c)  # emptied by hits or victims since
                        continue
                    key = value[c] - (now - first.free_stamp) * rate
                    if key < best_key:
                        best, best_key, bar = c, key, best_key
                    elif key < bar:
                        bar = key
                # The run goes on while the next block is worth at most ``bar``: a stamp bound,
                # as an int (stamps are ints: ``s > x`` is ``s > floor(x)``; without a
                # runner-up, ``now``, which no stamp exceeds), so the per-block test compares
                # ints.
                limit = math.floor(now + (bar - value[best]) / rate) if bar < math.inf else now
            head = heads[best + 1]
            segment = self._segments[best + 1]
            size = segment._num_free  # (len(segment), without the call)
            take = taken = need if need < size else size
            node: KVCacheBlock = head.next_free  # type: ignore[assignment]  # linked: its head
            # The run ends at ``need``, at the category's end (``size`` blocks), or at a block
            # freed after the stamp bound (never the head: a rounding error cannot stall this;
            # with the bound at ``now`` or above no stamp exceeds it, and the stamps go unread).
            bounded = limit < now
            for i in range(take):
                if bounded and i and node.free_stamp > limit:
                    taken = i
                    break
                nxt: KVCacheBlock = node.next_free  # type: ignore[assignment]  # linked
                node.prev_free = node.next_free = None
                node.ref_cnt = ref_cnt
                node.policy_segment = NOT_FREE
                node.policy_mark = node.policy_tail = 0
                if remember:
                    ghost[node.block_hash] = best  # type: ignore[index]  # hashed
                out[k + i] = node
                node = nxt
            head.next_free = node
            node.prev_free = head
            segment._num_free = size - taken  # (FreeBlockQueue.unlinked, inlined)
            k += taken
            need -= taken
            if taken == size:
                live.remove(best)
        if remember and len(ghost) >= self.ghost_capacity:
            self._ghost_cls_old = ghost
            self._ghost_cls = {}
        self._evictions = after = now + cached
        if after // self._decay_every != now // self._decay_every:
            self._decay()  # (values read ratios, which the decay keeps: no full refresh)
            self._refresh_stale()
        elif after // self._refresh_every != now // self._refresh_every:
            self._refresh_stale()
        return out

    def on_evict(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            block.policy_mark = block.policy_tail = 0

    def on_uncache(self, block: KVCacheBlock) -> None:
        block.policy_tail = 0
        super().on_uncache(block)
        block.policy_tag = -1

    def reset(self) -> None:
        super().reset()
        self._live = []
        for block in self._blocks:
            block.policy_tag = -1
            block.policy_tail = 0
        self._ghost_cls = {}
        self._ghost_cls_old = {}

    def check(self) -> list[str]:
        problems = super().check()
        for c in range(NUM_CATEGORIES):
            if self._freed[c] < 1.0 or self._reused[c] < 0.0:
                problems.append(f"category {c} ({describe_category(c)}): {self._reused[c]} "
                                f"reused of {self._freed[c]} freed")
        for block in self._segments[CLEAN]:
            if block.policy_tail or block.policy_tag != -1:
                problems.append(f"uncached block {block.block_id} is marked a request's tail "
                                f"or has a category")
        young, old = len(self._ghost_cls), len(self._ghost_cls_old)
        if max(young, old) >= self.ghost_capacity + self.capacity:
            problems.append(f"a ghost generation holds {young} / {old} hashes, more than "
                            f"{self.ghost_capacity} plus a batch of victims")
        return problems
