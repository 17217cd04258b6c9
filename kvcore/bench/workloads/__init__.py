"""Workloads measured inside benchmark workers (``worker.py``; see :mod:`kvcore.bench.workers`).

Each workload module (``manager_cycle``, ``pool_ops``, ``hash_ops``) runs the same code under
kvcore's interpreter and under the vLLM peer's, imports only the implementation it is asked for,
and exposes ``cases(impl, params)`` (the case list, identical for every implementation) and
``measure(impl, case, params, repeat, warmup)`` (one timed sample, see ``timing``).  This package
must stay importable without kvcore: a worker loads it by path under an alias.
"""
