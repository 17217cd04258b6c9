"""An offline Hugging Face cache for vLLM's unit tests: ``config.json`` and a tiny tokenizer
for each model name the conformance files use, generated here (nothing comes from the hub).

    python -m kvcore_pytest.vllm_conformance.hf_cache HF_HOME_DIR

writes ``HF_HOME_DIR/hub/models--ORG--NAME/{refs/main,snapshots/REV/...}``, the layout
``huggingface_hub`` reads with ``HF_HOME=HF_HOME_DIR HF_HUB_OFFLINE=1``.  The configs come from
``transformers``' config classes with the published models' shapes (layers, heads, head size,
context length, sliding windows, dtype): vLLM's scheduler tests size KV caches and cap prompt
lengths from them.  Each config names its ``dtype``, as the published ones do, so vLLM does not
ask the hub for safetensors headers (which, offline, costs a 2-second retry per config).

The tokenizer is a word-level one over a few hundred made-up words (``tokenizers``), enough
for vLLM to load one; no weights are written, so a test that runs a model still fails (in
both runs: the comparison does not count it).  Runs in a vLLM venv (needs ``transformers``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One fixed revision for every generated snapshot (refs/main points at it).
REVISION = "0" * 39 + "1"


def _opt(**shape: Any) -> Any:
    from transformers import OPTConfig

    return OPTConfig(architectures=["OPTForCausalLM"], dtype="float16", **shape)


def _llama_3_2_1b() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"], dtype="bfloat16", vocab_size=128256,
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})


def _llava_1_5_7b() -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, dtype="float16")
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14,
                              projection_dim=768)
    return LlavaConfig(architectures=["LlavaForConditionalGeneration"], dtype="float16",
                       text_config=text, vision_config=vision, image_token_index=32000,
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       projector_hidden_act="gelu")


def _qwen3_0_6b() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"], dtype="bfloat16", vocab_size=151936,
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _gemma_3_1b() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"], dtype="bfloat16", vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
        sliding_window=512, query_pre_attn_scalar=256,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                     for i in range(26)],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def _qwen2_5_vl_3b() -> Any:
    from transformers import Qwen2_5_VLConfig

    text = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
            "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
            "max_position_embeddings": 128000, "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [16, 24, 24]}}
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
              "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [7, 15, 23, 31]}
    return Qwen2_5_VLConfig(architectures=["Qwen2_5_VLForConditionalGeneration"],
                            dtype="bfloat16", text_config=text, vision_config=vision,
                            tie_word_embeddings=True)


def _mamba(**shape: Any) -> Any:
    from transformers import MambaConfig

    return MambaConfig(architectures=["MambaForCausalLM"], dtype="float32", vocab_size=50280,
                       state_size=16, expand=2, conv_kernel=4, **shape)


def _falcon_h1_0_5b() -> Any:
    from transformers import FalconH1Config

    return FalconH1Config(
        architectures=["FalconH1ForCausalLM"], dtype="bfloat16", vocab_size=32784,
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=36, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=16384,
        mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=128)


def _qwen3_next_80b() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"], dtype="bfloat16", vocab_size=151936,
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, max_position_embeddings=262144,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(48)],
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512)


# Model name -> its config (the names vLLM's conformance files pass as ``model=``).
MODELS: dict[str, Callable[[], Any]] = {
    "facebook/opt-125m": lambda: _opt(),
    "facebook/opt-350m": lambda: _opt(hidden_size=1024, num_hidden_layers=24, ffn_dim=4096,
                                      num_attention_heads=16, word_embed_proj_dim=512,
                                      do_layer_norm_before=False),
    "meta-llama/Llama-3.2-1B-Instruct": _llama_3_2_1b,
    "llava-hf/llava-1.5-7b-hf": _llava_1_5_7b,
    "Qwen/Qwen3-0.6B": _qwen3_0_6b,
    "google/gemma-3-1b-it": _gemma_3_1b,
    "Qwen/Qwen2.5-VL-3B-Instruct": _qwen2_5_vl_3b,
    "state-spaces/mamba-130m-hf": lambda: _mamba(hidden_size=768, num_hidden_layers=24),
    "state-spaces/mamba-1.4b-hf": lambda: _mamba(hidden_size=2048, num_hidden_layers=48),
    "tiiuae/Falcon-H1-0.5B-Instruct": _falcon_h1_0_5b,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": _qwen3_next_80b,
}


def _tokenizer_files(snapshot: Path) -> None:
    """A word-level tokenizer: ``<unk> <s> </s> <pad>`` and 508 made-up words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", "<pad>"])}
    for i in range(508):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 1 << 20}, indent=2))


def build(hf_home: Path) -> int:
    """Write every model's snapshot under ``hf_home/hub``; return how many."""
    hub = hf_home / "hub"
    for name, make_config in MODELS.items():
        repo = hub / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION)
        make_config().save_pretrained(snapshot)
        _tokenizer_files(snapshot)
    return len(MODELS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_home", type=Path, help="the HF_HOME to write (replaced)")
    args = parser.parse_args(argv)
    hf_home: Path = args.hf_home
    import transformers

    # Rebuilt when this generator or transformers (which writes the files) changes.
    stamp = hf_home / ".kvcore-hf-cache"
    want = f"{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()} {transformers.__version__}"
    if stamp.is_file() and stamp.read_text() == want:
        print(f"offline HF cache already at {hf_home}")
        return 0
    if hf_home.exists():
        shutil.rmtree(hf_home)
    n = build(hf_home)
    stamp.write_text(want)
    print(f"offline HF cache at {hf_home}: {n} model configs with a tiny tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
