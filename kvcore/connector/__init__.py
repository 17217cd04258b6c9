"""KV connectors (vLLM v1's connector API): move KV between the device cache and other tiers.

:mod:`~kvcore.connector.base` is the interface (and the per-step metadata's base class),
:mod:`~kvcore.connector.offloading` the offloading connector, and
:mod:`~kvcore.connector.host_tier` the host-memory tier it manages (:class:`HostOffloadingManager`).
"""

from kvcore.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvcore.connector.host_tier import HostOffloadingManager, OffloadKey
from kvcore.connector.offloading import (
    InstantTransfer,
    OffloadingConnector,
    OffloadingMetadata,
    TransferHandler,
    TransferSpec,
)

__all__ = ["HostOffloadingManager", "InstantTransfer", "KVConnectorBase", "KVConnectorMetadata",
           "KVConnectorOutput", "KVConnectorRole", "OffloadKey", "OffloadingConnector",
           "OffloadingMetadata", "TransferHandler", "TransferSpec"]
