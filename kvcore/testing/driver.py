"""A driver that runs a :class:`~kvcore.manager.KVCacheManager` through valid and hostile calls.

It plays a scheduler and an engine: requests with shared prefixes, tenants (cache salts), LoRA
names and multimodal items are admitted with their prefix hits (sometimes with tokens computed
elsewhere, loaded later), prefilled in chunks, decoded, preempted, failed and freed, while the
prefix cache is evicted and reset.  Between those it makes the calls a buggy caller makes:
freed or duplicate requests, claimed hits without blocks, blocks of another pool, hits evicted
since their lookup, null blocks where KV is needed, counts that are negative or bools, tokens
claimed computed without a slot — and arbitrary perturbations of real hits.

Every operation takes its parameters explicitly, so a property-testing library (the tests) or a
seeded generator (``python -m kvcore.bench fuzz``) can drive it, and checks its outcome:

* a valid call does what it should, and every adopted hit and every running request's table
  holds the request's own KV wherever its next token reads (:class:`ContentOracle`);
* a call that cannot be right raises the typed error naming the problem and changes nothing at
  all (a whole-state snapshot before and after);
* ``check()`` runs ``check_invariants()`` and the leak checks.

A broken rule raises ``AssertionError`` (or :class:`WrongKVError`, its subclass) with a message.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcore.errors import (
    BlockStateError,
    InvalidArgumentError,
    InvalidHitError,
    KVCoreError,
    NullBlockError,
    RequestStateError,
    UnknownRequestError,
)
from kvcore.request import Request
from kvcore.testing.oracle import ContentOracle
from kvcore.testing.setups import Setup
from kvcore.testing.snapshot import manager_snapshot
from kvcore.types import KVCacheBlock, KVCacheBlocks, MultiModalItem

VOCAB = 3  # tiny: equal blocks at different positions and after different prefixes are common
SALTS = (None, None, "tenant-a", "tenant-b")
LORAS = (None, None, None, "adapter-1")
ENCODER_TOKENS = 6
PERTURBATIONS = ("none", "truncate", "swap", "replace", "null", "count", "other")


@dataclass
class _Step:
    """The latest successful admit/step, which ``fail_step`` may undo."""

    request: Request
    start: int
    end: int


@dataclass
class HostileDriver:
    """Drives one manager built from ``setup`` (see the module docstring)."""

    setup: Setup
    counts: Counter[str] = field(default_factory=Counter)
    operation: str = "start"  # the operation under way (random_operation names it)

    def __post_init__(self) -> None:
        self.m = self.setup.build()
        self.other = self.setup.build()  # its blocks are foreign to self.m
        self.oracle = ContentOracle(self.m)
        self.block_size = max(s.block_size for s in self.setup.specs)
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.loading: dict[str, tuple[Request, int]] = {}  # delayed external KV: tokens when loaded
        self.done: list[Request] = []
        # Deferred frees: block batches pop_blocks_for_free handed out, not returned yet; and
        # batches already returned (a buggy engine may return them again).
        self.withheld: list[list[KVCacheBlock]] = []
        self.returned: list[list[KVCacheBlock]] = []
        self.last: _Step | None = None
        self._counter = 0
        self._families = [[(7 * f + 3 * i + i // 5) % VOCAB for i in range(40)] for f in range(3)]
        self._cross = any(s.reads_encoder for s in self.setup.specs)

    # -- helpers --------------------------------------------------------------------------------
    def _pick(self, items: Sequence[Request], i: int) -> Request | None:
        return items[i % len(items)] if items else None

    def _running(self, i: int) -> Request | None:
        return self.running[sorted(self.running)[i % len(self.running)]] if self.running else None

    def _refused(self, error: type[Exception], call: Callable[[], object], *words: str) -> None:
        """``call`` must raise ``error`` (its message containing ``words``) and change nothing."""
        before = manager_snapshot(self.m)
        try:
            call()
        except error as exc:
            message = str(exc)
            missing = [w for w in words if w not in message]
            assert not missing, f"{type(exc).__name__} message {message!r} lacks {missing}"
        else:
            raise AssertionError(f"expected {error.__name__}, the call succeeded")
        assert manager_snapshot(self.m) == before, "a refused call changed the manager"
        self.counts[f"refused {error.__name__}"] += 1

    def _admitted(self, request: Request, hit_blocks: Sequence[Sequence[KVCacheBlock]],
                  num_hit: int, num_external: int, num_new: int, delay: bool) -> None:
        """Bookkeeping after a successful admission."""
        self.oracle.check_hit(request, hit_blocks, num_hit)
        self.waiting.remove(request)
        request.num_computed_tokens = num_hit
        if delay:
            self.loading[request.request_id] = (request, num_hit + num_external)
            self.last = None
            return
        end = num_hit + num_external + num_new
        self.oracle.written(request, num_hit, end, num_hit + num_external)
        request.num_computed_tokens = end
        self.running[request.request_id] = request
        self.last = _Step(request, num_hit, end)
        self.counts["hit tokens"] += num_hit

    # -- valid operations -----------------------------------------------------------------------
    def add(self, family: int, keep: int, tail: Sequence[int], salt: int, lora: int,
            image: bool) -> None:
        """A new waiting request: a prefix of a shared family plus its own tail."""
        base = self._families[family % len(self._families)]
        tokens = (base[:keep % (len(base) + 1)] + [t % VOCAB for t in tail])
        tokens = tokens[:self.setup.max_model_len - 2] or [0]
        self._counter += 1
        items: tuple[MultiModalItem, ...] = ()
        if image and len(tokens) >= 6:
            items = (MultiModalItem(f"img{family % 2}", 2, 3),)
        self.waiting.append(self.m.make_request(
            f"r{self._counter}", tokens, cache_salt=SALTS[salt % len(SALTS)],
            lora_name=LORAS[lora % len(LORAS)], mm_items=items))
        self.counts["add"] += 1
        self.last = None

    def admit(self, i: int, chunk: int, external: int = 0, lookahead: int = 0,
              delay: bool = False) -> None:
        """Look a waiting request up and admit it with its hit (``external`` tokens after the
        hit computed elsewhere; with ``delay`` they load asynchronously)."""
        req = self._pick(self.waiting, i)
        if req is None:
            return
        blocks, hit = self.m.get_computed_blocks(req)
        room = req.num_tokens - hit
        external = min(external, room - 1)
        delay = delay and external > 0
        num_new = 0 if delay else max(1, min(chunk, room - external))
        before = manager_snapshot(self.m)
        out = self.m.allocate_slots(
            req, num_new, hit, blocks, num_lookahead_tokens=lookahead,
            num_external_computed_tokens=external, delay_cache_blocks=delay,
            num_encoder_tokens=ENCODER_TOKENS if self._cross else 0)
        if out is None:
            assert manager_snapshot(self.m) == before, "a None allocation changed the manager"
            self.counts["admit: no room"] += 1
            self.last = None
            return
        self._copy_blocks()
        self._admitted(req, blocks, hit, external, num_new, delay)
        self.counts["admit"] += 1

    def finish_load(self, i: int) -> None:
        """An asynchronous external load completed: its blocks are cached and it runs."""
        if not self.loading:
            return
        rid = sorted(self.loading)[i % len(self.loading)]
        req, upto = self.loading.pop(rid)
        self.oracle.written(req, req.num_computed_tokens, upto, upto)  # loaded, not computed
        self.m.cache_blocks(req, upto)
        req.num_computed_tokens = upto
        self.running[rid] = req
        self.counts["finish_load"] += 1
        self.last = None

    def step(self, i: int, chunk: int, token: int, lookahead: int = 0) -> None:
        """A running request computes its next prefill chunk, or decodes one token."""
        req = self._running(i)
        if req is None:
            return
        start = req.num_computed_tokens
        if start < req.num_tokens:
            n = min(chunk, req.num_tokens - start)
        elif req.num_tokens < self.setup.max_model_len:
            req.append_output_token_ids(token % VOCAB)
            n = 1
        else:
            self.last = None
            return
        n = min(n, self.setup.max_model_len - start)
        before = manager_snapshot(self.m)
        out = (self.m.allocate_slots(req, n, num_lookahead_tokens=lookahead) if lookahead
               else self.m.allocate_slots(req, n))
        if out is None:
            assert manager_snapshot(self.m) == before, "a None allocation changed the manager"
            self.counts["step: no room"] += 1
            self.last = None
            return
        self._copy_blocks()
        self.oracle.written(req, start, start + n)
        req.num_computed_tokens = start + n
        self.last = _Step(req, start, start + n)
        self.counts["step"] += 1

    def _copy_blocks(self) -> None:
        """Run the block copies the allocation recorded (a partial-block hit's copy-on-write)
        before its step writes anything; their endpoints stay withheld until
        :meth:`return_withheld`, as an engine returns them once the step is processed."""
        pairs, retained = self.m.take_block_copies()
        if not pairs:
            return
        for source, destination in pairs:
            self.oracle.copied(source, destination)
        self.withheld.append(retained)
        self.counts["block copies"] += len(pairs)

    def _pick_holder(self, i: int) -> Request | None:
        """The ``i``-th running or loading request (by id), or ``None`` when there is none."""
        pool: list[Request] = [*self.running.values(), *(r for r, _ in self.loading.values())]
        return self._pick(sorted(pool, key=lambda r: r.request_id), i)

    def _released(self, req: Request, preempt: bool, counter: str) -> None:
        """Bookkeeping once ``req``'s blocks left it: finished, or back to waiting for recompute."""
        self.running.pop(req.request_id, None)
        self.loading.pop(req.request_id, None)
        if preempt:
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.waiting.append(req)
        else:
            self.done.append(req)
            del self.done[:-8]
        self.counts[counter] += 1
        self.last = None

    def free(self, i: int, preempt: bool) -> None:
        """A running (or loading) request finishes, or is preempted for recompute."""
        req = self._pick_holder(i)
        if req is None:
            return
        self.m.free(req)
        self._released(req, preempt, "preempt" if preempt else "free")

    def defer_free(self, i: int, preempt: bool) -> None:
        """As :meth:`free`, but deferred (an engine whose in-flight step may still write the
        blocks): the request is forgotten and its blocks withheld until :meth:`return_withheld`;
        meanwhile they count as used and stay hittable."""
        req = self._pick_holder(i)
        if req is None:
            return
        free_before = self.m.pool.num_free_blocks
        blocks = self.m.pop_blocks_for_free(req)
        assert self.m.pool.num_free_blocks == free_before, "a deferred free freed blocks"
        assert all(b.ref_cnt > 0 and not b.is_null for b in blocks)
        self.withheld.append(blocks)
        self._released(req, preempt, "deferred free")

    def return_withheld(self, i: int) -> None:
        """The step that might still write a deferred free's blocks finished: return them,
        tail first (their prefix is evicted last)."""
        if not self.withheld:
            return
        blocks = self.withheld.pop(i % len(self.withheld))
        self.m.free_withheld(reversed(blocks))
        self.returned.append(blocks)
        del self.returned[:-4]
        self.counts["withheld returned"] += 1

    def return_twice(self, i: int) -> None:
        """Blocks returned again, or blocks of another pool: refused, nothing changes."""
        if self.returned:
            blocks = self.returned[i % len(self.returned)]
            if blocks and all(b.block_id not in self.m.withheld_blocks() for b in blocks):
                self._refused(BlockStateError, lambda: self.m.free_withheld(blocks), "withheld")
        foreign = self.other.pool.blocks[1 + i % (len(self.other.pool.blocks) - 1)]
        self._refused(BlockStateError, lambda: self.m.free_withheld([foreign]),
                      "not a block of this pool")

    def fail_step(self) -> None:
        """The latest step's forward pass failed: its KV was never written.  As an engine does
        (``Scheduler.fail_step``), drop what it would have cached and abort the request."""
        last = self.last
        self.last = None
        if last is None or last.request.request_id not in self.running:
            return
        req = last.request
        self.oracle.discard(req, last.start, last.end)
        self.m.uncache_blocks(req, last.start)
        self.m.free(req)
        del self.running[req.request_id]
        self.done.append(req)
        # The client retries the same prompt: its lookup must not find what was never written.
        self._counter += 1
        self.waiting.append(self.m.make_request(
            f"r{self._counter}", req.prompt_token_ids, cache_salt=req.cache_salt,
            lora_name=req.lora_name, mm_items=req.mm_items))
        self.counts["fail_step"] += 1

    def new_step(self) -> None:
        self.oracle.end_step()
        self.m.new_step()
        self.last = None

    def evict(self, ids: Sequence[int]) -> None:
        valid = [1 + i % (self.setup.num_blocks - 1) for i in ids]
        self.m.evict_blocks(valid)
        self.counts["evict"] += 1
        self.last = None

    def reset(self) -> None:
        in_use = self.m.pool.num_free_blocks != self.setup.num_blocks - 1
        assert self.m.reset_prefix_cache() == (not in_use)
        self.last = None

    # -- hostile operations: each must be refused and change nothing ----------------------------
    def bad_count(self, i: int, arg: int, value: int) -> None:
        """A count that is negative, a bool, a float, None or a str."""
        req = self._running(i) or self._pick(self.waiting, i)
        if req is None:
            return
        names = ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
                 "num_external_computed_tokens", "num_encoder_tokens")
        name = names[arg % len(names)]
        bad = (-1, True, 1.5, None, "3")[value % 5]
        kwargs: dict[str, object] = {"num_new_tokens": 1, name: bad}
        self._refused(InvalidArgumentError, lambda: self.m.allocate_slots(req, **kwargs),  # type: ignore[arg-type]  # deliberately bad
                      name)
        self.last = None

    def use_freed(self, i: int) -> None:
        """Calls on a request that was freed without resetting its progress."""
        req = self._pick([r for r in self.done if r.num_computed_tokens], i)
        if req is None or req.request_id in self.running or req.request_id in self.loading:
            return
        self._refused(RequestStateError, lambda: self.m.allocate_slots(req, 1), "holds no blocks")
        self._refused(UnknownRequestError, lambda: self.m.free(req), req.request_id)
        self._refused(UnknownRequestError, lambda: self.m.cache_blocks(req, 1), req.request_id)
        self.last = None

    def claim_without_blocks(self, i: int, blocks: int) -> None:
        """num_new_computed_tokens > 0 with no, or too few, hit blocks."""
        req = self._pick(self.waiting, i)
        if req is None or req.num_tokens <= self.block_size:
            return
        claimed = min(1 + blocks % 3, (req.num_tokens - 1) // self.block_size) * self.block_size
        empty = KVCacheBlocks([] for _ in self.setup.specs)
        why = str(claimed) if self.setup.enable_caching else "disabled"
        self._refused(InvalidHitError, lambda: self.m.allocate_slots(req, 1, claimed, None), why)
        self._refused(InvalidHitError, lambda: self.m.allocate_slots(req, 1, claimed, empty))
        self.last = None

    def foreign_hit(self, i: int) -> None:
        """A real hit, but found in another manager's pool."""
        req = self._pick(self.waiting, i)
        if req is None or not self.setup.enable_caching:
            return
        twin = self.other.make_request("twin", req.all_token_ids, cache_salt=req.cache_salt,
                                       lora_name=req.lora_name, mm_items=req.mm_items)
        if self.other.allocate_slots(twin, twin.num_tokens) is None:
            return
        self.other.free(twin)
        probe = self.other.make_request("probe", req.all_token_ids, cache_salt=req.cache_salt,
                                        lora_name=req.lora_name, mm_items=req.mm_items)
        blocks, hit = self.other.get_computed_blocks(probe)
        if hit and any(not b.is_null for g in blocks for b in g):
            self._refused(InvalidHitError, lambda: self.m.allocate_slots(req, 1, hit, blocks),
                          "not a block of this manager's pool")
        self.other.reset_prefix_cache()
        self.last = None

    def stale_hit(self, i: int) -> None:
        """A hit whose block was evicted between the lookup and the allocation."""
        req = self._pick(self.waiting, i)
        if req is None:
            return
        blocks, hit = self.m.get_computed_blocks(req)
        real = [b for g in blocks for b in g if not b.is_null]
        if not hit or not real:
            return
        self.m.evict_blocks([real[i % len(real)].block_id])
        self._refused(InvalidHitError, lambda: self.m.allocate_slots(req, 1, hit, blocks),
                      "no longer cached")
        self.last = None

    def duplicate_id(self, i: int) -> None:
        """A second request object with the id of a running one."""
        req = self._running(i)
        if req is None:
            return
        dup = self.m.make_request(req.request_id, req.all_token_ids)
        self._refused(RequestStateError, lambda: self.m.allocate_slots(dup, 1), "another")
        self._refused(RequestStateError, lambda: self.m.free(dup), "another")
        self._refused(RequestStateError, lambda: self.m.cache_blocks(dup, 1), "another")
        self.last = None

    def overrun(self, i: int, extra: int) -> None:
        """A running request claims tokens as computed that never had a slot."""
        req = self._running(i)
        if req is None:
            return
        saved = req.num_computed_tokens
        # The slots every table sized by them holds (not encoder groups, sized by the encoder's
        # tokens, nor Mamba "align" groups, sized by the main model's: no lookahead slots).
        capacity = min((len(t) * m.block_size for t, m in
                        zip(self.m.get_blocks(req.request_id), self.m.coordinator.managers)
                        if not m.uses_encoder_tokens and not m.counts_own_growth),
                       default=self.m.num_slots(req.request_id))
        req.num_computed_tokens = capacity + 1 + extra % 4
        try:
            self._refused(RequestStateError, lambda: self.m.allocate_slots(req, 1), "slots")
        finally:
            req.num_computed_tokens = saved
        self._refused(RequestStateError,
                      lambda: self.m.cache_blocks(req, capacity + 1 + extra % 4), "slots")
        self.last = None

    def null_where_needed(self, i: int) -> None:
        """A real hit with a null block at a position the next token reads."""
        req = self._pick(self.waiting, i)
        if req is None:
            return
        blocks, hit = self.m.get_computed_blocks(req)
        self.last = None
        group = next((g for g, s in enumerate(self.setup.specs) if blocks[g] and s.needed_positions(hit)),
                     None)
        if group is None:
            return
        spec = self.setup.specs[group]
        forged = [list(b) for b in blocks]
        forged[group][(spec.needed_positions(hit).stop - 1) // spec.block_size] = self.m.pool.null_block
        claim = KVCacheBlocks(forged)
        self._refused(InvalidHitError, lambda: self.m.allocate_slots(req, 1, hit, claim), "null")

    def hit_while_running(self, i: int) -> None:
        req = self._running(i)
        if req is None:
            return
        null = self.m.pool.null_block
        forged = KVCacheBlocks([null] for _ in self.setup.specs)
        self._refused(RequestStateError, lambda: self.m.allocate_slots(
            req, 1, self.setup.specs[0].block_size, forged), "running")
        self.last = None

    def bad_calls(self, i: int) -> None:
        """Wrong group counts, unknown ids, foreign blocks given to the pool, bad evictions."""
        req = self._running(i) or self._pick(self.waiting, i)
        m, pool = self.m, self.m.pool
        groups = len(self.setup.specs)
        if req is not None:
            wrong = KVCacheBlocks([] for _ in range(groups + 1))
            self._refused(InvalidArgumentError, lambda: m.allocate_slots(req, 1, 0, wrong),
                          "per group")
        self._refused(UnknownRequestError, lambda: m.get_block_ids("no-such-request"))
        self._refused(UnknownRequestError,
                      lambda: m.remove_skipped_blocks("no-such-request", 0))
        foreign = self.other.pool.blocks[1 + i % (self.setup.num_blocks - 1)]
        self._refused(BlockStateError, lambda: pool.touch([foreign]), "not a block of this pool")
        self._refused(BlockStateError, lambda: pool.free_blocks([foreign]),
                      "not a block of this pool")
        self._refused(BlockStateError, lambda: pool.touch(["block"]),  # type: ignore[list-item]  # deliberately bad
                      "not a KV-cache block")
        self._refused(NullBlockError, lambda: m.evict_blocks([0]))
        self._refused(InvalidArgumentError, lambda: m.evict_blocks([self.setup.num_blocks]))
        self._refused(InvalidArgumentError, lambda: m.evict_blocks([True]))
        free = pool.policy.first()
        if free is not None:
            self._refused(KVCoreError, lambda: pool.free_blocks([free]), "freed")
        self.last = None

    def perturbed_hit(self, i: int, j: int, how: int, k: int) -> None:
        """Admit with a real hit perturbed in one of several ways.  kvcore must either refuse
        it (typed error, nothing changed) or accept it — and then the oracle proves every block
        it adopted holds the request's own KV where the request reads it."""
        req = self._pick(self.waiting, i)
        if req is None:
            return
        kind = PERTURBATIONS[how % len(PERTURBATIONS)]
        blocks, hit = self.m.get_computed_blocks(req)
        lists = [list(g) for g in blocks]
        lcm = self.m.coordinator.alignment_tokens
        if kind == "truncate" and hit:
            hit -= lcm * (1 + k % max(1, hit // lcm))
            # (Blocks covering the shorter hit: the last may hold it partly, a partial-block
            # hit when the pool takes them.)
            lists = [g[:-(-hit // s.block_size)] if g else g
                     for g, s in zip(lists, self.setup.specs)]
        elif kind == "swap":
            g = lists[k % len(lists)]
            if len(g) > 1:
                a, b = k % len(g), (k // 7) % len(g)
                g[a], g[b] = g[b], g[a]
        elif kind in ("replace", "null"):
            g = lists[k % len(lists)]
            if g:
                g[k % len(g)] = (self.m.pool.null_block if kind == "null"
                                 else self.m.pool.blocks[1 + j % (self.setup.num_blocks - 1)])
        elif kind == "count":
            hit = max(0, hit + (lcm if k % 2 else -lcm))
        elif kind == "other":
            donor = self._pick(self.waiting, j)
            if donor is not None:
                donated, hit = self.m.get_computed_blocks(donor)
                lists = [list(g) for g in donated]
        forged = KVCacheBlocks(lists)
        hit = max(hit, 0)
        num_new = max(0 if hit else 1, min(self.block_size, req.num_tokens - hit))
        if hit + num_new > self.setup.max_model_len:
            return
        before = manager_snapshot(self.m)
        try:
            out = self.m.allocate_slots(req, num_new, hit, forged,
                                        num_encoder_tokens=ENCODER_TOKENS if self._cross else 0)
        except InvalidArgumentError:  # InvalidHitError and RequestStateError included
            assert manager_snapshot(self.m) == before, "a refused hit changed the manager"
            self.counts[f"perturbed {kind}: refused"] += 1
            self.last = None
            return
        if out is None:
            assert manager_snapshot(self.m) == before, "a None allocation changed the manager"
            self.last = None
            return
        self._copy_blocks()
        self._admitted(req, forged, hit, 0, num_new, False)
        self.counts[f"perturbed {kind}: accepted"] += 1

    # -- checks ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Invariants, every running table's content, and no leak once nothing runs."""
        self.m.check_invariants()
        for req in self.running.values():
            self.oracle.check_table(req)
        withheld = {b.block_id for blocks in self.withheld for b in blocks}
        assert self.m.withheld_blocks().keys() == withheld, "withheld blocks differ"
        if not self.running and not self.loading:
            assert self.m.pool.num_free_blocks == self.setup.num_blocks - 1 - len(withheld), (
                f"{self.setup.num_blocks - 1 - len(withheld) - self.m.pool.num_free_blocks} "
                "blocks leaked")
            assert not self.m.requests()

    def drain(self) -> None:
        """Free everything still held, then check that nothing leaked."""
        for req in [*self.running.values(), *(r for r, _ in self.loading.values())]:
            self.m.free(req)
        self.running.clear()
        self.loading.clear()
        while self.withheld:
            self.return_withheld(0)
        self.check()
