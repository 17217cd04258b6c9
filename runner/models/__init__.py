"""Model registry: ``build_model`` (random or from a checkpoint) for the supported architectures."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch

from runner.distributed import NO_TP, TPGroup
from runner.layers.linear import ColumnParallelLinear
from runner.models.decoder import DecoderForCausalLM, layer_windows, text_config
from runner.models.weights import iter_safetensors, load_weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
"""Language models we implement; a multimodal ``gemma3`` config is accepted for its
``text_config`` (``gemma3_text``)."""


def load_config(model: str | Path | Any) -> Any:
    """A ``transformers`` config from a local folder (``config.json``) or a config object; for
    a multimodal wrapper (``gemma3``), its language model's ``text_config``."""
    if isinstance(model, (str, Path)):
        import transformers

        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (only local model folders are "
                                    "supported: there is no model hub access)")
        model = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    return text_config(model)


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
    cfg = text_config(cfg)
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
    """A TP=1 model's weights under checkpoint (Hugging Face) names: the fused projections are
    split back into q/k/v and gate/up; every other parameter keeps its name under ``model.``."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        prefix, _, leaf = owner.rpartition(".")
        if leaf in fused:
            parts = param.split(cast(ColumnParallelLinear, modules[owner]).local_parts)
            for ckpt_name, part in zip(fused[leaf], parts):
                yield f"model.{prefix}.{ckpt_name}.{kind}", part
        elif name == "lm_head.weight":
            yield name, param
        else:
            yield f"model.{name}", param


__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderForCausalLM", "build_model", "checkpoint_items",
           "layer_windows", "load_config", "load_model", "load_weights", "text_config"]
