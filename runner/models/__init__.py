"""Model registry: ``build_model`` (random or from a checkpoint) for the supported architectures."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from runner.distributed import NO_TP, TPGroup
from runner.models.decoder import DecoderForCausalLM, layer_windows
from runner.models.weights import iter_safetensors, load_weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def load_config(model: str | Path | Any) -> Any:
    """A ``transformers`` config from a local folder (``config.json``) or a config object."""
    if isinstance(model, (str, Path)):
        import transformers

        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (only local model folders are "
                                    "supported: there is no model hub access)")
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    return model


def build_model(cfg: Any, *, tp: TPGroup = NO_TP, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", layer_to_kv_group: list[int] | None = None,
                max_positions: int | None = None,
                weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                seed: int = 0) -> DecoderForCausalLM:
    """Instantiate our implementation of ``cfg``'s architecture.

    With ``weights`` (checkpoint-named full tensors) each rank loads its shards; without, weights
    are random but identical for every tensor-parallel size: the full model is initialised from
    ``seed`` and each rank keeps its slices.
    """
    model_type = getattr(cfg, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if weights is None and tp.world_size > 1:
        full = build_model(cfg, dtype=torch.float32, max_positions=max_positions, seed=seed,
                           layer_to_kv_group=layer_to_kv_group)
        weights = list(checkpoint_items(full))
    if weights is None:
        torch.manual_seed(seed)
    model = DecoderForCausalLM(cfg, tp=tp, layer_to_kv_group=layer_to_kv_group,
                               max_positions=max_positions)
    if weights is not None:
        load_weights(model, weights)
    return model.to(device=device, dtype=dtype).eval()


def load_model(model_dir: str | Path, **kwargs: Any) -> DecoderForCausalLM:
    """``build_model`` with the weights of a local safetensors folder."""
    return build_model(load_config(model_dir), weights=iter_safetensors(model_dir), **kwargs)


def checkpoint_items(model: DecoderForCausalLM) -> Iterable[tuple[str, torch.Tensor]]:
    """A TP=1 model's weights under checkpoint (Hugging Face) names."""
    cfg = model.config
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.qkv_proj.weight.split(attn.qkv_proj.local_parts)
        yield from ((f"{p}.self_attn.q_proj.weight", q), (f"{p}.self_attn.k_proj.weight", k),
                    (f"{p}.self_attn.v_proj.weight", v))
        if attn.qkv_proj.bias is not None:
            qb, kb, vb = attn.qkv_proj.bias.split(attn.qkv_proj.local_parts)
            yield from ((f"{p}.self_attn.q_proj.bias", qb), (f"{p}.self_attn.k_proj.bias", kb),
                        (f"{p}.self_attn.v_proj.bias", vb))
        yield f"{p}.self_attn.o_proj.weight", attn.o_proj.weight
        if attn.o_proj.bias is not None:
            yield f"{p}.self_attn.o_proj.bias", attn.o_proj.bias
        if attn.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", attn.q_norm.weight
            yield f"{p}.self_attn.k_norm.weight", attn.k_norm.weight
        gate, up = mlp.gate_up_proj.weight.split(mlp.gate_up_proj.local_parts)
        yield f"{p}.mlp.gate_proj.weight", gate
        yield f"{p}.mlp.up_proj.weight", up
        yield f"{p}.mlp.down_proj.weight", mlp.down_proj.weight
        yield f"{p}.input_layernorm.weight", layer.input_layernorm.weight
        yield f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight
    yield "model.embed_tokens.weight", model.embed_tokens.weight
    yield "model.norm.weight", model.norm.weight
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head.weight
    del cfg


__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderForCausalLM", "build_model", "checkpoint_items",
           "layer_windows", "load_config", "load_model", "load_weights"]
