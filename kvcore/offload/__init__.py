"""A host-memory tier below the device cache: the offloading manager (scheduler side)."""

from kvcore.offload.manager import (
    MEDIUM_CPU,
    HostLoadStoreSpec,
    HostOffloadingManager,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
)

__all__ = ["MEDIUM_CPU", "HostLoadStoreSpec", "HostOffloadingManager", "OffloadKey",
           "OffloadingManager", "PrepareStoreOutput"]
