"""KV-cache groups from real ``transformers`` config classes (tiny configs, no hub access).

``layer_types`` is read from the config wherever transformers provides it; configs without it
(transformers 4.45-4.52, Qwen3-MoE) take kvcore's derivation, which must give what those
versions' modeling code did.  The "legacy" cases below strip ``layer_types`` and set the fields
the older config classes had, and must give the same groups as the declaring versions.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import transformers

from kvcore.errors import InvalidArgumentError
from kvcore.specs import (
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
    kv_cache_config_from_hf,
    layer_attention_types,
)

C = dict(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
S, F, K = "sliding", "full", "chunked"


def _text(cfg: Any) -> Any:
    return getattr(cfg, "text_config", None) or cfg


def _groups(cfg: Any) -> list[tuple[str, list[int]]]:
    """(spec kind, layer indices) per group, in group order."""
    out = []
    for g in kv_cache_config_from_hf(cfg, num_blocks=64).groups:
        kind = {SlidingWindowSpec: S, ChunkedLocalAttentionSpec: K}.get(type(g.spec), F)
        out.append((kind, [int(name.split(".")[2]) for name in g.layer_names]))
    return out


FAMILIES: dict[str, tuple[Any, list[str]]] = {
    "gemma2": (lambda: transformers.Gemma2Config(**C, sliding_window=64), [S, F] * 4),
    "gemma3-text": (lambda: transformers.Gemma3TextConfig(**C, sliding_window=64),
                    [S] * 5 + [F] + [S] * 2),
    "gemma3-multimodal": (
        lambda: transformers.Gemma3Config(text_config=dict(**C, sliding_window=64)),
        [S] * 5 + [F] + [S] * 2),
    "qwen2-sliding": (lambda: transformers.Qwen2Config(**C, use_sliding_window=True,
                                                       sliding_window=64, max_window_layers=4),
                      [F] * 4 + [S] * 4),
    "qwen2-default": (lambda: transformers.Qwen2Config(**C, max_window_layers=4), [F] * 8),
    "qwen3-sliding": (lambda: transformers.Qwen3Config(**C, use_sliding_window=True,
                                                       sliding_window=64, max_window_layers=6),
                      [F] * 6 + [S] * 2),
    "mistral": (lambda: transformers.MistralConfig(**C, sliding_window=64), [S] * 8),
    "mistral-no-window": (lambda: transformers.MistralConfig(**C, sliding_window=None), [F] * 8),
    "llama": (lambda: transformers.LlamaConfig(**C), [F] * 8),
    "gpt-oss": (lambda: transformers.GptOssConfig(**C, sliding_window=64), [S, F] * 4),
    "cohere2": (lambda: transformers.Cohere2Config(**C, sliding_window=64), ([S] * 3 + [F]) * 2),
    "llama4-text": (lambda: transformers.Llama4TextConfig(**C, attention_chunk_size=128),
                    ([K] * 3 + [F]) * 2),
    "llama4-multimodal": (
        lambda: transformers.Llama4Config(text_config=dict(**C, attention_chunk_size=128)),
        ([K] * 3 + [F]) * 2),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_kinds_per_family(family: str) -> None:
    make, kinds = FAMILIES[family]
    cfg = make()
    text = _text(cfg)
    assert layer_attention_types(text, 8) == kinds
    # every layer lands in exactly one group of its kind, groups of equal size, model order kept
    groups = _groups(cfg)
    assert sorted(i for _, layers in groups for i in layers) == list(range(8))
    assert len({len(layers) for _, layers in groups}) == 1
    for kind, layers in groups:
        assert all(kinds[i] == kind for i in layers) and layers == sorted(layers)


def test_groups_of_hybrid_families() -> None:
    assert _groups(FAMILIES["gemma2"][0]()) == [(S, [0, 2, 4, 6]), (F, [1, 3, 5, 7])]
    assert _groups(FAMILIES["qwen2-sliding"][0]()) == [(F, [0, 1, 2, 3]), (S, [4, 5, 6, 7])]
    # 6 sliding + 2 full layers: groups of 2
    assert _groups(FAMILIES["cohere2"][0]()) == [(S, [0, 1]), (S, [2, 4]), (S, [5, 6]),
                                                 (F, [3, 7])]
    assert _groups(FAMILIES["llama4-multimodal"][0]()) == [(K, [0, 1]), (K, [2, 4]),
                                                           (K, [5, 6]), (F, [3, 7])]
    gemma3 = _groups(FAMILIES["gemma3-text"][0]())
    assert [kind for kind, _ in gemma3] == [S] * 7 + [F] and gemma3[-1] == (F, [5])


def test_layer_types_win_over_family_patterns() -> None:
    """A declared ``layer_types`` (e.g. from a config.json) is used as given, in any family."""
    kinds = [F, S, S, F, S, S, F, F]
    names = {F: "full_attention", S: "sliding_attention"}
    cfg = transformers.Gemma2Config(**C, sliding_window=64,
                                    layer_types=[names[k] for k in kinds])
    assert layer_attention_types(cfg, 8) == kinds
    # Qwen2-MoE declares it from transformers 5.0, with its own pattern
    qwen = transformers.Qwen2MoeConfig(**C, use_sliding_window=True, sliding_window=64,
                                       max_window_layers=6)
    declared = getattr(qwen, "layer_types", None) or []
    assert declared or transformers.__version__.startswith("4.")
    assert not declared or layer_attention_types(qwen, 8) == [
        S if t == "sliding_attention" else F for t in declared]


def _legacy(cfg: Any, **fields: Any) -> Any:
    """``cfg`` as a transformers 4.45-4.52 config class built it: no ``layer_types``."""
    text = _text(cfg)
    text.layer_types = None
    for name, value in fields.items():
        setattr(text, name, value)
    return cfg


@pytest.mark.parametrize("family, fields", [
    ("gemma2", {}),
    ("gemma3-text", {"sliding_window_pattern": 6}),
    ("gemma3-multimodal", {"sliding_window_pattern": 6}),
    ("cohere2", {"sliding_window_pattern": 4}),
    ("qwen2-sliding", {}),
    ("qwen3-sliding", {}),
    ("qwen2-default", {"sliding_window": 4096}),  # <= 4.52 kept the window, use_sliding_window off
    ("llama4-text", {}),
])
def test_configs_without_layer_types_give_the_same_groups(family: str,
                                                          fields: dict[str, Any]) -> None:
    make, kinds = FAMILIES[family]
    expected = _groups(make())
    legacy = _legacy(make(), **fields)
    assert layer_attention_types(_text(legacy), 8) == kinds
    assert _groups(legacy) == expected


def test_llama4_before_no_rope_layers() -> None:
    """transformers 4.51: no ``no_rope_layers``; every 4th layer is a full-attention NoPE layer."""
    cfg = SimpleNamespace(model_type="llama4_text", num_hidden_layers=8, num_attention_heads=4,
                          hidden_size=64, attention_chunk_size=128)
    assert layer_attention_types(cfg, 8) == ([K] * 3 + [F]) * 2
    short = SimpleNamespace(model_type="llama4_text", attention_chunk_size=128,
                            no_rope_layers=[1, 1])
    with pytest.raises(InvalidArgumentError, match="no_rope_layers"):
        layer_attention_types(short, 8)


def test_qwen3_moe_has_no_layer_types() -> None:
    cfg = transformers.Qwen3MoeConfig(**C)
    assert getattr(cfg, "layer_types", None) is None
    assert layer_attention_types(cfg, 8) == [F] * 8
