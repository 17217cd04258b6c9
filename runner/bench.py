"""GPU benchmarks for the runner: ``python -m runner.bench {attention,throughput,prefix,all}``.

* ``attention``: decode attention's achieved bandwidth (bytes of K/V read / median time) per
  backend, for batch sizes 1-256 and contexts 512-32k (``--batches``, ``--contexts``), next to
  the device's measured device-to-device copy bandwidth, and the same as a table of % of copy
  bandwidth with one column per backend and peer.  Goal: >= 80% of copy bandwidth at long
  context.  Peer kernels (``--peers``, default all on a GPU; :mod:`runner.peer_kernels`:
  FlashInfer and FlexAttention on the same pages through the same block tables, PyTorch SDPA
  on a contiguous copy of the same K/V) run in the same process after our backends; each
  peer's output is checked against ours (``max_err``) before it is timed.  A peer that is not
  installed or fails leaves a note in its cells instead of ending the run, and
  ``--time-limit`` starts no case after its deadline (peers go last, so they are cut first).
  ``--split-sweep`` adds our decode at fixed split counts next to the default's choice (batch
  1, 8 and 48, where the choice is many parts, a few and one).
* ``prefill-attention``: causal prefill attention over paged K/V (each sequence's whole context
  is its query: no cached prefix), in TFLOP/s, with the same peers (FlashInfer's paged prefill,
  FlexAttention, SDPA); every kernel timed eagerly (our prefill is not graph-captured).
* ``throughput``: end to end on a Qwen3-0.6B-shaped model with random weights, nano-vllm's recipe
  (256 sequences, input and output lengths uniform in 100-1024, ignore_eos), after a warm-up
  that runs the same workload with fresh token ids (every shape the timed run uses; checked
  and reported); ``--runs N`` times it N times in the same engine.  ``--peer transformers``
  adds ``transformers``' own continuous batching (the manager behind ``generate_batch``: paged
  KV cache, SDPA), same model shape and dtype, in the same run, bounded: on a GPU it runs the
  first 64 requests (``--peer-num-seqs``; ours is timed on the same requests for the ratio) and
  stops after 120 s (``--peer-time-limit``; a capped run counts finished requests and says so).
* ``prefix``: prefill time for requests whose prompts share a 90% prefix already in the cache,
  against the same prompts with prefix caching off.

Without CUDA it prints one line and exits 2; ``--allow-cpu`` runs tiny shapes on the CPU (even
where a GPU exists) to check the code paths (our Triton backend too when named in
``--backends`` under ``TRITON_INTERPRET=1``).  Backends that cannot load here (flash-attn not
installed) are listed and skipped.  ``scripts/gpu_check.sh`` runs all of it, bounded, on one
GPU.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore.bench.table import render
from runner.attention import AttentionMetadata, GroupMetadata, get_backend
from runner.peer_kernels import PEERS, build_peer


def _timer(device: torch.device) -> Callable[..., float]:
    """``measure(fn, reps, graph=True)``: median seconds of ``fn`` over ``reps`` runs.

    On a GPU each run is timed with CUDA events after a 256 MiB memset: the memset evicts the
    50 MB L2 (the K/V bytes come from HBM, as in serving) and keeps the GPU busy while the host
    queues the run.  With ``graph`` (backends whose decode is graph-safe, as the engine runs
    them) ``fn`` is captured in a CUDA graph and replayed, so host launch latency is not counted;
    without it ``fn`` runs eagerly and its launches are."""

    def measure(fn: Callable[[], Any], reps: int, graph: bool = True) -> float:
        fn()  # warm-up (compilation, caching allocator)
        if device.type != "cuda":
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        run = _graphed(fn) if graph else fn
        flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
        events = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            start.record()
            run()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3

    return measure


def _graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph; returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    t = _timer(device)(lambda: dst.copy_(src), 20, graph=False)
    return 2 * src.numel() * 2 / t / 1e9


def _case(device: torch.device, batch: int, ctx: int, num_kv_heads: int, group: int,
          head_dim: int, block_size: int, dtype: torch.dtype, prefill: bool
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                     AttentionMetadata]:
    """One benchmark case, the same on every call (seeded): pages on shuffled block ids, every
    sequence ``ctx`` long; returns (cache, tables, seq_lens, q, k, meta)."""
    torch.manual_seed(batch * 100_003 + ctx)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device,
                        dtype=dtype)
    perm = torch.randperm(num_blocks - 1, device=device)[:batch * blocks_per_seq] + 1
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q_len = ctx if prefill else 1
    n = batch * q_len
    q = torch.randn(n, num_kv_heads * group, head_dim, device=device, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=dtype)
    slots = torch.full((n,), -1, dtype=torch.long, device=device)  # no write
    meta = AttentionMetadata(
        torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len, seq_lens,
        q_len, ctx, [GroupMetadata(slots, tables)], [ctx] * batch, [q_len] * batch)
    return cache, tables, seq_lens, q, k, meta


def _note(exc: BaseException) -> str:
    """A failure as one short table cell's worth of text."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:160]}"


def bench_attention(device: torch.device, batches: Sequence[int], contexts: Sequence[int],
                    backends: Sequence[str], num_kv_heads: int = 8, group: int = 2,
                    head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                    reps: int = 20, peers: Sequence[str] = (), prefill: bool = False,
                    deadline: float | None = None) -> list[dict[str, Any]]:
    """Decode (one query token per sequence) or, with ``prefill``, causal prefill of the whole
    context, per backend and peer; rows carry GB/s of K/V read and TFLOP/s.

    Our backends run first over every case, then the peers (each checked against ours,
    ``max_err``), so a time limit (``deadline``, a ``time.monotonic()`` value: no case starts
    after it) cuts the peers before our own figures.  A row that was not measured has
    ``ms = None`` and says why in ``note``: a peer that is not installed, a failure (its
    exception, so one peer's crash does not end the table), the memory check or the time
    limit."""
    measure = _timer(device)
    rows: list[dict[str, Any]] = []
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 << 30
    cases = []
    for batch in batches:
        for ctx in contexts:
            blocks = batch * -(-ctx // block_size) + 1
            kv_bytes = 2 * blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
            if kv_bytes <= 0.6 * free:
                cases.append((batch, ctx, kv_bytes))
    q_len_of = (lambda ctx: ctx) if prefill else (lambda ctx: 1)

    def row(name: str, batch: int, ctx: int, t: float | None, timing: str = "",
            **extra: Any) -> dict[str, Any]:
        q_len = q_len_of(ctx)
        read = batch * ctx * 2 * num_kv_heads * head_dim * dtype.itemsize
        # QK^T and PV, 2 flops per multiply-add, over the causal (query, key) pairs.
        pairs = batch * (q_len * (ctx - q_len) + q_len * (q_len + 1) // 2)
        flops = 4 * pairs * num_kv_heads * group * head_dim
        return {"backend": name, "batch": batch, "context": ctx, "timing": timing,
                "q_len": q_len, "ms": None if t is None else t * 1e3,
                "gbps": None if t is None else read / t / 1e9,
                "tflops": None if t is None else flops / t / 1e12,
                "note": None, **extra}

    def late() -> bool:
        return deadline is not None and time.monotonic() > deadline

    loaded = []
    for name in backends:
        try:
            loaded.append((name, get_backend(name)))
        except ImportError:
            continue
    for batch, ctx, _ in cases:
        todo = [(name, backend) for name, backend in loaded
                if not (name == "torch" and (batch * ctx > 64 * 2048 or (prefill and ctx > 2048)))]
        if late():  # the reference gathers pages in Python (above): only small shapes
            rows += [row(name, batch, ctx, None, note="time limit") for name, _ in todo]
            continue
        cache, _, _, q, k, meta = _case(device, batch, ctx, num_kv_heads, group, head_dim,
                                        block_size, dtype, prefill)
        for name, backend in todo:
            graph = (device.type == "cuda" and not prefill
                     and getattr(backend, "supports_cuda_graphs", False))
            t = measure(_decode_call(backend, q, k, cache, meta), reps, graph=graph)
            rows.append(row(name, batch, ctx, t, "graph" if graph else "eager"))
        del cache
        _free_gpu_memory()
    unavailable: dict[str, str] = {}
    for batch, ctx, kv_bytes in cases:
        if not peers:
            break
        if late():
            rows += [row(f"peer:{p}", batch, ctx, None, note=unavailable.get(p, "time limit"))
                     for p in peers]
            continue
        cache, tables, seq_lens, q, k, meta = _case(device, batch, ctx, num_kv_heads, group,
                                                    head_dim, block_size, dtype, prefill)
        ours = (_decode_call(loaded[0][1], q, k, cache, meta)().float() if loaded else None)
        for name in peers:
            if name in unavailable:
                rows.append(row(f"peer:{name}", batch, ctx, None, note=unavailable[name]))
                continue
            if name == "sdpa" and 2 * kv_bytes > 0.6 * free:  # it holds a contiguous copy
                rows.append(row(f"peer:{name}", batch, ctx, None, note="memory"))
                continue
            decode: Callable[[torch.Tensor], Any] | None = None
            try:
                decode = build_peer(name, cache, tables, seq_lens, head_dim ** -0.5,
                                    num_kv_heads * group, q_len_of(ctx))
                err = None if ours is None else (decode(q).float() - ours).abs().max().item()
                t, timing = _measure_peer(measure, decode, q, reps, device, graph=not prefill)
            except ImportError as exc:
                unavailable[name] = f"not installed ({_note(exc)})"
                print(f"# peer {name}: {unavailable[name]}")
                rows.append(row(f"peer:{name}", batch, ctx, None, note=unavailable[name]))
                continue
            except Exception as exc:  # a peer's failure is its cell's note, not the end
                print(f"# peer {name} at batch {batch} x {ctx}: {_note(exc)}")
                rows.append(row(f"peer:{name}", batch, ctx, None, note=_note(exc)))
                continue
            finally:
                decode = None  # the peer's buffers (compiled graph, workspace) go now
            rows.append(row(f"peer:{name}", batch, ctx, t, timing, max_err=err))
        del cache, ours
        _free_gpu_memory()
    return rows


def percent_table(rows: Sequence[dict[str, Any]], copy_gbps: float
                  ) -> tuple[list[str], list[list[str]], list[str]]:
    """Decode rows pivoted for reading: one line per (batch, context), one column per backend
    and peer, each cell the % of copy bandwidth, or why it is empty (a footnote number; the
    footnotes are the third value)."""
    columns: list[str] = []
    cells: dict[tuple[int, int], dict[str, str]] = {}
    notes: list[str] = []
    for r in rows:
        if r["backend"] not in columns:
            columns.append(r["backend"])
        key = (r["batch"], r["context"])
        if r["ms"] is not None:
            text = f"{100 * r['gbps'] / copy_gbps:.0f}%"
        else:
            full = f"{r['backend']}: {r['note']}"
            if full not in notes:
                notes.append(full)
            text = f"n/a [{notes.index(full) + 1}]"
        cells.setdefault(key, {})[r["backend"]] = text
    lines = [[str(b), str(c)] + [cells[(b, c)].get(name, "") for name in columns]
             for b, c in sorted(cells)]
    return (["batch", "context", *columns], lines,
            [f"[{i + 1}] {n}" for i, n in enumerate(notes)])


def bench_split_sweep(device: torch.device, cases: Sequence[tuple[int, int]],
                      dtype: torch.dtype, reps: int, num_kv_heads: int = 8, group: int = 2,
                      head_dim: int = 128, block_size: int = 16) -> list[dict[str, Any]]:
    """Our decode kernel at fixed split counts (powers of two up to the context's key tiles,
    and the count ``decode_splits`` picks for this device), for tuning the choice: one row
    per (case, splits), ``chosen`` marking the default's."""
    from runner.kernels.attention import (
        _decode_block_n,
        decode_splits,
        device_sm_count,
        paged_decode,
    )

    measure = _timer(device)
    rows = []
    block_n = _decode_block_n(max(16, head_dim), dtype)
    sms = device_sm_count(device)
    for batch, ctx in cases:
        cache, tables, seq_lens, q, _, _ = _case(device, batch, ctx, num_kv_heads, group,
                                                 head_dim, block_size, dtype, False)
        chosen = decode_splits(ctx, batch, num_kv_heads, None, num_sms=sms, block_n=block_n)
        tiles = -(-ctx // block_n)
        counts = sorted({chosen, *(2 ** i for i in range(8) if 2 ** i <= tiles)})
        read = batch * ctx * 2 * num_kv_heads * head_dim * dtype.itemsize
        for splits in counts:
            call = functools.partial(paged_decode, q, cache, tables, seq_lens, ctx,
                                     head_dim ** -0.5, num_splits=splits)
            t = measure(call, reps, graph=device.type == "cuda")
            rows.append({"batch": batch, "context": ctx, "splits": splits,
                         "chosen": splits == chosen, "ms": t * 1e3, "gbps": read / t / 1e9})
        del cache
    return rows


def _measure_peer(measure: Callable[..., float], decode: Callable[[torch.Tensor], Any],
                  q: torch.Tensor, reps: int, device: torch.device, graph: bool = True
                  ) -> tuple[float, str]:
    """A peer's median time: replayed from a CUDA graph when ``graph`` and it can be captured
    (as our decode is), else eager."""
    if device.type == "cuda" and graph:
        try:
            return measure(lambda: decode(q), reps, graph=True), "graph"
        except Exception as exc:  # not capturable: time its eager launches, and say so
            print(f"# {type(exc).__name__} capturing a peer kernel; timing it eagerly")
    return measure(lambda: decode(q), reps, graph=False), "eager"


def _decode_call(backend: Any, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata) -> Callable[[], Any]:
    scale = q.shape[-1] ** -0.5
    return lambda: backend.forward(q, k, k, cache, meta, 0, scale)


QWEN3_0_6B: dict[str, Any] = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True)


def _qwen3(tiny: bool) -> Any:
    import transformers

    if tiny:
        return transformers.Qwen3Config(**{**QWEN3_0_6B, "hidden_size": 64, "num_hidden_layers": 2,
                                           "intermediate_size": 128, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "head_dim": 16,
                                           "vocab_size": 512})
    return transformers.Qwen3Config(**QWEN3_0_6B)


def _free_gpu_memory() -> None:
    """Once the last reference to an engine is dropped: return its KV cache and graph pools, so
    the next engine's profiling sees the memory as free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _recipe(vocab: int, num_seqs: int, min_len: int, max_len: int
            ) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's workload: random prompts and output lengths uniform in [min_len, max_len]."""
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    return prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)]


def warmup_workload(prompts: Sequence[Sequence[int]], lengths: Sequence[int], vocab: int,
                    seed: int = 1) -> tuple[list[list[int]], list[int]]:
    """The throughput warm-up: the timed workload itself with fresh token ids (the same prompt
    and output lengths, so the same prefill chunks, block-table widths and decode batch sizes,
    while the timed prompts find nothing of theirs in the prefix cache).  A smaller warm-up
    (short prompts, a few tokens each) left the timed run's long-context variants cold; the
    engine records the shapes of both runs and ``bench_throughput`` reports any the warm-up
    missed."""
    return _fresh_ids(prompts, vocab, random.Random(seed)), list(lengths)


def _fresh_ids(prompts: Sequence[Sequence[int]], vocab: int, rng: random.Random
               ) -> list[list[int]]:
    """The same prompt lengths with new random token ids (no prefix hits on earlier runs)."""
    return [[rng.randrange(vocab) for _ in p] for p in prompts]


def _compiled_kernel_count() -> int | None:
    """Compiled variants of the runner's Triton kernels so far, or None where Triton does not
    expose them (the interpreter; a Triton without ``JITFunction.device_caches``)."""
    from runner.kernels import attention, fused

    total, found = 0, False
    for module in (attention, fused):
        for obj in vars(module).values():
            caches = getattr(obj, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            try:
                total += sum(len(entry[0]) for entry in caches.values())
                found = True
            except (TypeError, IndexError):
                return None
    return total if found else None


def bench_throughput(backend: str, num_seqs: int, min_len: int, max_len: int, tiny: bool,
                     device: str, runs: int = 1, subset: int | None = None,
                     **engine: Any) -> dict[str, Any]:
    """nano-vllm's recipe: ``num_seqs`` random prompts and output lengths uniform in
    ``[min_len, max_len]``, temperature 0.6, ``ignore_eos``; the engine's defaults
    (``EngineConfig``) unless ``engine`` overrides them.

    After :func:`warmup_workload`, ``runs`` timed runs of the recipe in the same engine (the
    same lengths, fresh token ids after the first): the first is the figure reported, the
    others show how far it is from a warm engine.  ``subset``: also time the first ``subset``
    requests alone (fresh ids), the workload a bounded peer runs.  The result lists the shape
    keys the timed runs used that the warm-up did not (``shapes_not_warmed``, empty when the
    warm-up covers them) and the Triton kernels compiled during the timed runs (``None`` where
    Triton does not say)."""
    from runner.engine import LLM
    from runner.sampler import SamplingParams

    cfg = _qwen3(tiny)
    rng = random.Random(3)
    prompts, lengths = _recipe(cfg.vocab_size, num_seqs, min_len, max_len)
    kwargs: dict[str, Any] = dict(backend=backend, max_model_len=2 * max_len + 16, device=device,
                                  dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                  num_blocks=None if device == "cuda" else 4096)
    llm = LLM(cfg, **{**kwargs, **{k: v for k, v in engine.items() if v is not None}})

    def sampling(counts: Sequence[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in counts]

    def timed(llm: Any, batch: list[list[int]], counts: Sequence[int]) -> dict[str, Any]:
        if device == "cuda":
            torch.cuda.synchronize()
        steps0, preempted0 = llm.scheduler.stats.steps, llm.scheduler.stats.num_preemptions
        t0 = time.perf_counter()
        outs = llm.generate(batch, sampling(counts), use_tqdm=False)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        return {"num_seqs": len(batch), "output_tokens": tokens, "seconds": elapsed,
                "tokens_per_s": tokens / elapsed, "steps": llm.scheduler.stats.steps - steps0,
                "preemptions": llm.scheduler.stats.num_preemptions - preempted0}

    warm_shapes: set[tuple[Any, ...]] = set()
    timed_shapes: set[tuple[Any, ...]] = set()
    llm.runner.shape_log = warm_shapes
    warm_prompts, warm_counts = warmup_workload(prompts, lengths, cfg.vocab_size)
    llm.generate(warm_prompts, sampling(warm_counts), use_tqdm=False)
    llm.runner.shape_log = timed_shapes
    compiled0 = _compiled_kernel_count()
    done = [timed(llm, prompts if i == 0 else _fresh_ids(prompts, cfg.vocab_size, rng), lengths)
            for i in range(max(1, runs))]
    compiled1 = _compiled_kernel_count()
    llm.runner.shape_log = None
    c = llm.config
    result = {"backend": backend, **done[0], "runs": done,
              "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
              "num_blocks": llm.runner.num_blocks, "graph_sizes": llm.runner.graph_sizes,
              "async_scheduling": llm.async_scheduling,
              "exact_sampling_rows": llm.sampler.num_exact_rows,
              "warmup_shapes": sorted(map(str, warm_shapes)),
              "shapes_not_warmed": sorted(map(str, timed_shapes - warm_shapes)),
              "kernels_compiled_in_timed_runs": (None if compiled0 is None or compiled1 is None
                                                 else compiled1 - compiled0)}
    if subset:
        result["subset"] = timed(llm, _fresh_ids(prompts[:subset], cfg.vocab_size, rng),
                                 lengths[:subset])
    llm.close()
    del llm
    _free_gpu_memory()
    return result


def bench_transformers_cb(num_seqs: int, min_len: int, max_len: int, tiny: bool,
                          device: str, subset: int | None = None,
                          time_limit: float | None = None) -> dict[str, Any]:
    """The same recipe through ``transformers``' continuous batching (random weights, the
    model's dtype as the engine uses it); its default cache sizing on a GPU, a small explicit
    cache on the CPU (its memory-based sizing is meant for GPUs).  ``subset``: only the first
    that many requests of the ``num_seqs``-request recipe (a bounded run; ``bench_throughput``
    times the same subset).
    ``time_limit``: stop waiting after that many seconds; the result is then ``capped`` and
    counts only the requests finished by then (a lower bound on its rate)."""
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = _qwen3(tiny)
    prompts, lengths = _recipe(cfg.vocab_size, num_seqs, min_len, max_len)
    if subset:
        prompts, lengths = prompts[:subset], lengths[:subset]
    num_seqs = len(prompts)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                           max_new_tokens=max_len, eos_token_id=-1, pad_token_id=0)
    cb = None if device == "cuda" else ContinuousBatchingConfig(
        page_size=16, num_blocks=4096, max_batch_tokens=256, use_cuda_graph=False)

    def run(manager: Any, batch: list[list[int]], max_new: list[int],
            deadline: float | None = None) -> tuple[int, int, list[str]]:
        """(requests finished, their generated tokens, the ids of those not finished)."""
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(batch, max_new)]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            if deadline is not None and time.monotonic() > deadline:
                break
            result = manager.get_result(timeout=1 if deadline is not None else 60)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching: {result.error}")
                done[result.request_id] = result
        return (len(done), sum(len(r.generated_tokens) for r in done.values()),
                [i for i in ids if i not in done])

    with model.continuous_batching_context_manager(generation_config=gen,
                                                   continuous_batching_config=cb,
                                                   block=True, timeout=600) as manager:
        run(manager, _fresh_ids(prompts[:min(num_seqs, 24)], cfg.vocab_size,
                                random.Random(2)), [8] * min(num_seqs, 24))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        deadline = None if time_limit is None else time.monotonic() + time_limit
        finished, out_tokens, pending = run(manager, prompts, lengths, deadline)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        if pending:  # capped: drop the rest rather than wait for it on the way out
            for rid in pending:
                manager.cancel_request(rid)
            try:
                manager.stop(block=True, timeout=30, hard_stop=True)
            except TypeError:  # a transformers without hard_stop
                manager.stop(block=True, timeout=30)
    del model
    _free_gpu_memory()
    return {"peer": f"transformers {transformers.__version__} continuous batching (sdpa)",
            "num_seqs": num_seqs, "finished": finished, "capped": finished < num_seqs,
            "time_limit": time_limit, "output_tokens": out_tokens, "seconds": elapsed,
            "tokens_per_s": out_tokens / elapsed}


def bench_prefix(backend: str, num_seqs: int, prompt_len: int, tiny: bool,
                 device: str) -> dict[str, Any]:
    from runner.engine import LLM
    from runner.sampler import SamplingParams

    cfg = _qwen3(tiny)
    rng = random.Random(1)
    shared = [rng.randrange(cfg.vocab_size) for _ in range(int(prompt_len * 0.9))]
    prompts = [shared + [rng.randrange(cfg.vocab_size) for _ in range(prompt_len - len(shared))]
               for _ in range(num_seqs)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    result: dict[str, Any] = {"backend": backend, "num_seqs": num_seqs, "prompt_len": prompt_len}
    for caching in (False, True):
        llm = LLM(cfg, backend=backend, enable_prefix_caching=caching, device=device,
                  max_model_len=prompt_len + 16, max_num_batched_tokens=max(2048, prompt_len),
                  dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                  num_blocks=None if device == "cuda" else 4096)
        llm.generate([prompts[0]], one, use_tqdm=False)  # warm-up, and fills the cache
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts[1:], one, use_tqdm=False)
        if device == "cuda":
            torch.cuda.synchronize()
        result["cached_s" if caching else "uncached_s"] = time.perf_counter() - t0
        llm.close()
        del llm
        _free_gpu_memory()
    result["speedup"] = result["uncached_s"] / result["cached_s"]
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _print_attention(rows: Sequence[dict[str, Any]], copy: float, label: str) -> None:
    print(f"\ndecode attention ({label}); copy bandwidth {copy:,.0f} GB/s")
    print(render(["backend", "timing", "batch", "context", "ms", "GB/s", "% of copy",
                  "max err vs ours", "note"],
                 [[r["backend"], r["timing"], str(r["batch"]), str(r["context"]),
                   "" if r["ms"] is None else f"{r['ms']:.3f}",
                   "" if r["ms"] is None else f"{r['gbps']:,.0f}",
                   "" if r["ms"] is None else f"{100 * r['gbps'] / copy:.0f}%",
                   "" if r.get("max_err") is None else f"{r['max_err']:.1e}",
                   r["note"] or ""] for r in rows]))
    header, lines, notes = percent_table(rows, copy)
    print("\n% of copy bandwidth")
    print(render(header, lines))
    for n in notes:
        print(n)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["attention", "prefill-attention", "throughput", "prefix",
                                     "all"])
    ap.add_argument("--backends", help="ours, comma-separated (default: triton,torch,flash_attn "
                    "on a GPU, torch on the CPU; triton runs on the CPU when named here and "
                    "TRITON_INTERPRET=1)")
    ap.add_argument("--peers", help="attention: peer kernels, comma-separated, from "
                    f"{','.join(sorted(PEERS))} (default: all on a GPU, none on the CPU)")
    ap.add_argument("--batches", type=_ints, help="attention: batch sizes (comma-separated)")
    ap.add_argument("--contexts", type=_ints, help="attention: context lengths")
    ap.add_argument("--time-limit", type=float, metavar="S",
                    help="attention: start no case after S seconds (the rest: 'time limit')")
    ap.add_argument("--split-sweep", action="store_true",
                    help="attention: also time our decode at fixed split counts, batch 1, 8 "
                    "and 48 (CPU: 1 and 2) at the two longest contexts")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="tiny shapes on the CPU, even where a GPU exists (a smoke test)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--num-seqs", type=int, help="throughput: requests (default 256)")
    ap.add_argument("--runs", type=int, default=1,
                    help="throughput: timed runs after the warm-up, same engine (default 1)")
    ap.add_argument("--max-num-seqs", type=int, help="throughput: engine override")
    ap.add_argument("--max-num-batched-tokens", type=int, help="throughput: engine override")
    ap.add_argument("--enforce-eager", action="store_true", help="throughput: no CUDA graphs")
    ap.add_argument("--peer", choices=["transformers"], action="append", default=[],
                    help="throughput: also run this peer on the same workload")
    ap.add_argument("--peer-num-seqs", type=int,
                    help="throughput: the peer runs only the first N requests, and so does a "
                    "second timing of ours (default: 64 on a GPU, all on the CPU)")
    ap.add_argument("--peer-time-limit", type=float, metavar="S",
                    help="throughput: stop the peer after S seconds, counting finished requests "
                    "only (default: 120 on a GPU, none on the CPU)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="throughput: schedule each step after the previous one's tokens are in")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.allow_cpu
    if not cuda and not args.allow_cpu:
        print("runner.bench: no CUDA device (use --allow-cpu for a CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    tiny = not cuda
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    backends = []
    named = args.backends or ("triton,torch,flash_attn" if cuda else "torch")
    for name in (b for b in named.split(",")
                 if b and (cuda or b == "torch" or (b == "triton" and interpret))):
        try:
            get_backend(name)
        except ImportError as exc:
            print(f"# skipping backend {name}: {exc}")
            continue
        backends.append(name)
    peers = [p for p in (args.peers if args.peers is not None
                         else ",".join(sorted(PEERS)) if cuda else "").split(",") if p]
    for p in peers:
        if p not in PEERS:
            print(f"runner.bench: unknown peer {p!r}; choose from {sorted(PEERS)}",
                  file=sys.stderr)
            return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                               "torch": torch.__version__}
    print(f"# {results['device']} · torch {torch.__version__}", flush=True)
    dtype = torch.bfloat16 if cuda else torch.float32
    # On the CPU: tiny heads, so the Triton interpreter stays quick.
    kv_heads, head_dim = (8, 128) if cuda else (2, 32)
    shape = f"{kv_heads} KV heads x {head_dim}, GQA 2, {'bf16' if cuda else 'fp32'}"
    if args.what in ("attention", "all"):
        copy = copy_bandwidth(device, (1 << 30) if cuda else (1 << 24))
        contexts = args.contexts or ([512, 2048, 8192, 32768] if cuda else [64, 256])
        deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
        rows = bench_attention(device, args.batches or ([1, 8, 32, 128, 256] if cuda else [1, 2]),
                               contexts, backends, dtype=dtype, reps=20 if cuda else 2,
                               peers=peers, deadline=deadline,
                               num_kv_heads=kv_heads, head_dim=head_dim)
        results["copy_gbps"] = copy
        results["attention"] = rows
        _print_attention(rows, copy, shape)
        if args.split_sweep and "triton" in backends:
            longest = sorted(contexts)[-2:]
            sweep_batches = (1, 8, 48) if cuda else (1, 2)
            sweep = bench_split_sweep(device, [(b, c) for b in sweep_batches for c in longest],
                                      dtype,
                                      reps=20 if cuda else 1,
                                      num_kv_heads=kv_heads, head_dim=head_dim)
            results["split_sweep"] = sweep
            print("\nour decode at fixed split counts (* = the default's choice)")
            print(render(["batch", "context", "splits", "ms", "% of copy"],
                         [[str(r["batch"]), str(r["context"]),
                           f"{r['splits']}{' *' if r['chosen'] else ''}", f"{r['ms']:.3f}",
                           f"{100 * r['gbps'] / copy:.0f}%"] for r in sweep]))
    if args.what in ("prefill-attention", "all"):
        rows = bench_attention(device, [1, 8, 32] if cuda else [1, 2],
                               [512, 2048, 8192] if cuda else [32], backends, dtype=dtype,
                               reps=10 if cuda else 2, peers=peers, prefill=True,
                               num_kv_heads=kv_heads, head_dim=head_dim)
        results["prefill_attention"] = rows
        print(f"\nprefill attention (causal, whole context; {shape})")
        print(render(["backend", "timing", "batch", "tokens", "ms", "TFLOP/s",
                      "max err vs ours", "note"],
                     [[r["backend"], r["timing"], str(r["batch"]), str(r["context"]),
                       "" if r["ms"] is None else f"{r['ms']:.3f}",
                       "" if r["ms"] is None else f"{r['tflops']:.1f}",
                       "" if r.get("max_err") is None else f"{r['max_err']:.1e}",
                       r["note"] or ""] for r in rows]))
    if args.what in ("throughput", "all"):
        num_seqs = args.num_seqs or (256 if cuda else 4)
        lens = (100 if cuda else 4, 1024 if cuda else 12)
        subset = None
        if args.peer:
            subset = args.peer_num_seqs or (64 if cuda else None)
            subset = subset if subset and subset < num_seqs else None
        peer_limit = args.peer_time_limit if args.peer_time_limit is not None else (
            120.0 if cuda else None)
        rows = [bench_throughput(b, num_seqs, *lens, tiny, device.type, runs=args.runs,
                                 subset=subset, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 enforce_eager=args.enforce_eager or None,
                                 async_scheduling=False if args.no_async_scheduling else None)
                for b in backends if b != "torch" or not cuda]
        results["throughput"] = rows
        print("\nend to end (Qwen3-0.6B shape, random weights, nano-vllm recipe)")
        print(render(["backend", "async", "seqs", "output tokens", "s", "tok/s", "later runs",
                      "steps", "max seqs", "batched tokens", "KV blocks", "graphs", "preempted",
                      "not warmed"],
                     [[r["backend"], "yes" if r["async_scheduling"] else "no",
                       str(r["num_seqs"]), str(r["output_tokens"]),
                       f"{r['seconds']:.2f}", f"{r['tokens_per_s']:,.0f}",
                       " ".join(f"{x['tokens_per_s']:,.0f}" for x in r["runs"][1:]),
                       str(r["steps"]),
                       str(r["max_num_seqs"]), str(r["max_num_batched_tokens"]),
                       str(r["num_blocks"]),
                       f"{len(r['graph_sizes'])} (<= {max(r['graph_sizes'], default=0)})",
                       str(r["preemptions"]), str(len(r["shapes_not_warmed"]))]
                      for r in rows]))
        e2e_peers = [bench_transformers_cb(num_seqs, *lens, tiny, device.type, subset=subset,
                                           time_limit=peer_limit)
                     for _ in args.peer]
        if e2e_peers:
            results["throughput_peers"] = e2e_peers
            if subset:
                print(f"(the peer runs the first {subset} requests; ours timed on the same "
                      f"{subset} in the same engine for the ratio)")
            print(render(["peer", "seqs", "finished", "output tokens", "s", "tok/s"]
                         + [f"{r['backend']} / peer" for r in rows],
                         [[p["peer"], str(p["num_seqs"]),
                           f"{p['finished']}{' (time limit)' if p['capped'] else ''}",
                           str(p["output_tokens"]),
                           f"{p['seconds']:.2f}", f"{p['tokens_per_s']:,.0f}"]
                          + [f"{r.get('subset', r)['tokens_per_s'] / p['tokens_per_s']:.2f}x"
                             if p["tokens_per_s"] else "n/a" for r in rows]
                          for p in e2e_peers]))
    if args.what in ("prefix", "all"):
        rows = [bench_prefix(b, 32 if cuda else 3, 4096 if cuda else 48, tiny, device.type)
                for b in backends if b != "torch" or not cuda]
        results["prefix"] = rows
        print("\nprefill with a 90% cached prefix vs prefix caching off")
        print(render(["backend", "requests", "prompt", "uncached s", "cached s", "speedup"],
                     [[r["backend"], str(r["num_seqs"]), str(r["prompt_len"]),
                       f"{r['uncached_s']:.3f}", f"{r['cached_s']:.3f}", f"{r['speedup']:.2f}x"]
                      for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
