"""The host tier in the runner: bit-exact KV round trips through host memory, and an engine
whose evicted prefixes come back from the host tier with unchanged greedy outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcore.connector import TransferSpec
from kvcore.errors import InvalidArgumentError
from runner.engine import LLM
from runner.offload import HostKVTransfer
from tests.runner.test_engine import GREEDY, prompts, save_hf, tokens


def caches(device: str = "cpu", dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn((2, 8, 4, 2, 16), generator=g).to(dtype).to(device) for _ in range(3)]


def round_trip(device: str, dtype: torch.dtype) -> None:
    dev = caches(device, dtype)
    want = [c[:, [3, 5, 6]].clone() for c in dev]
    t = HostKVTransfer(dev, 4)
    t.store(7, TransferSpec((3, 5, 6), (2, 0, 3)))
    for _ in range(1000):  # GPU copies complete asynchronously
        stores, loads, failed = t.poll()
        if stores:
            break
    assert stores == {7} and not loads and not failed
    for c in dev:
        c[:, [3, 5, 6]] = 0  # the device blocks are reused for something else
    t.load("r", TransferSpec((1, 2, 4), (2, 0, 3)))  # back into other blocks
    t.wait_loads(["r"])
    if device != "cpu":
        torch.cuda.synchronize()
    assert t.poll()[1] == {"r"}
    for c, w in zip(dev, want, strict=True):
        assert torch.equal(c[:, [1, 2, 4]], w)  # bit for bit
    assert t.bytes_copied == 2 * 3 * 3 * want[0][:, 0].numel() * want[0].element_size()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_round_trip_through_host_memory_is_bit_exact(dtype: torch.dtype) -> None:
    round_trip("cpu", dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kv_round_trip_on_gpu_uses_pinned_memory_and_a_side_stream() -> None:
    t = HostKVTransfer(caches("cuda"), 2)
    assert t.stream is not None and all(h.is_pinned() for h in t.host_caches)
    round_trip("cuda", torch.bfloat16)


def test_transfer_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgumentError):
        HostKVTransfer(caches(), 0)
    with pytest.raises(InvalidArgumentError):
        HostKVTransfer([], 4)


def test_evicted_prefixes_come_back_from_the_host_tier(tmp_path: Path) -> None:
    save_hf("llama", tmp_path)
    system = list(range(40, 72))
    first = [system + p for p in prompts(2, seed=3)]
    flood = prompts(6, seed=4)
    again = [system + p for p in prompts(2, seed=5)]
    reference = LLM(tmp_path, block_size=4, num_blocks=512)
    want = tokens(reference.generate(first + flood + again, GREEDY, use_tqdm=False))
    llm = LLM(tmp_path, block_size=4, num_blocks=24, max_num_batched_tokens=32,
              host_kv_blocks=64)
    got = []
    for batch in (first, flood, again):  # the flood evicts the system prompt from the device
        got += tokens(llm.generate(batch, GREEDY, use_tqdm=False))
    assert got == want
    stats = llm.scheduler.stats
    assert stats.external_hit_tokens >= 2 * 28 and stats.load_failures == 0
    host = llm.scheduler.connector.host  # type: ignore[union-attr]
    assert host is not None and host.num_loaded > 0
    assert llm.manager.pool.num_free_blocks == llm.manager.config.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in host.slots)
    with pytest.raises(InvalidArgumentError, match="tensor parallelism"):
        LLM(tmp_path, block_size=4, num_blocks=24, host_kv_blocks=8, tensor_parallel_size=2)
