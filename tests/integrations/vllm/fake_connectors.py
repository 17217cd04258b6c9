"""KV connectors for the scheduler-replay tests, loaded by vLLM's connector factory from this
module (``kv_connector_module_path``).  Nothing is transferred: the replay driver reports every
load finished within the step that started it."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class ExternalPrefixConnector(KVConnectorBase_V1):
    """Claims the whole block-aligned prompt (minus the last token) as held externally for
    requests whose id starts with ``ext`` (synchronous loads) or ``async`` (asynchronous loads,
    finished by the driver); only the scheduler interface of ``KVConnectorBase_V1``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.allocations: list[tuple[str, int]] = []
        self.finished: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if not rid.startswith(("ext", "async")) or request.num_preemptions:
            return 0, False
        held = (request.num_tokens - 1) // self.block_size * self.block_size
        n = max(held - num_computed_tokens, 0)
        return n, rid.startswith("async") and n > 0

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.allocations.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        self.finished.append((request.request_id, len(block_ids)))
        return False, None

    # Worker side: never called by the scheduler replay.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError


class PoolReadingConnector(ExternalPrefixConnector):
    """Reaches into the GPU block pool, as vLLM's CPU-offload connectors do."""

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.pool = gpu_block_pool


class DivergentHitsConnector(ExternalPrefixConnector):
    """Asks for vLLM's per-group local lookup (``get_computed_blocks_for_connector``), as
    NixlConnector does; reads nothing of the pool."""

    supports_divergent_local_hybrid_hits = True
