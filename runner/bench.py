"""GPU benchmarks for the runner: ``python -m runner.bench {attention,throughput,prefix,all}``.

* ``attention``: decode attention's achieved bandwidth (bytes of K/V read / median time) per
  backend, for batch sizes 1-256 and contexts 512-32k, next to the device's measured
  device-to-device copy bandwidth.  Goal: >= 80% of copy bandwidth at long context.  Peer
  kernels (``--peers``, default ``flashinfer,flex`` on a GPU; :mod:`runner.peer_kernels`) read
  the same pages through the same block tables in the same run; each peer's output is checked
  against ours (``max_err``) before it is timed.
* ``prefill-attention``: causal prefill attention over paged K/V (each sequence's whole context
  is its query: no cached prefix), in TFLOP/s, with the same peers (FlashInfer's paged prefill,
  FlexAttention); every kernel timed eagerly (our prefill is not graph-captured).
* ``throughput``: end to end on a Qwen3-0.6B-shaped model with random weights, nano-vllm's recipe
  (256 sequences, input and output lengths uniform in 100-1024, ignore_eos).  ``--peer
  transformers`` adds the same prompts and output lengths through ``transformers``' own
  continuous batching (the manager behind ``generate_batch``: paged KV cache, SDPA), same model
  shape and dtype, in the same run, and the ratio.
* ``prefix``: prefill time for requests whose prompts share a 90% prefix already in the cache,
  against the same prompts with prefix caching off.

Without CUDA it prints one line and exits 2; ``--allow-cpu`` runs tiny shapes on the CPU (even
where a GPU exists) to check the code paths.  Backends that cannot load here (flash-attn not
installed) are listed and skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def bench_attention(device: torch.device, batches: Sequence[int], contexts: Sequence[int],
                    backends: Sequence[str], num_kv_heads: int = 8, group: int = 2,
                    head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                    reps: int = 20, peers: Sequence[str] = (), prefill: bool = False
                    ) -> list[dict[str, Any]]:
    """Decode (one query token per sequence) or, with ``prefill``, causal prefill of the whole
    context, per backend and peer; rows carry GB/s of K/V read and TFLOP/s."""
    measure = _timer(device)
    rows: list[dict[str, Any]] = []
    missing: set[str] = set()
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 << 30
    for batch in batches:
        for ctx in contexts:
            blocks_per_seq = -(-ctx // block_size)
            num_blocks = batch * blocks_per_seq + 1
            kv_bytes = 2 * num_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
            if kv_bytes > 0.6 * free:
                continue
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
            read = batch * ctx * 2 * num_kv_heads * head_dim * dtype.itemsize
            # QK^T and PV, 2 flops per multiply-add, over the causal (query, key) pairs.
            pairs = batch * (q_len * (ctx - q_len) + q_len * (q_len + 1) // 2)
            flops = 4 * pairs * num_kv_heads * group * head_dim
            ours: torch.Tensor | None = None
            for name in backends:
                if name == "torch" and (batch * ctx > 64 * 2048 or (prefill and ctx > 2048)):
                    continue  # the reference gathers pages in Python: only small shapes
                try:
                    backend = get_backend(name)
                except ImportError:
                    continue
                graph = (device.type == "cuda" and not prefill
                         and getattr(backend, "supports_cuda_graphs", False))
                call = _decode_call(backend, q, k, cache, meta)
                if ours is None:
                    ours = call().float()
                t = measure(call, reps, graph=graph)
                rows.append({"backend": name, "batch": batch, "context": ctx,
                             "timing": "graph" if graph else "eager", "q_len": q_len,
                             "ms": t * 1e3, "gbps": read / t / 1e9, "tflops": flops / t / 1e12})
            for name in peers:
                if name in missing:
                    continue
                try:
                    decode = build_peer(name, cache, tables, seq_lens, head_dim ** -0.5,
                                        num_kv_heads * group, q_len)
                except ImportError as exc:
                    print(f"# skipping peer {name}: {exc}")
                    missing.add(name)
                    continue
                err = None if ours is None else (decode(q).float() - ours).abs().max().item()
                t, timing = _measure_peer(measure, decode, q, reps, device, graph=not prefill)
                rows.append({"backend": f"peer:{name}", "batch": batch, "context": ctx,
                             "timing": timing, "q_len": q_len, "ms": t * 1e3,
                             "gbps": read / t / 1e9, "tflops": flops / t / 1e12,
                             "max_err": err})
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


def bench_throughput(backend: str, num_seqs: int, min_len: int, max_len: int, tiny: bool,
                     device: str, **engine: Any) -> dict[str, Any]:
    """nano-vllm's recipe: ``num_seqs`` random prompts and output lengths uniform in
    ``[min_len, max_len]``, temperature 0.6, ``ignore_eos``; the engine's defaults
    (``EngineConfig``) unless ``engine`` overrides them."""
    from runner.engine import LLM
    from runner.sampler import SamplingParams

    cfg = _qwen3(tiny)
    rng = random.Random(1)
    prompts, lengths = _recipe(cfg.vocab_size, num_seqs, min_len, max_len)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in lengths]
    kwargs: dict[str, Any] = dict(backend=backend, max_model_len=2 * max_len + 16, device=device,
                                  dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                  num_blocks=None if device == "cuda" else 4096)
    llm = LLM(cfg, **{**kwargs, **{k: v for k, v in engine.items() if v is not None}})
    # Warm-up: prefill and decode (several graph sizes), the sampling path, then a clean slate.
    warm = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(4, min(64, max_len)))]
            for _ in range(min(num_seqs, 24))]
    llm.generate(warm, SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    if device == "cuda":
        torch.cuda.synchronize()
    steps0, preempted0 = llm.scheduler.stats.steps, llm.scheduler.stats.num_preemptions
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    c = llm.config
    result = {"backend": backend, "num_seqs": num_seqs, "output_tokens": out_tokens,
              "seconds": elapsed, "tokens_per_s": out_tokens / elapsed,
              "steps": llm.scheduler.stats.steps - steps0,
              "preemptions": llm.scheduler.stats.num_preemptions - preempted0,
              "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
              "num_blocks": llm.runner.num_blocks, "graph_sizes": llm.runner.graph_sizes,
              "async_scheduling": llm.async_scheduling,
              "exact_sampling_rows": llm.sampler.num_exact_rows}
    llm.close()
    del llm
    _free_gpu_memory()
    return result


def bench_transformers_cb(num_seqs: int, min_len: int, max_len: int, tiny: bool,
                          device: str) -> dict[str, Any]:
    """The same recipe through ``transformers``' continuous batching (random weights, the
    model's dtype as the engine uses it); its default cache sizing on a GPU, a small explicit
    cache on the CPU (its memory-based sizing is meant for GPUs)."""
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = _qwen3(tiny)
    prompts, lengths = _recipe(cfg.vocab_size, num_seqs, min_len, max_len)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                           max_new_tokens=max_len, eos_token_id=-1, pad_token_id=0)
    cb = None if device == "cuda" else ContinuousBatchingConfig(
        page_size=16, num_blocks=4096, max_batch_tokens=256, use_cuda_graph=False)

    def run(manager: Any, batch: list[list[int]], max_new: list[int]) -> int:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(batch, max_new)]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching: {result.error}")
                done[result.request_id] = result
        return sum(len(done[i].generated_tokens) for i in ids)

    with model.continuous_batching_context_manager(generation_config=gen,
                                                   continuous_batching_config=cb,
                                                   block=True, timeout=600) as manager:
        run(manager, prompts[:min(num_seqs, 24)], [8] * min(num_seqs, 24))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out_tokens = run(manager, prompts, lengths)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    del model
    _free_gpu_memory()
    return {"peer": f"transformers {transformers.__version__} continuous batching (sdpa)",
            "num_seqs": num_seqs, "output_tokens": out_tokens, "seconds": elapsed,
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["attention", "prefill-attention", "throughput", "prefix",
                                     "all"])
    ap.add_argument("--backends", default="triton,torch,flash_attn")
    ap.add_argument("--peers", help="attention: peer kernels, comma-separated, from "
                    f"{','.join(sorted(PEERS))} (default: all on a GPU, none on the CPU)")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="tiny shapes on the CPU, even where a GPU exists (a smoke test)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--num-seqs", type=int, help="throughput: requests (default 256)")
    ap.add_argument("--max-num-seqs", type=int, help="throughput: engine override")
    ap.add_argument("--max-num-batched-tokens", type=int, help="throughput: engine override")
    ap.add_argument("--enforce-eager", action="store_true", help="throughput: no CUDA graphs")
    ap.add_argument("--peer", choices=["transformers"], action="append", default=[],
                    help="throughput: also run this peer on the same workload")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="throughput: schedule each step after the previous one's tokens are in")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.allow_cpu
    if not cuda and not args.allow_cpu:
        print("runner.bench: no CUDA device (use --allow-cpu for a CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    tiny = not cuda
    backends = []
    for name in (b for b in args.backends.split(",") if b and (cuda or b == "torch")):
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
    print(f"# {results['device']} · torch {torch.__version__}")
    if args.what in ("attention", "all"):
        copy = copy_bandwidth(device, (1 << 30) if cuda else (1 << 24))
        rows = bench_attention(device, [1, 8, 32, 128, 256] if cuda else [1, 2],
                               [512, 2048, 8192, 32768] if cuda else [64, 256], backends,
                               dtype=torch.bfloat16 if cuda else torch.float32,
                               reps=20 if cuda else 2, peers=peers)
        results["copy_gbps"] = copy
        results["attention"] = rows
        print(f"\ndecode attention (8 KV heads x 128, GQA 2, {'bf16' if cuda else 'fp32'}); "
              f"copy bandwidth "
              f"{copy:,.0f} GB/s")
        print(render(["backend", "timing", "batch", "context", "ms", "GB/s", "% of copy",
                      "max err vs ours"],
                     [[r["backend"], r["timing"], str(r["batch"]), str(r["context"]),
                       f"{r['ms']:.3f}",
                       f"{r['gbps']:,.0f}", f"{100 * r['gbps'] / copy:.0f}%",
                       "" if r.get("max_err") is None else f"{r['max_err']:.1e}"]
                      for r in rows]))
    if args.what in ("prefill-attention", "all"):
        rows = bench_attention(device, [1, 8, 32] if cuda else [1, 2],
                               [512, 2048, 8192] if cuda else [32], backends,
                               dtype=torch.bfloat16 if cuda else torch.float32,
                               reps=10 if cuda else 2, peers=peers, prefill=True)
        results["prefill_attention"] = rows
        print(f"\nprefill attention (causal, whole context; 8 KV heads x 128, GQA 2, "
              f"{'bf16' if cuda else 'fp32'})")
        print(render(["backend", "timing", "batch", "tokens", "ms", "TFLOP/s",
                      "max err vs ours"],
                     [[r["backend"], r["timing"], str(r["batch"]), str(r["context"]),
                       f"{r['ms']:.3f}", f"{r['tflops']:.1f}",
                       "" if r.get("max_err") is None else f"{r['max_err']:.1e}"]
                      for r in rows]))
    if args.what in ("throughput", "all"):
        num_seqs = args.num_seqs or (256 if cuda else 4)
        lens = (100 if cuda else 4, 1024 if cuda else 12)
        rows = [bench_throughput(b, num_seqs, *lens, tiny,
                                 device.type, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 enforce_eager=args.enforce_eager or None,
                                 async_scheduling=False if args.no_async_scheduling else None)
                for b in backends if b != "torch" or not cuda]
        results["throughput"] = rows
        print("\nend to end (Qwen3-0.6B shape, random weights, nano-vllm recipe)")
        print(render(["backend", "async", "seqs", "output tokens", "s", "tok/s", "steps",
                      "max seqs", "batched tokens", "KV blocks", "graphs", "preempted"],
                     [[r["backend"], "yes" if r["async_scheduling"] else "no",
                       str(r["num_seqs"]), str(r["output_tokens"]),
                       f"{r['seconds']:.2f}", f"{r['tokens_per_s']:,.0f}", str(r["steps"]),
                       str(r["max_num_seqs"]), str(r["max_num_batched_tokens"]),
                       str(r["num_blocks"]),
                       f"{len(r['graph_sizes'])} (<= {max(r['graph_sizes'], default=0)})",
                       str(r["preemptions"])] for r in rows]))
        e2e_peers = [bench_transformers_cb(num_seqs, *lens, tiny, device.type)
                     for _ in args.peer]
        if e2e_peers:
            results["throughput_peers"] = e2e_peers
            print(render(["peer", "seqs", "output tokens", "s", "tok/s"]
                         + [f"{r['backend']} / peer" for r in rows],
                         [[p["peer"], str(p["num_seqs"]), str(p["output_tokens"]),
                           f"{p['seconds']:.2f}", f"{p['tokens_per_s']:,.0f}"]
                          + [f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x" for r in rows]
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
