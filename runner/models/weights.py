"""Loading checkpoint tensors (Hugging Face names) into :class:`DecoderForCausalLM`.

q/k/v projections are fused into ``qkv_proj`` and gate/up into ``gate_up_proj``; every tensor
is sliced for this rank by the layer's ``load``.  Sources: a local folder of ``*.safetensors``
files (sharded checkpoints included), a ``transformers`` model, or any ``(name, tensor)``
iterable.  A checkpoint without ``lm_head.weight`` uses the tied embeddings.  Multimodal Gemma-3
checkpoints (``Gemma3ForConditionalGeneration``) load their language model: its tensors are
renamed to the text model's names and the vision tower's are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from runner.models.decoder import DecoderForCausalLM

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
# Multimodal checkpoints: (prefix, replacement) for the language model (transformers 5 names,
# then 4.x names), and the prefixes of the parts the runner does not run.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")


def text_model_name(name: str) -> str | None:
    """``name`` as the text model calls it; ``None`` for a tensor of a multimodal checkpoint's
    vision side."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:
        yield from load_file(str(f)).items()


def load_weights(model: DecoderForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy checkpoint tensors into ``model`` (this rank's shards); returns the names used.

    Raises ``ValueError`` for a tensor the model has no place for, and for model parameters the
    checkpoint did not provide.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = text_model_name(ckpt_name)
        if name is None:
            continue
        if name.startswith("model.") is False and name != "lm_head.weight":
            name = "model." + name
        m = _LAYER.match(name)
        if m is not None:
            layer, block, proj, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            module = getattr(model.decoder_layers[layer], block)
            if proj in _FUSED:
                fused, part = _FUSED[proj]
                getattr(module, fused).load(tensor, part, is_bias=kind == "bias")
                loaded.add(f"layers.{layer}.{block}.{fused}.{kind}")
                continue
            if proj in ("o_proj", "down_proj"):
                getattr(module, proj).load(tensor, 0, is_bias=kind == "bias")
                loaded.add(f"layers.{layer}.{block}.{proj}.{kind}")
                continue
        target = name.removeprefix("model.")
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        if target not in params:
            if "rotary_emb" in name:
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        with torch.no_grad():
            params[target].copy_(tensor)
        loaded.add(target)
    missing = {n for n in params if n not in loaded}
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. "
                         f"{sorted(missing)[:4]}")
    return loaded


def hf_state_items(hf_model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A ``transformers`` model's parameters under checkpoint names."""
    yield from hf_model.state_dict().items()
