"""Benchmarks: ``python -m kvcore.bench {pool,hash,manager}``.

Each workload lives in ``kvcore/bench/workloads/`` as a standalone script that imports either
kvcore or vLLM (``--impl``), so both sides run the same measurement code; vLLM's side runs in its
own virtualenv (``scripts/peer_vllm.sh``) through :mod:`kvcore.bench.peer`.
"""
