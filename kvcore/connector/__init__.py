"""KV connectors (vLLM v1's connector API): move KV between the device cache and other tiers."""

from kvcore.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvcore.connector.offloading import (
    InstantTransfer,
    OffloadingConnector,
    OffloadingMetadata,
    TransferHandler,
    TransferSpec,
)

__all__ = ["InstantTransfer", "KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorRole", "OffloadingConnector", "OffloadingMetadata", "TransferHandler",
           "TransferSpec"]
