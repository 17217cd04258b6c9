"""Replay operation traces through a KV-cache manager and record what it does.

Run as a script in either implementation's environment::

    python replay.py --impl vllm    < traces.json > observations.json   (vLLM's own venv)
    python replay.py --impl kvcore  < traces.json > observations.json
    python replay.py --impl adapter < traces.json > observations.json   (the full vLLM venv:
                                                kvcore behind kvcore.integrations.vllm)

or import :func:`replay_all` (kvcore side, in-process).  The module imports only the
implementation under test, so it runs in the vLLM peer venv without kvcore.

A trace is ``{"config": {...}, "ops": [...]}``.  The config names the groups (``full``, ``swa``,
``chunked``, ``mamba``, ``cross``; the scratch groups ``swa_replay``, a sliding window rebuilt by
bounded replay, and ``ring``, a circular buffer; a group's ``heads`` sets its KV heads, a
window's ``extra`` vLLM's ``extra_retained_tokens``), the pool size, ``caching``, ``eagle``
(``use_eagle``), ``eagle_groups`` (the groups vLLM flags ``is_eagle_group``, kvcore's
``CacheSettings.eagle_groups``; absent: vLLM flags none, so every group drops),
``retention`` (``prefix_cache_retention_interval``: sliding-window blocks cached sparsely),
``lookahead`` (vLLM 0.33's ``num_hash_lookahead_tokens``: each hash covers that many tokens
after its block; a vLLM peer must be 0.33),
``vllm`` (the peer's version, ``"0.32"`` or ``"0.33"``: kvcore follows its semantics where they
differ; default 0.33's), ``watermark`` (vLLM's admission watermark, a fraction of the blocks:
kept free when a waiting or preempted request is admitted while another one runs; the replay
sets vLLM's request states and ``has_scheduled_reqs`` as vLLM's scheduler does), ``metrics``
(a residency-metrics collector with sample rate 1 records every call the pool makes on it:
vLLM's ``KVCacheMetricsCollector``, kvcore's pool observer), ``embeds`` (vLLM requests carry
prompt embeddings instead of prompt tokens — each position's embedding its trace token — so
hashes and KV events' extra keys carry their digests; vLLM and the adapter only) and
``pending``: kvcore divergences not fixed yet, which the replay masks (see traces.py).  Ops act
on requests by id, the way a scheduler does:

    add       {rid, prompt}          create the request
    admit     {rid, chunk, ext, delay, enc, fit}
                                     get_computed_blocks, then allocate_slots for the hit, ``ext``
                                     external tokens after it (clipped to the prompt) and
                                     ``min(chunk, rest)`` new ones; ``enc`` encoder tokens (cross
                                     attention); ``fit``: full_sequence_must_fit (the config's
                                     ``budget`` is the per-step token bound of both managers).
                                     ``delay`` (with ext > 0) is an async KV load:
                                     no new tokens, ``delay_cache_blocks=True``; the request
                                     waits for a ``cache`` op.  On success the request's stats
                                     are recorded (vLLM's scheduler: once per admission).
                                     With a ``swa_replay`` group, as vLLM's scheduler: external
                                     tokens are cut to whole scheduler blocks, a hit no longer
                                     than the window is not adopted, and the hit's last window is
                                     replayed (computed tokens rewound by it; only the chunk's
                                     tokens past the hit get slots).
    cache     {rid}                  the load finished: cache_blocks(request, num_computed_tokens)
                                     (and a fully loaded prompt recomputes its last token; with
                                     bounded replay the load's last window is replayed instead)
    step      {rid, chunk, token, look}
                                     running request: next prefill chunk, or (prompt done) append
                                     ``token`` and allocate one decode slot; ``look`` lookahead
                                     (draft) slots
    free      {rid}                  finished
    preempt   {rid}                  free, num_computed_tokens = 0, num_preemptions += 1
    reset     {}                     reset_prefix_cache()
    new_step  {}                     a scheduling step starts (Mamba: states cached in the
                                     previous step become hittable)
    stats     {}                     make_prefix_cache_stats()

After every op the observation records the metrics calls (with ``metrics``: ``[call, block
id]``, and the drained eviction events' reuse-gap counts; vLLM 0.32 also reports a hit on the null
block, which its collector ignores, so null blocks are left out), the op's result (hit tokens and hit block ids, the
shared-prefix boundary of a lookup when it is not 0 (vLLM's scheduler keeps it on the request,
and sparse retention keeps the window before it cached), the new
block ids or None, the request's block table), the whole free queue in eviction order and the KV
events the op produced.  Events are normalised so that the two implementations' different hash
functions compare: every hash becomes the label ``"<rid>@<n>"`` of the token prefix it chains
over (``n`` tokens of the first request that had that prefix).

One deliberate difference: when vLLM's ``allocate_slots`` returns ``None`` for a running request
it has already released the request's out-of-window blocks; kvcore's changes nothing.  The
kvcore side then calls ``remove_skipped_blocks`` itself, so the two stay comparable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

STATS_FIELDS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
                "preempted_hits", "reset")


ADMITTED_STATES = ("waiting", "preempted")
"""The request states vLLM keeps the watermark free for (while another request runs)."""


class MetricsCalls:
    """A residency-metrics collector's calls, as ``[name, block id]`` (null blocks left out)."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def record(self, name: str, block: Any) -> None:
        if not block.is_null:
            self.calls.append([name, block.block_id])

    def on_block_allocated(self, block: Any) -> None:
        self.record("allocated", block)

    def on_block_accessed(self, block: Any) -> None:
        self.record("accessed", block)

    def on_block_evicted(self, block: Any) -> None:
        self.record("evicted", block)

    def reset(self) -> None:
        self.calls.append(["reset", -1])

    def take(self) -> list[Any]:
        calls, self.calls = self.calls, []
        return calls


def _vllm_collector() -> Any:
    """vLLM's own collector (sample rate 1: every block), recording its calls too."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    class Recording(KVCacheMetricsCollector):
        def __init__(self) -> None:
            super().__init__(sample_rate=1.0)
            self.seen = MetricsCalls()

        def on_block_allocated(self, block: Any) -> None:
            self.seen.on_block_allocated(block)
            super().on_block_allocated(block)

        def on_block_accessed(self, block: Any) -> None:
            self.seen.on_block_accessed(block)
            super().on_block_accessed(block)

        def on_block_evicted(self, block: Any) -> None:
            self.seen.on_block_evicted(block)
            super().on_block_evicted(block)

        def reset(self) -> None:
            self.seen.reset()
            super().reset()

        def take(self) -> list[Any]:
            gaps = [len(e.reuse_gaps_seconds) for e in self.drain_events()]
            return [*self.seen.take(), ["evictions", gaps]] if gaps else self.seen.take()

    return Recording()


def _ids(groups: Any) -> list[list[int]] | None:
    if groups is None:
        return None
    return [[b.block_id for b in g] for g in groups]


def _specs(cfg: dict[str, Any], classes: dict[str, Any], mamba_kw: dict[str, Any]) -> list[Any]:
    """The trace's groups as specs of either implementation (the classes are passed in)."""
    import torch

    out = []
    for g in cfg["groups"]:
        bs = g["block_size"]
        if g["type"] == "mamba":
            kw = dict(mamba_kw)
            if g.get("mode") == "align":  # vLLM's "align" mode, with or without checkpoints
                kw["mamba_cache_mode"] = "align"
                if g.get("checkpoint"):
                    kw.update(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
            if g.get("spec"):  # MTP/EAGLE's speculative state blocks
                kw["num_speculative_blocks"] = g["spec"]
            out.append(classes["mamba"](block_size=bs, shapes=((2, 4),), dtypes=(torch.float32,),
                                        **kw))
            continue
        common = dict(block_size=bs, num_kv_heads=g.get("heads", 1), head_size=8,
                      dtype=torch.float16)
        if g["type"] == "swa":
            if g.get("extra"):  # vLLM's extra_retained_tokens (multi-module MTP)
                common["extra_retained_tokens"] = g["extra"]
            out.append(classes["swa"](sliding_window=g["window"], **common))
        elif g["type"] == "swa_replay":  # vLLM: SlidingWindowMLASpec(bounded_replay=True)
            out.append(classes["swa_replay"](sliding_window=g["window"], bounded_replay=True,
                                             **common))
        elif g["type"] == "chunked":
            out.append(classes["chunked"](attention_chunk_size=g["chunk"], **common))
        else:
            out.append(classes[g["type"]](**common))
    return out


class _Impl:
    """What both implementations share: hash labels and event normalisation."""

    hash_block_size: int

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.group_block_sizes = [g["block_size"] for g in cfg["groups"]]
        self.pending = set(cfg.get("pending", ()))
        self._labels: dict[Any, tuple[str, int]] = {}  # hash -> (label, prefix length)
        self._prefixes: dict[tuple[int, ...], str] = {}
        self.watermark_blocks = int(cfg.get("watermark", 0.0) * cfg["num_blocks"])
        self._num_labelled: dict[str, int] = {}
        self._prompts: dict[str, tuple[int, ...]] = {}  # with embeds: the tokens they stand for
        self.metrics: Any = None  # a MetricsCalls-like recorder, with "metrics"

    def _external_hash(self, h: Any) -> Any:
        return h

    def label_hashes(self, rid: str, req: Any) -> None:
        """Give the request's (new) block hashes their prefix labels."""
        hashes = req.block_hashes
        start = self._num_labelled.get(rid, 0)
        tokens = req.all_token_ids
        bs = self.hash_block_size
        ahead = self.cfg.get("lookahead", 0)  # a lookahead hash covers the tokens after it
        for i in range(start, len(hashes)):
            n = (i + 1) * bs
            key = tuple(tokens[:n + ahead]) + self._prompts.get(rid, ())[:n + ahead]
            label = self._prefixes.setdefault(key, f"{rid}@{n}")
            self._labels.setdefault(self._external_hash(hashes[i]), (label, n))
        self._num_labelled[rid] = len(hashes)

    def _label(self, h: Any) -> tuple[str, int]:
        if h is None:
            return ("-", 0)
        found = self._labels.get(h)
        if found is None:
            raw = h if isinstance(h, bytes) else str(h).encode()
            return (f"?{raw.hex()[:12]}", -1)
        return found

    def events(self) -> list[list[Any]]:
        """The op's KV events, normalised (see the module docstring)."""
        partial = "partial_tail_entries" in self.pending
        out: list[list[Any]] = []
        for e in self.take_events():
            kind = type(e).__name__
            if kind == "AllBlocksCleared":
                out.append(["cleared"])
                continue
            group = e.group_id if hasattr(e, "group_id") else e.group_idx
            if kind == "BlockStored":
                if partial and e.block_size != self.group_block_sizes[group]:
                    continue  # vLLM's partial prompt-tail entry
                extra = e.extra_keys
                if extra is not None and "event_extra_keys" in self.pending and not any(extra):
                    extra = None
                stored = ["stored", group, e.block_size,
                          [self._label(h)[0] for h in e.block_hashes],
                          self._label(e.parent_block_hash)[0], list(e.token_ids),
                          None if extra is None else [None if k is None else list(k)
                                                      for k in extra]]
                if "event_spec_metadata" not in self.pending:
                    stored += [getattr(e, "kv_cache_spec_kind", None),
                               getattr(e, "kv_cache_spec_sliding_window", None)]
                if self.cfg.get("lookahead"):
                    ahead = e.lookahead_token_ids
                    stored.append(None if ahead is None else [list(t) for t in ahead])
                out.append(stored)
            elif kind == "BlockRemoved":
                labels = [self._label(h) for h in e.block_hashes]
                if partial:  # drop vLLM's partial entries (prefixes ending inside a block)
                    bs = self.group_block_sizes[group]
                    labels = [x for x in labels if x[1] < 0 or x[1] % bs == 0]
                    if not labels:
                        continue
                out.append(["removed", group, [x[0] for x in labels]])
            else:
                out.append([kind])
        return out

    # Implementation-specific, overridden below.
    def take_events(self) -> list[Any]:
        raise NotImplementedError

    def admitted(self, req: Any, hit: int) -> None:
        """A lookup led to a successful admission."""


class KvcoreImpl(_Impl):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        from kvcore.manager import KVCacheManager, lookup_boundary
        from kvcore.specs import (
            ChunkedLocalAttentionSpec,
            CircularBufferSpec,
            CrossAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroup,
            MambaSpec,
            SlidingWindowSpec,
        )

        classes = {"full": FullAttentionSpec, "swa": SlidingWindowSpec,
                   "chunked": ChunkedLocalAttentionSpec, "mamba": MambaSpec,
                   "cross": CrossAttentionSpec, "swa_replay": SlidingWindowSpec,
                   "ring": CircularBufferSpec}
        self._lookup_boundary = lookup_boundary  # (the boundary travels with the hit)
        specs = _specs(cfg, classes, {})
        groups = [KVCacheGroup((f"layer{i}",), spec) for i, spec in enumerate(specs)]
        unit = cfg.get("prefix_match_unit")
        partial = bool(cfg.get("caching", True) and unit and any(
            g.get("mode") == "align" and g["block_size"] > unit for g in cfg["groups"]))
        config = KVCacheConfig(cfg["num_blocks"], tuple(groups), cfg.get("retention"), unit,
                               partial_block_hits=partial)
        extra: dict[str, Any] = {"use_eagle": True} if cfg.get("eagle") else {}
        if cfg.get("eagle_groups") is not None:  # vLLM's is_eagle_group flags
            extra["eagle_groups"] = tuple(cfg["eagle_groups"])
        if cfg.get("shared_ckpt"):  # vLLM's enable_mamba_shared_prefix_checkpoint
            extra["mamba_shared_prefix_checkpoint"] = True
        if cfg.get("vllm") == "0.32":  # the peer's EAGLE retention (see CacheSettings)
            extra["eagle_junction_tail"] = False
            extra["mamba_recache_prompt_boundary"] = True
        if cfg.get("lookahead"):
            extra["num_hash_lookahead_tokens"] = cfg["lookahead"]
        if cfg.get("general_path"):  # kvcore only: every allocate_slots call fully validated
            extra["fast_path"] = False
        self.m = KVCacheManager(config, cfg["max_model_len"], enable_caching=cfg.get("caching", True),
                                enable_events=True, log_stats=True,
                                max_num_batched_tokens=cfg.get("budget"), **extra)
        self.hash_block_size = config.hash_block_size
        if cfg.get("metrics"):
            self.metrics = MetricsCalls()
            self.m.pool.set_observer(self.metrics)

    def make_request(self, rid: str, prompt: list[int]) -> Any:
        return self.m.make_request(rid, prompt)

    def get_computed_blocks(self, req: Any) -> tuple[Any, int, int]:
        blocks, hit = self.m.get_computed_blocks(req)
        return blocks, hit, self._lookup_boundary(blocks, req)

    def allocate(self, req: Any, n: int, hit: int = 0, blocks: Any = None, look: int = 0,
                 ext: int = 0, delay: bool = False, enc: int = 0, fit: bool = False,
                 status: str = "running", sched: bool = True) -> Any:
        wm = self.watermark_blocks if sched and status in ADMITTED_STATES else 0
        out = self.m.allocate_slots(req, n, hit, blocks, num_lookahead_tokens=look,
                                    num_external_computed_tokens=ext, delay_cache_blocks=delay,
                                    num_encoder_tokens=enc, full_sequence_must_fit=fit,
                                    watermark_blocks=wm)
        if out is None and req.request_id in self.m.requests():
            self.m.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        return out

    def admitted(self, req: Any, hit: int) -> None:
        self.m.record_prefix_cache_stats(req, hit)

    def cache_blocks(self, req: Any, n: int) -> None:
        self.m.cache_blocks(req, n)

    def new_step(self) -> None:
        self.m.new_step()

    def free(self, req: Any) -> None:
        self.m.free(req)

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(x) for x in self.m.get_block_ids(rid)]

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.pool.policy]

    def reset(self) -> bool:
        return self.m.reset_prefix_cache()

    def take_events(self) -> list[Any]:
        return self.m.take_events()

    def stats(self) -> Any:
        return self.m.make_prefix_cache_stats()

    def zeroed(self) -> list[int]:
        return []  # kvcore's own manager records nothing for zeroing (vLLM's adapter does)

    def copies(self) -> list[tuple[int, int]]:
        """The block copies recorded during the op, ``(source, destination)`` ids; their
        endpoints are released at once (as if the step running them were processed)."""
        pairs, retained = self.m.take_block_copies()
        if retained:
            self.m.free_withheld(retained)
        return [(a.block_id, b.block_id) for a, b in pairs]


def vllm_block_sizes(cfg: dict[str, Any]) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) as vLLM's ``resolve_kv_cache_block_sizes``
    derives them: one group -> its block size; several -> the lcm, and hashes at the gcd unless
    caching is off or a Mamba group is not in "align" mode (then at the lcm), or at the trace's
    ``prefix_match_unit`` when it sets one; scratch groups
    (``swa_replay``, ``ring``) count in the lcm, not in the gcd."""
    groups = cfg["groups"]
    sizes = [g["block_size"] for g in groups]
    if len(sizes) == 1:
        return sizes[0], sizes[0]
    sched = math.lcm(*sizes)
    if not cfg.get("caching", True) or any(g["type"] == "mamba" and g.get("mode") != "align"
                                           for g in groups):
        return sched, sched
    hashed = [g["block_size"] for g in groups if g["type"] not in SCRATCH] or sizes
    return sched, cfg.get("prefix_match_unit") or math.gcd(*hashed)


SCRATCH = ("swa_replay", "ring")
"""Group types that are never prefix cached (vLLM's ``prefix_cacheable`` false)."""


class VllmImpl(_Impl):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            maybe_convert_block_hash,
        )
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            CircularBufferSpec,
            CrossAttentionSpec,
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
            SlidingWindowMLASpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        classes = {"full": FullAttentionSpec, "swa": SlidingWindowSpec,
                   "chunked": ChunkedLocalAttentionSpec, "mamba": MambaSpec,
                   "cross": CrossAttentionSpec, "swa_replay": SlidingWindowMLASpec,
                   "ring": CircularBufferSpec}
        # Mamba "none": every block cached, hit = right-most cached state, no sub-block hits
        # (kvcore's semantics); "align" is vLLM's checkpointing mode with partial hits.
        specs = _specs(cfg, classes, {"mamba_cache_mode": "none"})
        flagged = cfg.get("eagle_groups") or ()
        groups = [KVCacheGroupSpec([f"layer{i}"], spec, is_eagle_group=i in flagged)
                  for i, spec in enumerate(specs)]
        sched_bs, hash_bs = vllm_block_sizes(cfg)
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        # vLLM 0.33's lookahead hashes (its arguments exist only there).
        ahead = {"num_hash_lookahead_tokens": cfg["lookahead"]} if cfg.get("lookahead") else {}
        self.hasher = get_request_block_hasher(hash_bs, fn, *ahead.values())
        from vllm.v1.request import RequestStatus

        self._status = {"waiting": RequestStatus.WAITING, "preempted": RequestStatus.PREEMPTED,
                        "running": RequestStatus.RUNNING,
                        "loading": RequestStatus.WAITING_FOR_REMOTE_KVS}
        self.hash_block_size = hash_bs
        self._convert = maybe_convert_block_hash
        options = self._options(ahead)
        self.m = KVCacheManager(KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
                                              kv_cache_groups=groups,
                                              prefix_cache_retention_interval=cfg.get(
                                                  "retention")),
                                cfg["max_model_len"], scheduler_block_size=sched_bs,
                                hash_block_size=hash_bs, enable_caching=cfg.get("caching", True),
                                max_in_flight_tokens=cfg.get("budget"),
                                use_eagle=bool(cfg.get("eagle")), log_stats=True,
                                enable_kv_cache_events=True, **options)
        self._params = SamplingParams(max_tokens=1 << 20)
        self._request_cls = Request

    def _options(self, ahead: dict[str, Any]) -> dict[str, Any]:
        """The trace's manager options beyond the config (vLLM's keyword names): lookahead
        hashes, the watermark, and a fresh metrics collector (kept as ``self.metrics``)."""
        options: dict[str, Any] = dict(ahead)
        if self.cfg.get("shared_ckpt"):
            options["enable_mamba_shared_prefix_checkpoint"] = True
        if self.cfg.get("watermark"):
            options["watermark"] = self.cfg["watermark"]
        if self.cfg.get("metrics"):
            self.metrics = _vllm_collector()
            options["metrics_collector"] = self.metrics
        return options

    def _external_hash(self, h: Any) -> Any:
        return self._convert(h)

    def make_request(self, rid: str, prompt: list[int]) -> Any:
        if self.cfg.get("embeds"):  # position i's embedding stands for token i (4 dims)
            import torch

            self._prompts[rid] = tuple(prompt)
            embeds = torch.tensor(prompt, dtype=torch.float32)[:, None].repeat(1, 4)
            return self._request_cls(rid, None, self._params, None, prompt_embeds=embeds,
                                     block_hasher=self.hasher)
        return self._request_cls(rid, prompt, self._params, None, block_hasher=self.hasher)

    def get_computed_blocks(self, req: Any) -> tuple[Any, int, int]:
        blocks, hit, boundary = self.m.get_computed_blocks(req)
        req.shared_prefix_boundary = boundary  # as vLLM's scheduler does with every lookup
        return blocks.blocks, hit, boundary

    def allocate(self, req: Any, n: int, hit: int = 0, blocks: Any = None, look: int = 0,
                 ext: int = 0, delay: bool = False, enc: int = 0, fit: bool = False,
                 status: str = "running", sched: bool = True) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        req.status = self._status[status]

        wrapped = None if blocks is None else KVCacheBlocks(tuple(blocks))
        if wrapped is not None and not any(blocks):
            wrapped = self.m.empty_kv_cache_blocks
        out = self.m.allocate_slots(req, n, hit, wrapped, num_lookahead_tokens=look,
                                    num_external_computed_tokens=ext, delay_cache_blocks=delay,
                                    num_encoder_tokens=enc, full_sequence_must_fit=fit,
                                    has_scheduled_reqs=sched)
        return None if out is None else out.blocks

    def admitted(self, req: Any, hit: int) -> None:
        # vLLM's scheduler records the lookup only once the admission succeeded
        # (scheduler.py: "Record at admission so unscheduled lookups are not counted").
        self.m.record_prefix_cache_stats(req, hit)

    def cache_blocks(self, req: Any, n: int) -> None:
        self.m.cache_blocks(req, n)

    def new_step(self) -> None:
        self.m.new_step_starts()

    def free(self, req: Any) -> None:
        self.m.free(req)

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(x) for x in self.m.get_block_ids(rid)]

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.block_pool.free_block_queue.get_all_free_blocks()]

    def reset(self) -> bool:
        return bool(self.m.reset_prefix_cache())

    def take_events(self) -> list[Any]:
        return self.m.take_events()

    def stats(self) -> Any:
        return self.m.make_prefix_cache_stats()

    def zeroed(self) -> list[int]:
        """Block ids recorded for zeroing since the last op (Mamba models)."""
        return list(self.m.take_new_block_ids())

    def copies(self) -> list[tuple[int, int]]:
        """vLLM's ``kv_cache_block_copies`` of the op, ``(source, destination)`` ids; their
        retained endpoints are freed at once (as its scheduler does once the step that runs
        them has been processed)."""
        copies, retained = self.m.take_kv_cache_block_copies()
        if retained:
            self.m.block_pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]


class AdapterImpl(VllmImpl):
    """kvcore behind vLLM's manager surface (kvcore.integrations.vllm): built with exactly the
    arguments vLLM's own manager gets, driven with vLLM's requests.  Needs the full vLLM venv."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        from kvcore.integrations.vllm.manager import KVCacheManagerAdapter

        vllm = self.m
        sched_bs, hash_bs = vllm_block_sizes(cfg)
        ahead = {"num_hash_lookahead_tokens": cfg["lookahead"]} if cfg.get("lookahead") else {}
        options = self._options(ahead)
        self.m = KVCacheManagerAdapter(
            vllm.kv_cache_config, cfg["max_model_len"], scheduler_block_size=sched_bs,
            hash_block_size=hash_bs, enable_caching=cfg.get("caching", True),
            max_in_flight_tokens=cfg.get("budget"), use_eagle=bool(cfg.get("eagle")),
            log_stats=True, enable_kv_cache_events=True, **options)

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.kv.pool.policy]


class Replayer:
    """Applies ops to one implementation and records one observation per op."""

    def __init__(self, impl: Any) -> None:
        self.impl = impl
        self.requests: dict[str, Any] = {}
        # vLLM's request states: waiting, running, preempted, loading (an async KV load).
        self.status: dict[str, str] = {}
        # Mamba "align": prefill chunks end on block boundaries, as vLLM's scheduler splits them.
        self.align_block = next((g["block_size"] for g in impl.cfg["groups"]
                                 if g.get("mode") == "align"), 0)
        # Bounded replay (vLLM's scheduler): the window every hit's end is replayed over.
        self.replay = max((g["window"] for g in impl.cfg["groups"]
                           if g["type"] == "swa_replay"), default=0)
        self.scheduler_block = vllm_block_sizes(impl.cfg)[0]
        # Partial-block hits (vLLM's partial hash hits): the hash unit, when finer than the
        # "align" block (0 otherwise).
        unit = impl.cfg.get("prefix_match_unit") or 0
        self.partial_unit = unit if impl.cfg.get("caching", True) and 0 < unit < self.align_block else 0
        # Shared-prefix checkpoints: each request's latest lookup boundary (vLLM's
        # request.shared_prefix_boundary), where its prompt chunks also stop.
        self.junctions: dict[str, int] = {}

    def chunk(self, req: Any, start: int, n: int) -> int:
        """``n`` new tokens from ``start``, cut as vLLM's scheduler cuts a Mamba "align" prefill
        chunk: mid-prompt chunks end on a block boundary (when one lies inside) and never run
        past the last block boundary before the request's end (its cacheable state)."""
        bs = self.align_block
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if not bs or n <= 0 or start >= prefill_end:
            return n
        end = start + n
        if end < prefill_end and end // bs * bs > start:
            end = end // bs * bs
        last = max((req.num_tokens - 1) // bs * bs, 0)
        unit = self.partial_unit
        internal = bool(unit) and end >= prefill_end and self._exports_checkpoint(
            start, end, prefill_end)
        stops = [0 if internal else last]
        if unit and not internal:
            # vLLM's scheduler under partial hits: a chunk starting inside a block stops at the
            # block's end, and one crossing the prompt's last hash unit stops there (unless the
            # chunk exports the prompt's checkpoint itself).
            if start % bs:
                stops.append((start // bs + 1) * bs)
            tail = self._checkpoint_position(req.num_prompt_tokens, unit)
            if last < tail < req.num_prompt_tokens:
                stops.append(tail)
        junction = self.junctions.get(req.request_id, 0) if self.impl.cfg.get("shared_ckpt") else 0
        if start < junction < end:
            # vLLM's scheduler: the junction itself within the prompt, else block-floored.
            stops.append(junction if junction <= req.num_prompt_tokens
                         else start + (junction - start) // bs * bs)
        end = min((s for s in stops if start < s < end), default=end)
        return end - start

    def _checkpoint_position(self, num_tokens: int, unit: int) -> int:
        """vLLM's ``get_mamba_prefill_checkpoint_position`` under the trace's EAGLE drop."""
        eagle = bool(self.impl.cfg.get("eagle"))
        at = (num_tokens if eagle else num_tokens - 1) // unit * unit
        return max(at - unit if eagle else at, 0)

    def _exports_checkpoint(self, start: int, end: int, prefill_end: int) -> bool:
        """Whether the chunk ``[start, end)`` exports the prompt's checkpoint from inside the
        step (vLLM's ``is_mamba_prefill_checkpoint_valid``, Mamba2's checkpoint block)."""
        if not any(g.get("checkpoint") for g in self.impl.cfg["groups"]):
            return False
        bs, unit = self.align_block, self.partial_unit
        position = self._checkpoint_position(prefill_end, unit)
        return (start % unit == 0 and -(-end // bs) - 2 > (start - 1) // bs
                and start + unit <= position and start < position < end)

    def _admission(self, rid: str) -> dict[str, Any]:
        """The request's state and whether another request runs (vLLM's ``has_scheduled_reqs``,
        ``bool(self.running)`` when its scheduler admits one)."""
        sched = any(s == "running" for r, s in self.status.items() if r != rid)
        return {"status": self.status.get(rid, "waiting"), "sched": sched}

    def apply(self, op: dict[str, Any]) -> dict[str, Any]:
        impl = self.impl
        kind = op["op"]
        o: dict[str, Any] = {"op": kind}
        rid: str = op.get("rid", "")
        if kind == "add":
            req = self.requests[rid] = impl.make_request(rid, op["prompt"])
            self.status[rid] = "waiting"
            impl.label_hashes(rid, req)
        elif kind == "admit":
            req = self.requests[rid]
            blocks, hit, boundary = impl.get_computed_blocks(req)
            self.junctions[rid] = boundary
            if boundary:
                o["boundary"] = boundary
            rest = req.num_tokens - hit
            delay = bool(op.get("delay"))
            ext = max(min(op.get("ext", 0), rest if delay else rest - 1), 0)
            o.update(hit=hit, hit_blocks=_ids(blocks))
            adopted, replay = hit, 0
            if self.replay:
                # vLLM's scheduler: external hits end on a block boundary; a hit no longer
                # than the window is recomputed in full, so not adopted (an empty lookup
                # result); otherwise the hit's last window is replayed.
                ext -= ext % self.scheduler_block
                if 0 < hit + ext <= self.replay:
                    blocks, adopted, ext = tuple([] for _ in impl.cfg["groups"]), 0, 0
            delay = delay and ext > 0
            if self.replay and not delay:
                replay = min(self.replay, adopted + ext)
            start = adopted + ext - replay
            n = 0 if delay else self.chunk(req, start, min(op["chunk"], req.num_tokens - start))
            out = impl.allocate(req, max(n - replay, 0), adopted, blocks, ext=ext, delay=delay,
                                enc=op.get("enc", 0), fit=bool(op.get("fit")),
                                **self._admission(rid))
            o["new"] = _ids(out)
            if ext:
                o["ext"] = ext
            if replay:
                o["replay"] = replay
            if out is not None:
                req.num_computed_tokens = start + n
                self.status[rid] = "loading" if delay else "running"
                impl.admitted(req, adopted)
                o["table"] = impl.block_ids(rid)
        elif kind == "cache":
            req = self.requests[rid]
            impl.cache_blocks(req, req.num_computed_tokens)
            if self.status.get(rid) == "loading":  # back to the waiting queue, as vLLM does
                self.status[rid] = "waiting"
            if self.replay:  # the loaded tokens' last window is replayed
                req.num_computed_tokens -= min(self.replay, req.num_computed_tokens)
            elif req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens -= 1  # the last token's logits are recomputed
        elif kind == "step":
            req = self.requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                n = self.chunk(req, req.num_computed_tokens,
                               min(op["chunk"], req.num_tokens - req.num_computed_tokens))
            else:
                req.append_output_token_ids(op["token"])
                impl.label_hashes(rid, req)
                n = 1
            out = impl.allocate(req, n, look=op.get("look", 0), **self._admission(rid))
            o["new"] = _ids(out)
            if out is not None:
                req.num_computed_tokens += n
                self.status[rid] = "running"
            o["table"] = impl.block_ids(rid)
        elif kind in ("free", "preempt"):
            req = self.requests[rid]
            impl.free(req)
            self.status[rid] = "preempted" if kind == "preempt" else "finished"
            if kind == "preempt":
                req.num_computed_tokens = 0
                req.num_preemptions += 1
        elif kind == "reset":
            o["ok"] = impl.reset()
        elif kind == "new_step":
            impl.new_step()
        elif kind == "stats":
            s = impl.stats()
            o["stats"] = None if s is None else [getattr(s, f) for f in STATS_FIELDS]
        else:
            raise ValueError(f"unknown op {kind!r}")
        if self.impl.cfg.get("observe_zeroing"):  # vLLM and the adapter (kvcore has none)
            zeroed = impl.zeroed()
            if zeroed:
                o["zeroed"] = zeroed
        if impl.metrics is not None:
            calls = impl.metrics.take()
            if calls:
                o["metrics"] = calls
        copies = impl.copies()
        if copies:
            o["copies"] = copies
        o["free_queue"] = impl.free_queue()
        events = impl.events()
        if events:
            o["events"] = events
        return o


VLLM_EXT_UNDERCOUNT = "Cannot get"
"""vLLM's error when a Mamba "align" admission with externally computed tokens takes more
blocks than its count checked for (docs/vllm_mamba_external_undercount_bug.md)."""


def cut_at_vllm_undercount(trace: dict[str, Any], ours: list[dict[str, Any]],
                           theirs: list[dict[str, Any]]
                           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
    """Both observation lists up to the op where vLLM raised its Mamba external-token
    undercount error, if it did on such an admission and kvcore refused the same admission
    (``new`` None: kvcore counts those blocks); else unchanged.  The flag says whether it cut."""
    for i, o in enumerate(theirs):
        if VLLM_EXT_UNDERCOUNT in str(o.get("error", "")):
            op = trace["ops"][i]
            mamba = any(g.get("mode") == "align" for g in trace["config"]["groups"])
            if (mamba and op["op"] == "admit" and op.get("ext") and i < len(ours)
                    and ours[i].get("new", 0) is None):
                return ours[:i], theirs[:i], True
            break
    return ours, theirs, False


def make_impl(name: str, cfg: dict[str, Any]) -> Any:
    return {"kvcore": KvcoreImpl, "vllm": VllmImpl, "adapter": AdapterImpl}[name](cfg)


def replay(impl_name: str, trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one trace; return one observation per op.  An exception becomes the op's observation
    (``{"op", "error"}``) and ends the trace, so a divergence shows where it started."""
    try:
        r = Replayer(make_impl(impl_name, trace["config"]))
    except Exception as exc:
        return [{"op": "init", "error": f"{type(exc).__name__}: {exc}"}]
    obs: list[dict[str, Any]] = []
    for op in trace["ops"]:
        try:
            obs.append(r.apply(op))
        except Exception as exc:  # a crash is an observation too
            obs.append({"op": op["op"], "error": f"{type(exc).__name__}: {exc}"})
            break
    return obs


def replay_all(impl_name: str, traces: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [replay(impl_name, t) for t in traces]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["kvcore", "vllm", "adapter"], required=True)
    args = ap.parse_args()
    traces = json.load(sys.stdin)
    json.dump(replay_all(args.impl, traces), sys.stdout)


if __name__ == "__main__":
    main()
