"""NVIDIA Dynamo's standalone KV indexer as kvcore's router (optional: ``kvcore[dynamo]``).

* :mod:`~kvcore.cluster.dynamo.indexer`: the ``python -m dynamo.indexer`` process and its HTTP
  API (``DynamoIndexer``; ``DynamoUnavailableError`` names the package when it is missing).
* :mod:`~kvcore.cluster.dynamo.feed`: replicas' ZeroMQ publishers registered with it, and a
  barrier that waits until it has applied what they published (``DynamoFeed``).
* :mod:`~kvcore.cluster.dynamo.semantics`: its rules (copies, groups, orphans) applied to the
  same events, to name each disagreement with kvcore's index (``DynamoSemantics``).
* :mod:`~kvcore.cluster.dynamo.router`: ``DynamoRouter`` and its ``Disagreements``.

Importing this package never imports Dynamo: the indexer runs as a separate process.
"""

from kvcore.cluster.dynamo.feed import DynamoFeed
from kvcore.cluster.dynamo.indexer import (
    INSTALL_HINT,
    PACKAGE,
    DynamoIndexer,
    DynamoIndexerError,
    DynamoUnavailableError,
    dynamo_available,
    require_dynamo,
)
from kvcore.cluster.dynamo.router import Disagreements, DynamoRouter
from kvcore.cluster.dynamo.semantics import DynamoSemantics

__all__ = ["INSTALL_HINT", "PACKAGE", "Disagreements", "DynamoFeed", "DynamoIndexer",
           "DynamoIndexerError", "DynamoRouter", "DynamoSemantics", "DynamoUnavailableError",
           "dynamo_available", "require_dynamo"]
