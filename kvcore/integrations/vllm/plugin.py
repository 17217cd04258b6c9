"""The ``kvcore`` entry point of vLLM's ``vllm.general_plugins`` group.

vLLM loads general plugins in every process it starts (all of them, or those named in
``VLLM_PLUGINS``).  :func:`register` wraps ``SchedulerConfig.get_scheduler_cls`` so that the
scheduler class vLLM picks — its ``Scheduler``, its ``AsyncScheduler`` or a custom
``scheduler_cls`` — gets :class:`~kvcore.integrations.vllm.scheduler.KvcoreSchedulerMixin` mixed
in.  That mix-in does nothing unless ``additional_config`` has a ``"kvcore"`` entry: installing
kvcore changes no vLLM run by itself; the entry is the opt-in (and carries the settings)::

    VLLM_PLUGINS=kvcore vllm serve MODEL --additional-config '{"kvcore": {}}'
"""

from __future__ import annotations

import functools
from typing import Any


def register() -> None:
    """Install the wrapper (idempotent: vLLM may load plugins several times per process)."""
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_kvcore_wrapped", False):
        return

    @functools.wraps(original)
    def get_scheduler_cls(self: Any) -> type:
        from kvcore.integrations.vllm.scheduler import with_kvcore

        return with_kvcore(original(self))

    get_scheduler_cls._kvcore_wrapped = True  # type: ignore[attr-defined]  # marks the wrapper
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls  # the plugin's one hook into vLLM
