"""One vLLM engine, run as a script by test_engine.py (a process per engine: vLLM's engine owns
process-wide state).  It reads a JSON job from argv[1] and writes JSON results to argv[2].

The job: the model directory, how kvcore comes in (``"stock"``: not at all; ``"scheduler_cls"``:
``LLM(scheduler_cls=...)``; ``"plugin"``: the ``kvcore`` general plugin with ``VLLM_PLUGINS``),
kvcore's settings, async scheduling, the pool size, and where KV events go (``"record"``: the
scheduler's publisher is swapped for a recorder of the encoded batches; ``"zmq"``: vLLM's own ZMQ
publisher, read back by a subscriber and decoded with kvcore's decoder).

The workload: prompts sharing a 96-token prefix, long prompts (chunked prefill: the step budget is
64 tokens), a pool small enough to preempt, then a second round of prompts that hit the cache, then
fresh prompts queued ahead of one that extends the shared prefix.
Results: greedy output token ids, cached-token counts, preemptions, scheduler and manager class
names, and the events.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from tests.integrations.vllm.engine_probe import count_preemptions

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process


def prompts() -> tuple[list[list[int]], ...]:
    system = [(7 * j) % 500 + 1 for j in range(96)]
    first = [system + [(i * 13 + j) % 500 + 1 for j in range(40 + 9 * i)] for i in range(8)]
    first += [[(i * 31 + 7 * j) % 500 + 1 for j in range(200 + i)] for i in range(4)]
    second = [[*p, 3, 1, 4, 1, 5] for p in first[:6]] + [system + [9] * 30]
    # Fresh prompts queued ahead of one that extends the shared prefix: a longest-prefix order
    # moves the last one forward whichever blocks the eviction policy kept, short of the prefix.
    third = [[(i * 17 + 11 * j) % 500 + 1 for j in range(120)] for i in range(3)]
    third.append(system + [9] * 30 + [2, 7, 1, 8])
    return first, second, third


class Recorder:
    """Stands in for the scheduler's event publisher: keeps each batch encoded, ts zeroed."""

    def __init__(self) -> None:
        import msgspec

        self.encoder = msgspec.msgpack.Encoder()
        self.batches: list[str] = []

    def publish(self, batch: Any) -> None:
        import msgspec

        self.batches.append(self.encoder.encode(msgspec.structs.replace(batch, ts=0.0)).hex())

    def shutdown(self) -> None:
        pass


def subscribe(endpoint: str, received: list[bytes], stop: threading.Event) -> None:
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    while not stop.is_set():
        try:
            received.append(sub.recv_multipart()[-1])
        except zmq.Again:
            continue
    sub.close(0)


def main() -> None:
    job = json.loads(sys.argv[1])
    kw: dict[str, Any] = {}
    if job["mode"] == "scheduler_cls":
        kw["scheduler_cls"] = ("kvcore.integrations.vllm.AsyncScheduler" if job["async"]
                               else "kvcore.integrations.vllm.Scheduler")
    if job.get("settings") is not None:
        kw["additional_config"] = {"kvcore": job["settings"]}
    # The installed kvcore plugin loads with every engine unless VLLM_PLUGINS names others;
    # only the plugin route loads it here (it would do nothing without the opt-in anyway).
    os.environ["VLLM_PLUGINS"] = "kvcore" if job["mode"] == "plugin" else ""
    received: list[bytes] = []
    stop = threading.Event()
    if job["events"] == "zmq":
        port = job["port"]
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"tcp://*:{port}", "topic": "kv"}
        threading.Thread(target=subscribe, args=(f"tcp://127.0.0.1:{port}", received, stop),
                         daemon=True).start()
    elif job["events"] == "record":
        kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "null"}

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(job["model"], skip_tokenizer_init=True, block_size=32, max_model_len=512,
              num_gpu_blocks_override=job["num_blocks"], enable_prefix_caching=True,
              max_num_batched_tokens=64, max_num_seqs=8, dtype="float32", seed=0,
              async_scheduling=job["async"],
              # On the CPU this is the share of the NUMA node's memory the engine must find
              # free at start (the pool's size is overridden above): keep it small.
              gpu_memory_utilization=0.2, **kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    recorder = Recorder()
    if job["events"] == "record":
        sched.kv_event_publisher = recorder
    preempted = count_preemptions(sched)
    reordered = [0]  # steps where kvcore's admission order moved a waiting request
    queue = getattr(sched, "kvcore_queue", None)
    if queue is not None:
        reorder = queue.reorder

        def counting_reorder() -> None:
            before = [r.request_id for r in queue]
            reorder()
            reordered[0] += before != [r.request_id for r in queue]
        queue.reorder = counting_reorder
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs, cached = [], []
    for batch in prompts():
        for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy,
                              use_tqdm=False):
            outputs.append(list(o.outputs[0].token_ids))
            cached.append(o.num_cached_tokens or 0)
    if job["events"] == "zmq":
        time.sleep(1.0)
        stop.set()
    from kvcore.events import BlockStored, decode_event_batch

    stored = sum(isinstance(e, BlockStored) for data in received
                 for e in decode_event_batch(data).events)
    result = {"outputs": outputs, "cached_tokens": cached, "preempted": len(preempted),
              "scheduler": type(sched).__name__, "manager": type(sched.kv_cache_manager).__name__,
              "events": recorder.batches, "zmq_batches": len(received), "zmq_stored": stored,
              "reordered": reordered[0]}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
