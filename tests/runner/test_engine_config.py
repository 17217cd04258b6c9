"""A bad engine setting is refused, naming the field and the value, before anything is built.

``EngineConfig`` checks every field when it is made; ``LLM`` checks what needs the model
(``max_model_len`` against its positions, tensor-parallel divisibility) before it spawns a
worker or builds a layer; a tensor-parallel engine that fails to start leaves no worker and no
process group behind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import transformers

import runner.engine as engine
import runner.ranks as ranks
from kvcore.errors import InvalidArgumentError
from runner.config import EngineConfig
from runner.engine import LLM

BAD: list[tuple[dict[str, Any], str]] = [
    ({"backend": "cuda_magic"}, "cuda_magic"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"num_blocks": 1}, "num_blocks"),
    ({"num_blocks": -5}, "num_blocks"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization"),
    ({"kv_cache_memory_bytes": -1}, "kv_cache_memory_bytes"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 0}, "max_model_len"),  # not "use the default"
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"dtype": "float32"}, "dtype"),
    ({"dtype": torch.int8}, "dtype"),
    ({"device": "tpu"}, "tpu"),
    ({"device": 3}, "device"),
    ({"seed": "x"}, "seed"),
    ({"enforce_eager": 1}, "enforce_eager"),
    ({"max_graph_batch_size": 0}, "max_graph_batch_size"),
    ({"host_kv_blocks": -1}, "host_kv_blocks"),
    ({"host_kv_policy": "bogus"}, "bogus"),
    ({"host_kv_policy": "slru:protected_share"}, "protected_share"),
    ({"async_scheduling": "on"}, "async_scheduling"),
    ({"async_scheduling": True, "tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"async_scheduling": True, "host_kv_blocks": 8}, "host_kv_blocks=8"),
    ({"host_kv_blocks": 8, "tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"cpu_threads": 0}, "cpu_threads"),
    ({"cpu_threads": 1.5}, "cpu_threads"),
]


def config(**kw: Any) -> transformers.LlamaConfig:
    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    return transformers.LlamaConfig(**{**args, **kw})


@pytest.mark.parametrize("kw,named", BAD, ids=[repr(k) for k, _ in BAD])
def test_bad_setting_is_refused_before_anything_is_built(
        kw: dict[str, Any], named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgumentError, match=named.replace("[", r"\[")):
        EngineConfig(**kw)

    def never(*args: Any) -> Any:
        raise AssertionError("a model was built for a refused config")

    monkeypatch.setattr(engine, "_build_runner", never)
    monkeypatch.setattr(ranks.mp, "get_context", never)
    with pytest.raises(InvalidArgumentError, match=named.replace("[", r"\[")):
        LLM(config(), **kw)


def test_good_settings_are_kept() -> None:
    c = EngineConfig(backend="triton", num_blocks=2, gpu_memory_utilization=1, max_model_len=64,
                     dtype=torch.bfloat16, device="cuda:1", seed=0, host_kv_blocks=4,
                     host_kv_policy="slru:protected_share=0.7", async_scheduling=None)
    assert (c.num_blocks, c.max_model_len, c.device, c.host_kv_policy) == \
        (2, 64, "cuda:1", "slru:protected_share=0.7")
    assert not c.use_async_scheduling  # the host tier runs synchronously
    assert EngineConfig().use_async_scheduling
    assert not EngineConfig(async_scheduling=False).use_async_scheduling
    assert not EngineConfig(tensor_parallel_size=2).use_async_scheduling


@pytest.mark.parametrize("kw,hf,named", [
    ({"max_model_len": 257}, {}, "max_model_len=257"),
    ({"tensor_parallel_size": 3}, {}, "num_attention_heads=4"),
    ({"tensor_parallel_size": 4}, {}, "num_key_value_heads=2"),
    ({"tensor_parallel_size": 2}, {"intermediate_size": 99}, "intermediate_size=99"),
])
def test_settings_that_do_not_fit_the_model_are_refused_before_spawning(
        kw: dict[str, Any], hf: dict[str, Any], named: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any) -> Any:
        raise AssertionError("started building a refused engine")

    monkeypatch.setattr(engine, "_build_runner", never)
    monkeypatch.setattr(ranks.mp, "get_context", never)
    with pytest.raises(InvalidArgumentError, match=named):
        LLM(config(**hf), device="cpu", **kw)


def test_max_model_len_defaults_to_the_models_positions_capped() -> None:
    assert EngineConfig().max_model_len_for(config()) == 256
    assert EngineConfig().max_model_len_for(config(max_position_embeddings=131072)) == 8192
    assert EngineConfig(max_model_len=100).max_model_len_for(config()) == 100


def test_tensor_parallel_engine_that_fails_to_start_leaves_nothing_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 fails to build its shard after the worker has joined the group (the worker builds
    # its own and waits for a forward): the worker is terminated, the group destroyed, and the
    # next engine in this process starts normally.
    spawned: list[Any] = []
    real_context = ranks.mp.get_context

    def context(method: str) -> Any:
        ctx = real_context(method)

        class Recording:
            def Process(self, **kw: Any) -> Any:
                proc = ctx.Process(**kw)
                spawned.append(proc)
                return proc

        return Recording()

    def fail(*args: Any) -> Any:
        raise RuntimeError("rank 0 could not build its shard")

    monkeypatch.setattr(ranks.mp, "get_context", context)
    monkeypatch.setattr(engine, "_build_runner", fail)
    with pytest.raises(RuntimeError, match="could not build") as failure:
        LLM(config(), device="cpu", num_blocks=16, block_size=4, tensor_parallel_size=2)
    # ``failure`` holds the traceback, so the half-built engine is not collected (its
    # ``__del__`` would close it too): the cleanup happened in the constructor.
    assert failure.traceback and len(spawned) == 1 and not spawned[0].is_alive()
    assert not dist.is_initialized()
    monkeypatch.undo()
    llm = LLM(config(), device="cpu", num_blocks=16, block_size=4, max_model_len=32)
    assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids) > 0
