"""kvcore as the KV-cache manager of vLLM's own scheduler (vLLM 0.32 and 0.33).

Two ways in (both read kvcore's settings from ``additional_config["kvcore"]``, see
:mod:`~kvcore.integrations.vllm.settings`):

* ``LLM(..., scheduler_cls="kvcore.integrations.vllm.Scheduler")`` or
  ``vllm serve MODEL --scheduler-cls kvcore.integrations.vllm.AsyncScheduler``: vLLM's own
  scheduler classes with kvcore's manager (:mod:`~kvcore.integrations.vllm.scheduler`);
* the ``kvcore`` entry of ``vllm.general_plugins`` (:mod:`~kvcore.integrations.vllm.plugin`):
  whatever scheduler vLLM picks, with kvcore's manager when ``additional_config`` has a
  ``"kvcore"`` entry.

Configurations kvcore would manage differently from vLLM are refused at engine start
(:mod:`~kvcore.integrations.vllm.config`), as are unreleased vLLM builds unless a setting allows
them and any other vLLM version whose manager contract differs from what the adapter relies on
(:mod:`~kvcore.integrations.vllm.version`, :mod:`~kvcore.integrations.vllm.contract`).  Importing this package does not import vLLM; its
names below do, on first use.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "Scheduler": "kvcore.integrations.vllm.scheduler",
    "AsyncScheduler": "kvcore.integrations.vllm.scheduler",
    "KvcoreSchedulerMixin": "kvcore.integrations.vllm.scheduler",
    "with_kvcore": "kvcore.integrations.vllm.scheduler",
    "KVCacheManagerAdapter": "kvcore.integrations.vllm.manager",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["AsyncScheduler", "KVCacheManagerAdapter", "KvcoreSchedulerMixin", "Scheduler",
           "with_kvcore"]
