"""Tensor-parallel ranks end with the engine's process, however it ends, and listen on loopback.

An engine with ``tensor_parallel_size=2`` on CPU runs in a process of its own: rank 1 is its
spawned child (with multiprocessing's resource tracker), rank 0's rendezvous store and gloo's
connections listen on 127.0.0.1 only.  The process is then killed (SIGKILL: it runs nothing
more, the hardest case; a rank ends on any death of its parent the same way, which
``tests/test_lifeline.py`` checks for SIGTERM and SIGHUP too); no rank may remain, nor any socket
they listened on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.proc_tree import (
    LINUX_ONLY,
    cmdline,
    descendants,
    kill_parent,
    lines_until,
    listening,
    reap_tree,
    wait_gone,
)

pytestmark = LINUX_ONLY
REPO = Path(__file__).resolve().parents[2]

ENGINE = """
import os, sys, time
import transformers
from runner.engine import LLM

config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                  max_position_embeddings=256)
llm = LLM(config, device="cpu", block_size=4, num_blocks=64, seed=3, tensor_parallel_size=2)
print("started", flush=True)
time.sleep(600)
"""


def test_ranks_end_with_the_engine_and_listen_on_loopback() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GLOO_SOCKET_IFNAME", None)  # the engine's own choice
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        lines_until(engine, "started")
        processes = {engine.pid} | descendants(engine.pid)
        ranks = [p for p in processes if "spawn_main" in cmdline(p)]
        addresses = listening(processes)
        assert len(ranks) == 1 and len(addresses) >= 3  # the store, gloo on both ranks
        assert {host for host, _ in addresses} == {"127.0.0.1"}, addresses
        tree, addresses = kill_parent(engine, signal.SIGKILL)
        wait_gone(tree, addresses, timeout=30)
    finally:
        reap_tree(engine)
