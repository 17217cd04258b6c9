"""Benchmarks: ``python -m kvcore.bench {pool,hash,manager}``.

Each workload lives in ``kvcore/bench/workloads/`` and runs, unchanged, inside one persistent
worker process per implementation: kvcore from this source tree, the vLLM peer in its own
virtualenv (``scripts/peer_vllm.sh``), and optionally a compiled kvcore (``--compiled-python``).
:mod:`kvcore.bench.workers` drives them, taking repeats in turns; :mod:`kvcore.bench.commands`
prints the tables.
"""
