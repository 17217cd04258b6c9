"""One decoder-only transformer for the Llama family: Llama, Mistral, Qwen2 and Qwen3.

The architectures differ in a few switches, read from the ``transformers`` config:

==========  ==========  ===========  ==========================================
model       qkv bias    q/k norm     sliding window
==========  ==========  ===========  ==========================================
llama       attention_bias          none unless ``layer_types`` says so
mistral     attention_bias          ``sliding_window`` on every layer
qwen2       always      no          ``layer_types`` (use_sliding_window)
qwen3       attention_bias  yes      ``layer_types``
==========  ==========  ===========  ==========================================

Attention goes through an :class:`~runner.attention.base.AttentionBackend` over paged KV
memory; each layer passes its KV-cache group and window.  Weights are sharded for tensor
parallelism by :mod:`runner.layers.linear`; embeddings and the LM head are replicated.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.specs import layer_attention_types
from runner.attention.base import AttentionBackend, AttentionMetadata
from runner.distributed import NO_TP, TPGroup
from runner.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runner.layers.norm import RMSNorm
from runner.layers.rotary import RotaryEmbedding


def rope_parameters(cfg: Any) -> dict[str, Any]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def layer_windows(cfg: Any) -> list[int | None]:
    """Each layer's sliding window (``None``: full attention)."""
    window = getattr(cfg, "sliding_window", None)
    kinds = layer_attention_types(cfg, cfg.num_hidden_layers)
    if window is None:
        if "sliding" in kinds:
            raise ValueError("config has sliding-window layers but no sliding_window")
        return [None] * len(kinds)
    return [int(window) if kind == "sliding" else None for kind in kinds]


class Attention(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, window: int | None, group_id: int,
                 max_positions: int) -> None:
        super().__init__()
        self.head_dim: int = (getattr(cfg, "head_dim", None)
                              or cfg.hidden_size // cfg.num_attention_heads)
        num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.num_heads: int = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads: int = tp.shard(num_kv, "num_key_value_heads")
        model_type = getattr(cfg, "model_type", "")
        qkv_bias = model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        o_bias = model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          num_kv, qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        o_bias, tp)
        self.qk_norm = model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(cfg),
                                      cfg.max_position_embeddings, max_positions,
                                      getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)
        self.window = window
        self.group_id = group_id
        self.scale = self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = backend.forward(q, k, v.contiguous(), kv_cache, meta, self.group_id, self.scale,
                              self.window)
        return self.o_proj(out.reshape(n, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, window: int | None, group_id: int,
                 max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: Attention = Attention(cfg, tp, window, group_id, max_positions)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP = MLP(cfg, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderForCausalLM(nn.Module):
    """``model(input_ids, positions, kv_caches, meta, backend) -> hidden``;
    ``compute_logits(hidden) -> [T, vocab]``."""

    def __init__(self, cfg: Any, *, tp: TPGroup = NO_TP, layer_to_kv_group: list[int] | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        n = cfg.num_hidden_layers
        groups = layer_to_kv_group or [0] * n
        if len(groups) != n:
            raise ValueError(f"layer_to_kv_group has {len(groups)} entries for {n} layers")
        self.layer_sliding_windows = layer_windows(cfg)
        positions = max_positions or cfg.max_position_embeddings
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, tp, self.layer_sliding_windows[i], groups[i], positions)
                  for i in range(n)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size,
                                                                       cfg.vocab_size, bias=False)
        self.num_layers: int = n
        self.head_dim: int = layers[0].self_attn.head_dim
        self.num_kv_heads_per_rank: int = layers[0].self_attn.num_kv_heads

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.decoder_layers, kv_caches):
            x = layer(positions, x, cache, meta, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head.weight)
