"""vllm-router's ``kv_aware`` policy (vLLM's Rust HTTP router, 0.1.17) routes on kvcore's KV
events: three kvcore publishers, three fake OpenAI workers on 127.0.0.1, and every request goes
to the replica kvcore's :class:`~kvcore.cluster.index.KVRoutingIndex` names (the one holding the
longest prefix).

Needs the router's venv (``bash scripts/vllm_router.sh``; CI builds it): without it the test is
skipped with a summary line, except under CI (``CI`` set), where that is a failure.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvcore.cluster import EventChannel, KVRoutingIndex, request_keys
from kvcore.cluster.dynamo.indexer import free_port
from kvcore.events.publisher import ZmqEventPublisher
from kvcore.manager import KVCacheManager
from kvcore.proc.lifeline import guarded
from tests.conftest import ROUTER_BUILD
from tests.factories import admit, full_spec, make_manager

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 4
MODEL = "m"


def router_binary() -> Path:
    path = Path(os.environ.get("KVCORE_VLLM_ROUTER",
                               ROOT / ".vllm-router-venv" / "bin" / "vllm-router"))
    if not path.is_file():
        msg = f"vllm-router not found at {path}: build it with `{ROUTER_BUILD}`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


class FakeWorker:
    """An OpenAI-style server that answers every completion at once and records its prompts."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                           if self.path.startswith("/v1/models") else {"status": "ok"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                worker.prompts.append(body["prompt"])
                self._send({"id": "c", "object": "text_completion", "model": MODEL,
                            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                            "usage": {"prompt_tokens": len(body["prompt"]),
                                      "completion_tokens": 1, "total_tokens": 1}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, list[FakeWorker], list[ZmqEventPublisher]]]:
    binary = router_binary()
    workers = [FakeWorker() for _ in range(3)]
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") for _ in range(3)]
    port = free_port()
    cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
           "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL,
           "--worker-startup-check-interval", "1", "--worker-urls", *[w.url for w in workers]]
    for w, p in zip(workers, pubs):
        cmd += ["--kv-event-source", f"{w.url}={p.endpoint}",
                "--kv-event-replay-source", f"{w.url}={p.replay_endpoint}"]
    log = (tmp_path / "router.log").open("wb")
    # Ends with this test's process however that ends (a killed pytest leaves no router).
    proc = subprocess.Popen(guarded(cmd), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm-router did not come up in 60 s"
            time.sleep(0.2)
        yield url, workers, pubs
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for p in pubs:
            p.shutdown(timeout=1)
        for w in workers:
            w.close()


def complete(url: str, prompt: list[int], workers: list[FakeWorker]) -> int:
    """Send one completion through the router; which worker got it."""
    before = [len(w.prompts) for w in workers]
    req = urllib.request.Request(f"{url}/v1/completions", headers={
        "Content-Type": "application/json"}, data=json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    got = [i for i, w in enumerate(workers) if len(w.prompts) > before[i]]
    assert len(got) == 1 and workers[got[0]].prompts[-1] == prompt
    return got[0]


def cache(manager: KVCacheManager, request_id: str, prompt: list[int]) -> list[Any]:
    request = manager.make_request(request_id, prompt)
    assert admit(manager, request) is not None
    manager.free(request)
    return manager.take_events()


def test_kv_aware_routes_to_the_replica_kvcores_index_names(
        cluster: tuple[str, list[FakeWorker], list[ZmqEventPublisher]]) -> None:
    url, workers, pubs = cluster
    rng = random.Random(35)
    managers = [make_manager(full_spec(BLOCK_SIZE), num_blocks=64, enable_events=True)
                for _ in range(3)]
    index = KVRoutingIndex()
    channels = [EventChannel(index, r) for r in range(3)]
    # Each prompt's prefix is cached on one or two replicas, at different lengths.
    prompts = [[rng.randrange(30_000) for _ in range(rng.randrange(13, 30))] for _ in range(18)]
    for i, prompt in enumerate(prompts):
        for r, blocks in zip(rng.sample(range(3), rng.choice((1, 2))), (5, 2), strict=False):
            events = cache(managers[r], f"p{i}-{r}", prompt[:blocks * BLOCK_SIZE + 1])
            pubs[r].publish(events)
            channels[r].publish(events)
    # A marker prompt cached last on each replica: once requests for it go there, the router
    # has read that replica's stream up to it (a stream is read in order; the streams are
    # read independently, so every one needs its own marker).
    deadline = time.monotonic() + 30
    for r in range(3):
        marker = [30_001 + 1000 * r + i for i in range(BLOCK_SIZE * 3 + 1)]
        pubs[r].publish(cache(managers[r], f"marker{r}", marker))
        while complete(url, marker, workers) != r:
            assert time.monotonic() < deadline, f"the router never routed marker {r} there"
            time.sleep(0.1)
    checked = 0
    for i in rng.sample(range(len(prompts)), len(prompts)):
        prompt = prompts[i]
        keys = request_keys(managers[0].make_request(f"q{i}", prompt).block_hashes,
                            len(prompt), BLOCK_SIZE)
        matches = index.match(keys)
        best = max(n for n, _ in matches.values())
        named = [r for r, (n, _) in matches.items() if n == best]
        assert len(named) == 1  # one replica holds the longest prefix
        assert complete(url, prompt, workers) == named[0], (i, matches)
        checked += 1
    assert checked == len(prompts)
