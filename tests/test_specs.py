"""Specs, groups, memory sizing, and KV-cache configs built from transformers configs."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvcore.errors import InvalidArgumentError
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
    group_layers,
    kv_cache_config_from_hf,
    num_blocks_for_memory,
)

COMMON = dict(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)


def full(bs: int = 16, dtype: torch.dtype = torch.float16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=dtype)


def test_page_sizes() -> None:
    assert full().page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert full(dtype=torch.float32).page_size_bytes == 2 * 16 * 8 * 128 * 4
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=4096)
    assert swa.page_size_bytes == full().page_size_bytes
    mamba = MambaSpec(block_size=16, shapes=((4, 32), (8, 64, 16)),
                      dtypes=(torch.float16, torch.float32))
    assert mamba.page_size_bytes == 4 * 32 * 2 + 8 * 64 * 16 * 4


def test_max_memory_usage() -> None:
    page = full().page_size_bytes
    assert full().max_memory_usage_bytes(1000) == 63 * page
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=128)
    # window - 1 + one step of 256 tokens, +1 for a window not starting on a block boundary
    assert swa.max_blocks_per_request(8192, 256) == -(-(127 + 256) // 16) + 1
    assert swa.max_blocks_per_request(100, 256) == -(-100 // 16) + 1
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                        attention_chunk_size=512)
    assert chunked.max_blocks_per_request(8192, 256) == 48
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    assert cross.max_memory_usage_bytes(1500) == 94 * page and not cross.cacheable


@pytest.mark.parametrize("kwargs", [
    dict(block_size=0, num_kv_heads=1, head_size=1),
    dict(block_size=16, num_kv_heads=-1, head_size=1),
    dict(block_size=16, num_kv_heads=1, head_size=1, dtype="fp16"),
])
def test_bad_specs(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgumentError):
        FullAttentionSpec(**kwargs)
    with pytest.raises(InvalidArgumentError):
        SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, sliding_window=0)


def test_config_validation_and_granularity() -> None:
    g = KVCacheGroup(("a",), full(16))
    with pytest.raises(InvalidArgumentError):
        KVCacheConfig(num_blocks=1, groups=(g,))
    with pytest.raises(InvalidArgumentError):
        KVCacheConfig(num_blocks=10, groups=())
    with pytest.raises(InvalidArgumentError):
        KVCacheGroup((), full())
    cfg = KVCacheConfig(10, (g, KVCacheGroup(("b",), full(24))))
    assert cfg.hash_block_size == 8 and cfg.alignment_tokens == 48


def test_group_layers_equal_sizes_with_padding() -> None:
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=512)
    layers = [(f"l{i}", full() if i % 6 == 5 else swa) for i in range(36)]  # 30 sliding + 6 full
    groups = group_layers(layers)
    assert [len(g.layer_names) for g in groups] == [6] * 6
    assert sum(isinstance(g.spec, FullAttentionSpec) for g in groups) == 1
    assert groups[-1].layer_names == ("l5", "l11", "l17", "l23", "l29", "l35")
    odd = group_layers([(f"l{i}", full() if i in (5, 11) else swa) for i in range(13)])
    assert [len(g.layer_names) for g in odd] == [2, 2, 2, 2, 2, 1, 2]


def test_num_blocks_for_memory() -> None:
    groups = group_layers([(f"l{i}", full()) for i in range(4)])
    per_block = 4 * full().page_size_bytes
    assert num_blocks_for_memory(groups, 100 * per_block + 5) == 100
    with pytest.raises(InvalidArgumentError):
        num_blocks_for_memory(groups, per_block)


def _specs(cfg: KVCacheConfig) -> list[str]:
    return [type(g.spec).__name__ for g in cfg.groups]


def test_llama_is_one_full_group() -> None:
    cfg = kv_cache_config_from_hf(transformers.LlamaConfig(**COMMON), block_size=16, num_blocks=64)
    assert _specs(cfg) == ["FullAttentionSpec"] and len(cfg.groups[0].layer_names) == 8
    spec = cfg.groups[0].spec
    assert (spec.num_kv_heads, spec.head_size, spec.block_size) == (2, 16, 16)
    assert spec.dtype == torch.bfloat16  # config has no dtype: bf16 default


def test_qwen2_sliding_layers_from_max_window_layers() -> None:
    c = transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=64,
                                 max_window_layers=4)
    cfg = kv_cache_config_from_hf(c, num_blocks=64, dtype=torch.float16)
    assert _specs(cfg) == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert [len(g.layer_names) for g in cfg.groups] == [4, 4]
    assert cfg.groups[1].spec.sliding_window == 64  # type: ignore[attr-defined]
    assert cfg.groups[0].spec.dtype == torch.float16


def test_qwen3_full_attention_with_explicit_head_dim() -> None:
    cfg = kv_cache_config_from_hf(transformers.Qwen3Config(**COMMON, head_dim=32), num_blocks=64)
    assert _specs(cfg) == ["FullAttentionSpec"] and cfg.groups[0].spec.head_size == 32


def test_mistral_all_sliding() -> None:
    cfg = kv_cache_config_from_hf(transformers.MistralConfig(**COMMON, sliding_window=128),
                                  num_blocks=64)
    assert _specs(cfg) == ["SlidingWindowSpec"]
    no_window = kv_cache_config_from_hf(transformers.MistralConfig(**COMMON, sliding_window=None),
                                        num_blocks=64)
    assert _specs(no_window) == ["FullAttentionSpec"]


def test_gemma2_alternating() -> None:
    cfg = kv_cache_config_from_hf(transformers.Gemma2Config(**COMMON, sliding_window=64),
                                  num_blocks=64)
    assert _specs(cfg) == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert cfg.groups[0].layer_names[:2] == ("model.layers.0.self_attn", "model.layers.2.self_attn")


def test_gemma3_five_to_one_pattern() -> None:
    c = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 12}, sliding_window=64)
    cfg = kv_cache_config_from_hf(c, num_blocks=64)
    assert [len(g.layer_names) for g in cfg.groups] == [2] * 6
    assert _specs(cfg).count("FullAttentionSpec") == 1
    assert cfg.groups[-1].layer_names == ("model.layers.5.self_attn", "model.layers.11.self_attn")


def test_gpt_oss_alternating_128() -> None:
    cfg = kv_cache_config_from_hf(transformers.GptOssConfig(**COMMON, sliding_window=128),
                                  num_blocks=64)
    assert _specs(cfg) == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert cfg.groups[0].spec.sliding_window == 128  # type: ignore[attr-defined]


def test_from_hf_memory_budget_and_errors() -> None:
    c = transformers.LlamaConfig(**COMMON)
    cfg = kv_cache_config_from_hf(c, block_size=16, memory_bytes=10 << 20, dtype=torch.float16)
    per_block = 8 * 2 * 16 * 2 * 16 * 2
    assert cfg.num_blocks == (10 << 20) // per_block
    with pytest.raises(InvalidArgumentError, match="num_blocks or memory_bytes"):
        kv_cache_config_from_hf(c)
    bad = transformers.LlamaConfig(**COMMON)
    bad.layer_types = ["weird_attention"] * 8
    with pytest.raises(InvalidArgumentError, match="weird_attention"):
        kv_cache_config_from_hf(bad, num_blocks=10)


def test_from_hf_config_drives_a_manager() -> None:
    from kvcore.manager import KVCacheManager

    cfg = kv_cache_config_from_hf(transformers.Gemma2Config(**COMMON, sliding_window=16),
                                  block_size=4, num_blocks=64)
    m = KVCacheManager(cfg, 256)
    r = m.make_request("a", range(40))
    assert m.allocate_slots(r, 40) is not None
    assert [len(x) for x in m.get_block_ids("a")] == [10, 10]
    m.check_invariants()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(mamba_cache_mode="all"), "mamba_cache_mode"),
    (dict(mamba_cache_mode="align", num_prefill_checkpoint_blocks=2), "0 or 1"),
    (dict(mamba_cache_mode="align", num_prefill_checkpoint_blocks=True), "0 or 1"),
    (dict(num_prefill_checkpoint_blocks=1), "needs mamba_cache_mode 'align'"),
    (dict(mamba_cache_mode="align", prefill_checkpoint_alignment=0),
     "prefill_checkpoint_alignment"),
])
def test_bad_mamba_specs_name_the_value(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgumentError, match=match):
        MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,), **kwargs)


def test_mamba_align_holds_at_most_three_state_blocks_and_takes_sparse_retention() -> None:
    align = MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,),
                      mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                      prefill_checkpoint_alignment=1)
    assert align.max_blocks_per_request(4096, 512) == 3
    assert MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,)
                     ).max_blocks_per_request(4096, 512) == 33
    KVCacheConfig(8, (KVCacheGroup(("m",), align),), prefix_cache_retention_interval=0)
    none = MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(torch.float32,))
    with pytest.raises(InvalidArgumentError, match="outside 'align' mode"):
        KVCacheConfig(8, (KVCacheGroup(("m",), none),), prefix_cache_retention_interval=0)


def test_prefix_match_unit_sets_the_hash_granularity() -> None:
    """vLLM's prefix_match_unit: hashes every unit (it must divide every prefix-cacheable
    group's block size); hits stay on the hit alignment, finer units or not."""

    def config(*specs: FullAttentionSpec | SlidingWindowSpec | MambaSpec,
               unit: object) -> KVCacheConfig:
        return KVCacheConfig(8, tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs)),
                             None, unit)  # type: ignore[arg-type]  # bad units on purpose

    full8 = full(8)
    swa4 = SlidingWindowSpec(block_size=4, num_kv_heads=8, head_size=128, sliding_window=8)
    assert config(full8, swa4, unit=None).hash_block_size == 4
    assert config(full8, swa4, unit=2).hash_block_size == 2
    assert config(full8, swa4, unit=2).alignment_tokens == 8  # hits stay on block boundaries
    for bad in (0, -2, 2.0, True, "2"):
        with pytest.raises(InvalidArgumentError, match="prefix_match_unit must be None or a "
                                                       "positive int"):
            config(full8, unit=bad)
    assert config(full8, unit=8).hash_block_size == 8
    with pytest.raises(InvalidArgumentError, match="with a single KV-cache group hits land on "
                                                   r"its block size \(8 tokens\)"):
        config(full8, unit=2)  # kvcore's one-group lookup reads one hash per block, as vLLM's
    with pytest.raises(InvalidArgumentError, match="must divide every prefix-cacheable group's "
                                                   r"block size, got \[8, 4\]"):
        config(full8, swa4, unit=8)
    mamba = MambaSpec(block_size=8, shapes=((2,),), dtypes=(torch.float32,),
                      mamba_cache_mode="align")
    assert config(full8, mamba, unit=4).hash_block_size == 4
    assert config(full8, mamba, unit=4).alignment_tokens == 8  # no partial-block hits
