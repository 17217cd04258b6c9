"""A content oracle: what every KV slot of a manager's pool holds, tracked without hashes.

The code driving a :class:`~kvcore.manager.KVCacheManager` reports what each step computes
(``written``); the oracle then checks every prefix hit (``check_hit``) and every running
request's block table (``check_table``) against what the blocks really hold.  A token's KV is
identified by its exact prefix — every token up to it, the request's LoRA and cache salt (the
tenant) and the multimodal item position it belongs to — interned as a small int, so two slots
hold the same KV exactly when they hold the same key.  Nothing here uses kvcore's hashes: a hash
collision that serves the wrong KV is caught as a mismatch.

What a token attends to decides which positions a hit or table must cover with real blocks
(``KVCacheSpec.needed_positions``): full attention all earlier positions, a sliding window of
``w`` the last ``w - 1``, chunked local attention its own chunk, a Mamba state the one after
the token before it.  A state (Mamba)
is produced at the end of the step that computes it, so another request may not read it before
the next step (``end_step`` counts steps); attention KV is written before attention reads it in
the same forward pass, so it can be shared within the step.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.manager import KVCacheManager
from kvcore.types import KVCacheBlock, KVRequest

UNWRITTEN = -1
"""Slot content before anything is written, and after a failed step (``discard``)."""


class WrongKVError(AssertionError):
    """A block served as a hit, or held in a running request's table, does not hold that
    request's KV where the request needs it."""


class ContentOracle:
    """Tracks the content of every slot of ``manager``'s pool (see the module docstring)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._specs = [g.spec for g in manager.config.groups]
        width = max(s.block_size for s in self._specs)
        self._slots: list[list[int]] = [[UNWRITTEN] * width
                                        for _ in range(manager.pool.num_blocks)]
        self._intern: dict[tuple[object, ...], int] = {}
        self._keys: dict[str, tuple[KVRequest, list[int]]] = {}
        self._step = 0
        self._state_step = [-1] * manager.pool.num_blocks  # step that last wrote a state block
        # A state block holds one state: the one after the last token written into it (its
        # earlier slots only say which tokens it went through).
        self._state_last = [UNWRITTEN] * manager.pool.num_blocks
        self._step_slots: list[tuple[int, int]] = []  # (block id, offset) written this step
        self._failed: set[int] = set()  # blocks a failed step wrote, not rewritten since
        # Partial-block hits: Mamba2's prefill checkpoint is exported at any hash unit, into the
        # slot before the running state's (the worker's rule, vLLM's
        # ``compute_mamba_prefill_checkpoints``), not by token position.
        self._partial = manager.config.partial_block_hits

    # -- what a request's tokens are -----------------------------------------------------------
    def keys(self, request: KVRequest) -> list[int]:
        """One key per token of ``request`` (its exact prefix up to and including the token)."""
        rid = request.request_id
        entry = self._keys.get(rid)
        if entry is None or entry[0] is not request:
            entry = self._keys[rid] = (request, [])
        keys = entry[1]
        tokens = request.all_token_ids
        if len(keys) < len(tokens):
            intern = self._intern
            parent = keys[-1] if keys else self._intern_key(
                ("root", request.cache_salt, request.lora_name))
            items = request.mm_items
            for p in range(len(keys), len(tokens)):
                item = next(((it.identifier, p - it.offset) for it in items
                             if it.offset <= p < it.offset + it.length), None)
                key = (parent, tokens[p], item)
                value = intern.get(key)
                if value is None:
                    value = intern[key] = len(intern)
                keys.append(value)
                parent = value
        return keys

    def _intern_key(self, key: tuple[object, ...]) -> int:
        value = self._intern.get(key)
        if value is None:
            value = self._intern[key] = len(self._intern)
        return value

    # -- writes ---------------------------------------------------------------------------------
    def written(self, request: KVRequest, start: int, end: int,
                computed_from: int | None = None) -> None:
        """The request's tokens ``[start, end)`` were computed (or loaded) into its current block
        tables, those from ``computed_from`` on (default ``start``) computed by this step.
        Positions that no later token reads may have no block (tokens loaded from elsewhere
        that are already outside the window or chunk)."""
        if start >= end:
            return
        keys = self.keys(request)
        tables = self._manager.get_blocks(request.request_id)
        for g, spec in enumerate(self._specs):
            if spec.reads_encoder:
                continue
            bs = spec.block_size
            blocks = tables[g]
            state = spec.holds_state
            read_later = spec.needed_positions(end).start
            for p in range(start, end):
                i = p // bs
                if i >= len(blocks) or blocks[i].is_null:
                    if p < read_later:
                        continue
                    raise WrongKVError(f"request {request.request_id!r} computes position {p} "
                                       f"but group {g} has no block for it")
                block_id = blocks[i].block_id
                self._slots[block_id][p - i * bs] = keys[p]
                self._step_slots.append((block_id, p - i * bs))
                self._failed.discard(block_id)
                if state:
                    self._state_step[block_id] = self._step
                    self._state_last[block_id] = keys[p]
            if state and self._partial:
                self._export_checkpoint(g, blocks, keys,
                                        start if computed_from is None else computed_from, end)

    def _export_checkpoint(self, g: int, blocks: Sequence[KVCacheBlock], keys: list[int],
                           start: int, end: int) -> None:
        """The worker's prefill checkpoint of group ``g`` for the chunk ``[start, end)``: the
        state after the last hash unit before ``end`` (under EAGLE one unit lower), written
        into table slot ``cdiv(end, block_size) - 2`` when the chunk can export it (vLLM's
        ``is_mamba_prefill_checkpoint_valid``).  Derived from the configuration alone, as the
        worker derives it: the manager's reservation is what is being checked."""
        manager = self._manager.coordinator.managers[g]
        alignment = getattr(manager, "checkpoint_alignment", None)
        if not getattr(manager, "has_checkpoints", False) or alignment is None:
            return
        bs, unit = manager.block_size, manager.hash_block_size
        eagle = bool(getattr(manager, "eagle_checkpoints", False))
        at = (end if eagle else end - 1) // unit * unit
        position = max(at - unit if eagle else at, 0)
        column = -(-end // bs) - 2
        if not (start % unit == 0 and column > (start - 1) // bs
                and start + unit <= position and start < position < end
                and (position - start) % alignment == 0):
            return
        if column >= len(blocks) or blocks[column].is_null:
            return  # (exported into the null block: nothing kept)
        block_id = blocks[column].block_id
        slots = self._slots[block_id] = [UNWRITTEN] * len(self._slots[block_id])
        base = (position - 1) // bs * bs
        slots[:position - base] = keys[base:position]
        self._state_last[block_id] = keys[position - 1]
        self._state_step[block_id] = self._step
        self._step_slots.append((block_id, 0))

    def copied(self, source: KVCacheBlock, destination: KVCacheBlock) -> None:
        """A block copy ran (``KVCacheManager.take_block_copies``: a partial-block hit's
        copy-on-write): ``destination`` now holds what ``source`` holds, a state copied in this
        step being readable from the next one."""
        self._slots[destination.block_id] = list(self._slots[source.block_id])
        self._state_last[destination.block_id] = self._state_last[source.block_id]
        self._state_step[destination.block_id] = self._step
        self._failed.discard(destination.block_id)

    def discard(self, request: KVRequest, start: int, end: int) -> None:
        """The step that was to compute tokens ``[start, end)`` failed: their slots hold garbage."""
        tables = self._manager.get_blocks(request.request_id)
        for g, spec in enumerate(self._specs):
            bs = spec.block_size
            for p in range(start, end):
                i = p // bs
                if i < len(tables[g]) and not tables[g][i].is_null:
                    self._slots[tables[g][i].block_id][p - i * bs] = UNWRITTEN
                    self._state_last[tables[g][i].block_id] = UNWRITTEN

    def fail_step(self) -> None:
        """The step since the last :meth:`end_step` was never executed: every slot it was to
        write holds garbage, whatever the scheduler does next (see
        :meth:`check_failed_uncached`)."""
        for block_id, offset in self._step_slots:
            self._slots[block_id][offset] = UNWRITTEN
            self._state_last[block_id] = UNWRITTEN
            self._failed.add(block_id)
        self._step_slots.clear()

    def check_failed_uncached(self) -> None:
        """Every block a failed step wrote has left the prefix cache (or was written again):
        a scheduler that forgets ``uncache_blocks`` after a failed step is caught here, before
        any request hits the never-written KV."""
        blocks = self._manager.pool.blocks
        cached = sorted(b for b in self._failed if blocks[b].block_hash is not None)
        self._failed.clear()
        if cached:
            raise WrongKVError(
                f"blocks {cached} hold KV of a failed step (never written) but are still in "
                "the prefix cache: uncache_blocks was not called for that step's requests")

    def end_step(self) -> None:
        """A scheduling step ended: the states it computed can now be read by other requests."""
        self._step += 1
        self._step_slots.clear()

    # -- checks ---------------------------------------------------------------------------------
    def check_hit(self, request: KVRequest, blocks: Sequence[Sequence[KVCacheBlock]],
                  num_hit_tokens: int) -> None:
        """``blocks`` (one list per group) as a hit of ``num_hit_tokens`` tokens for ``request``:
        every real block must hold the request's KV, and every position the next token reads
        must be covered by a real block."""
        keys = self.keys(request)
        rid = request.request_id
        for g, spec in enumerate(self._specs):
            hit = blocks[g] if g < len(blocks) else ()
            bs = spec.block_size
            if spec.reads_encoder:
                if hit:
                    raise WrongKVError(f"request {rid!r}: a hit in cross-attention group {g}")
                continue
            for i, block in enumerate(hit):
                if block.is_null:
                    continue
                # (A partial-block hit ends inside its last block: only its tokens are the hit's.)
                end = (i + 1) * bs
                if i * bs < num_hit_tokens < end:
                    end = num_hit_tokens
                self._check_block(rid, g, block, i, bs, keys, i * bs, end, "hit")
                if spec.holds_state and self._state_step[block.block_id] >= self._step:
                    raise WrongKVError(f"request {rid!r} hit: state block {block.block_id} of "
                                       f"group {g} is computed in this step, not readable yet")
                if spec.holds_state and self._state_last[block.block_id] != keys[end - 1]:
                    raise WrongKVError(f"request {rid!r} hit: state block {block.block_id} of "
                                       f"group {g} does not hold the state after token "
                                       f"{end - 1} (it went on, or holds another prefix's)")
            self._check_covered(rid, g, hit, bs, keys, spec.needed_positions(num_hit_tokens), "hit")

    def check_table(self, request: KVRequest) -> None:
        """A running request's table covers, with its own KV, every position its next token
        reads (attention groups; state groups are checked when hit)."""
        keys = self.keys(request)
        tables = self._manager.get_blocks(request.request_id)
        for g, spec in enumerate(self._specs):
            if spec.holds_state:
                continue
            self._check_covered(request.request_id, g, tables[g], spec.block_size, keys,
                                spec.needed_positions(request.num_computed_tokens), "table")

    def _check_covered(self, rid: str, g: int, blocks: Sequence[KVCacheBlock], bs: int,
                       keys: list[int], positions: range, what: str) -> None:
        p, end = positions.start, positions.stop
        while p < end:
            i = p // bs
            if i >= len(blocks) or blocks[i].is_null:
                raise WrongKVError(f"request {rid!r} {what}: group {g} position {p} is read by "
                                   "the next token but has no block")
            stop = min(end, (i + 1) * bs)
            self._check_block(rid, g, blocks[i], i, bs, keys, p, stop, what)
            p = stop

    def _check_block(self, rid: str, g: int, block: KVCacheBlock, index: int, bs: int,
                     keys: list[int], lo: int, hi: int, what: str) -> None:
        """Positions ``[lo, hi)`` of the request, in its block ``index``, hold its KV."""
        base = index * bs
        have = self._slots[block.block_id][lo - base:hi - base]
        want = keys[lo:hi]
        if have != want:
            k = next((k for k, (a, b) in enumerate(zip(have, want)) if a != b), len(have))
            state = ("was never written" if k < len(have) and have[k] == UNWRITTEN
                     else "holds KV of another prefix")
            raise WrongKVError(f"request {rid!r} {what}: group {g} block {block.block_id} at "
                               f"block position {index}: token {lo + k} {state}")
