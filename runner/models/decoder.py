"""One decoder-only transformer for the Llama and Gemma families: Llama, Mistral, Qwen2, Qwen3,
Gemma-2 and Gemma-3 (text).

The architectures differ in a few switches, read from the ``transformers`` config into an
:class:`Arch` (:meth:`Arch.from_config`):

===========  ==============  ======  ========  ==========================================
model        qkv bias        q/k     Gemma     sliding window (``layer_attention_types``)
                             norm    style
===========  ==============  ======  ========  ==========================================
llama        attention_bias  no      no        none unless ``layer_types`` says so
mistral      attention_bias  no      no        ``sliding_window`` on every layer
qwen2        always          no      no        ``layer_types`` (use_sliding_window)
qwen3        attention_bias  yes     no        ``layer_types``
gemma2       attention_bias  no      yes       ``layer_types`` (alternating, sliding first)
gemma3_text  attention_bias  yes     yes       ``layer_types`` (5 sliding : 1 full)
===========  ==============  ======  ========  ==========================================

*Gemma style* is everything else Gemma changes, each switch read from the config so that a
config declaring it gets it:

* norms: :class:`~runner.layers.norm.GemmaRMSNorm` (``(1 + weight)``, all in fp32), q/k norms
  included; *sandwich* norms: the attention and MLP outputs are normed before their residual
  add (``post_attention_layernorm``, ``post_feedforward_layernorm``) and the MLP input by
  ``pre_feedforward_layernorm``;
* embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the embedding dtype, as
  transformers does);
* MLP activation ``hidden_activation`` (GeGLU, ``gelu_pytorch_tanh``) instead of SiLU;
* attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
* tanh soft-capping ``cap * tanh(x / cap)`` of attention scores (``attn_logit_softcapping``,
  passed to the backend as ``softcap=``) and of the final logits
  (``final_logit_softcapping``, in :meth:`DecoderForCausalLM.compute_logits`);
* RoPE per layer type: ``rope_parameters`` keyed by layer type (Gemma-3: local base 10k on
  sliding layers, global base 1M, possibly scaled, on full layers).

A multimodal ``gemma3`` config stands for its ``text_config`` (see :func:`text_config`).

Attention goes through an :class:`~runner.attention.base.AttentionBackend` over paged KV
memory; each layer passes its KV-cache group and window.  Weights are sharded for tensor
parallelism by :mod:`runner.layers.linear`; embeddings and the LM head are replicated.

The residual stream is carried next to the hidden states (vLLM style): a layer returns its
output and the residual separately, and the next norm adds them (``norm(x, residual) ->
(normed, x + residual)``), the final norm included.  On CUDA that add and the norm are one
Triton kernel, as are the MLP's ``act(gate) * up`` (:func:`gated_activation`) and RoPE
(:mod:`runner.kernels.fused`); elsewhere the same math runs in torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvcore.specs import layer_attention_types
from runner.attention.base import AttentionBackend, AttentionMetadata
from runner.distributed import NO_TP, TPGroup
from runner.kernels import use_fused
from runner.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runner.layers.norm import GemmaRMSNorm, RMSNorm
from runner.layers.rotary import RotaryEmbedding

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
_QK_NORM_MODEL_TYPES = ("qwen3", "gemma3_text")
_MULTIMODAL_WRAPPERS = ("gemma3",)  # configs whose text_config is the language model

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def text_config(cfg: Any) -> Any:
    """The language model's config: ``cfg`` itself, or the ``text_config`` of a multimodal
    wrapper (``gemma3``: Gemma-3 with a vision tower, of which only the text part runs here)."""
    if getattr(cfg, "model_type", "") in _MULTIMODAL_WRAPPERS:
        text = getattr(cfg, "text_config", None)
        if text is None:
            raise ValueError(f"{cfg.model_type} config has no text_config")
        if getattr(text, "dtype", None) is None and getattr(cfg, "dtype", None) is not None:
            text.dtype = cfg.dtype  # the checkpoint's dtype is often declared on the wrapper only
        return text
    return cfg


@dataclass(frozen=True)
class Arch:
    """The switches that tell the supported families apart (the module docstring's table)."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    norm: type[RMSNorm]  # RMSNorm or GemmaRMSNorm, for every norm of the model
    sandwich_norms: bool  # Gemma: norm the attention / MLP outputs and the MLP input
    embed_scale: float | None  # Gemma: embeddings * sqrt(hidden_size)
    activation: str
    query_pre_attn_scalar: float | None  # attention scale = this ** -0.5 (default: head_dim)
    attn_softcap: float | None
    final_softcap: float | None

    @classmethod
    def from_config(cls, cfg: Any) -> Arch:
        model_type = getattr(cfg, "model_type", "")
        gemma = model_type in GEMMA_MODEL_TYPES
        bias = bool(getattr(cfg, "attention_bias", False))
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention (use_bidirectional_attention) is not "
                             "supported: the runner's attention is causal")
        activation = (getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
                      or "silu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        return cls(
            qkv_bias=model_type == "qwen2" or bias,
            o_bias=model_type != "qwen2" and bias,
            qk_norm=model_type in _QK_NORM_MODEL_TYPES,
            norm=GemmaRMSNorm if gemma else RMSNorm,
            sandwich_norms=gemma,
            embed_scale=float(cfg.hidden_size) ** 0.5 if gemma else None,
            activation=activation,
            query_pre_attn_scalar=float(scalar) if scalar else None,
            attn_softcap=_optional_float(getattr(cfg, "attn_logit_softcapping", None)),
            final_softcap=_optional_float(getattr(cfg, "final_logit_softcapping", None)),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def layer_type_names(cfg: Any) -> list[str]:
    """Each layer's type as transformers names it (``sliding_attention``, ``full_attention``,
    ...): ``layer_types`` if the config declares it, else derived from kvcore's pattern."""
    n = cfg.num_hidden_layers
    kinds = layer_attention_types(cfg, n)  # validates layer_types
    declared = getattr(cfg, "layer_types", None)
    if declared:
        return [str(t) for t in declared[:n]]
    return [f"{kind}_attention" for kind in kinds]


def rope_parameters(cfg: Any, layer_type: str | None = None) -> dict[str, Any]:
    """transformers' RoPE dict for a layer of type ``layer_type``.  ``rope_parameters`` may be
    keyed by layer type (Gemma-3 under transformers 5); older Gemma-3 configs give sliding
    layers ``rope_local_base_freq`` (unscaled) and full layers ``rope_theta``/``rope_scaling``."""
    declared = dict(getattr(cfg, "rope_parameters", None) or {})
    if layer_type is not None and layer_type in declared:
        return _rope_defaults(dict(declared[layer_type] or {}), cfg)
    local_base = getattr(cfg, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local_base is not None:
        return {"rope_type": "default", "rope_theta": float(local_base)}
    legacy = getattr(cfg, "rope_scaling", None)
    if legacy and not declared.get("rope_type"):
        declared.update(legacy)
    return _rope_defaults(declared, cfg)


def _rope_defaults(params: dict[str, Any], cfg: Any) -> dict[str, Any]:
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
    def __init__(self, cfg: Any, arch: Arch, tp: TPGroup, window: int | None, group_id: int,
                 max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.head_dim: int = (getattr(cfg, "head_dim", None)
                              or cfg.hidden_size // cfg.num_attention_heads)
        num_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.num_heads: int = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads: int = tp.shard(num_kv, "num_key_value_heads")
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          num_kv, arch.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        arch.o_bias, tp)
        self.qk_norm = arch.qk_norm
        if self.qk_norm:
            self.q_norm = arch.norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = arch.norm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(cfg, layer_type),
                                      cfg.max_position_embeddings, max_positions,
                                      getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)
        self.window = window
        self.group_id = group_id
        self.scale = (arch.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = arch.attn_softcap

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
                              self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(n, q_size))


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for the gate-up projection's output ``[T, 2 * I]`` (gate first): the
    fused kernel where :func:`runner.kernels.use_fused` says so (and it has the activation),
    torch otherwise."""
    if use_fused(gate_up):
        from runner.kernels import fused

        if activation in fused.ACTIVATIONS:
            return fused.act_and_mul(gate_up, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU, or GeGLU for Gemma)."""

    def __init__(self, cfg: Any, arch: Arch, tp: TPGroup) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp)
        self.activation = arch.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.activation))


class DecoderLayer(nn.Module):
    """Pre-norm block; with ``sandwich_norms`` (Gemma) the attention and MLP outputs are normed
    too, and ``post_attention_layernorm`` is the attention *output* norm (in Llama it is the
    MLP input norm; the names are the checkpoints').

    ``layer(positions, x, kv_cache, meta, backend, residual) -> (out, residual)``: the block's
    input is ``x + residual`` (``x`` alone for the first layer, ``residual=None``), its output
    ``out + residual``; the sums are left to the next norm (see the module docstring)."""

    def __init__(self, cfg: Any, arch: Arch, tp: TPGroup, window: int | None, group_id: int,
                 max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = arch.norm(cfg.hidden_size, eps)
        self.self_attn: Attention = Attention(cfg, arch, tp, window, group_id, max_positions,
                                              layer_type)
        self.post_attention_layernorm = arch.norm(cfg.hidden_size, eps)
        self.mlp: MLP = MLP(cfg, arch, tp)
        self.sandwich_norms = arch.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = arch.norm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = arch.norm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn(positions, h, kv_cache, meta, backend)
        if not self.sandwich_norms:
            h, residual = self.post_attention_layernorm(attn, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderForCausalLM(nn.Module):
    """``model(input_ids, positions, kv_caches, meta, backend) -> hidden``;
    ``compute_logits(hidden) -> [T, vocab]``."""

    embed_scale: torch.Tensor | None

    def __init__(self, cfg: Any, *, tp: TPGroup = NO_TP, layer_to_kv_group: list[int] | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        cfg = text_config(cfg)
        self.config = cfg
        self.arch = arch = Arch.from_config(cfg)
        self.tp = tp
        n = cfg.num_hidden_layers
        groups = layer_to_kv_group or [0] * n
        if len(groups) != n:
            raise ValueError(f"layer_to_kv_group has {len(groups)} entries for {n} layers")
        self.layer_sliding_windows = layer_windows(cfg)
        layer_types = layer_type_names(cfg)
        positions = max_positions or cfg.max_position_embeddings
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # A buffer (as in transformers) so that .to(dtype) rounds it like the embeddings.
        self.register_buffer("embed_scale", None if arch.embed_scale is None
                             else torch.tensor(arch.embed_scale), persistent=False)
        layers = [DecoderLayer(cfg, arch, tp, self.layer_sliding_windows[i], groups[i], positions,
                               layer_types[i])
                  for i in range(n)]
        self.layers = nn.ModuleList(layers)
        self.norm = arch.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size,
                                                                       cfg.vocab_size, bias=False)
        self.final_softcap = arch.final_softcap
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
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.decoder_layers, kv_caches):
            x, residual = layer(positions, x, cache, meta, backend, residual)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, head.weight)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
