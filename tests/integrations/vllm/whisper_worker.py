"""A tiny Whisper through vLLM's engine, stock and with kvcore, run as a script by
test_engine_whisper.py: ``whisper_worker.py DIR OUT`` writes the model to DIR — random weights
of a ``transformers`` ``WhisperConfig`` (1 encoder and 1 decoder layer, d_model 64, Whisper's
80 mel bins and 1,500 encoder positions) and an offline byte-level BPE tokenizer made here (the
256 byte symbols, no merges, Whisper's special tokens) — then runs the workload on a stock
engine and on one with kvcore's ``Scheduler`` (invariants checked every step), one after the
other in this process (unlike engine_worker.py's engines, these two coexist in one process:
it saves the second start), and writes each one's greedy output ids, cached-token counts,
preemptions, classes and whether prefix caching was on to OUT.

The workload: 3 s of synthetic audio per request (a different chord each), decoder prompts of
Whisper's task tokens plus 0-40 byte tokens, 48 new tokens each, in a pool that holds two
requests' encoder tables (47 blocks of 32 each) and not their whole decodes: requests queue for
the pool and running ones are preempted.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.integrations.vllm.engine_probe import count_preemptions

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>",
            "<|translate|>", "<|notimestamps|>"]
BLOCK_SIZE = 32
NUM_BLOCKS = 100  # 99 usable: two encoder tables (2 x 47) and 5 decoder blocks


def build(path: Path) -> None:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    path.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([], vocab_size=256, min_frequency=1, show_progress=False,
                            special_tokens=[])
    bpe.save_model(str(path))  # vocab.json: the 256 byte symbols; merges.txt: none
    tok = WhisperTokenizer(str(path / "vocab.json"), str(path / "merges.txt"),
                           unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                           eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    ids = tok.convert_tokens_to_ids(SPECIALS)
    processor = WhisperProcessor(WhisperFeatureExtractor(feature_size=80), tok)
    processor.save_pretrained(path)
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=448,
        pad_token_id=ids[0], bos_token_id=ids[0], eos_token_id=ids[0],
        decoder_start_token_id=ids[1], suppress_tokens=[], begin_suppress_tokens=[])
    torch.manual_seed(0)
    WhisperForConditionalGeneration(config).save_pretrained(path)


def requests(tok: Any) -> list[dict[str, Any]]:
    import numpy as np

    task = tok.convert_tokens_to_ids(SPECIALS[1:4] + SPECIALS[5:])  # sot, en, transcribe, nots
    t = np.arange(3 * 16000) / 16000
    out = []
    for i in range(6):
        audio = sum(np.sin(2 * np.pi * f * t) for f in (220 * (i + 1), 330 + 50 * i)) * 0.3
        text = list(range(40, 40 + 8 * i))  # 0-40 byte tokens after the task tokens
        out.append({"encoder_prompt": {"prompt": "",
                                       "multi_modal_data": {"audio": (audio, 16000)}},
                    "decoder_prompt": {"prompt_token_ids": task + text}})
    return out


def run(model: str, kvcore: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if kvcore:
        kw["scheduler_cls"] = "kvcore.integrations.vllm.Scheduler"
        kw["additional_config"] = {"kvcore": {"check_invariants_every": 1}}

    from transformers import WhisperTokenizer
    from vllm import LLM, SamplingParams

    # vLLM's defaults for encoder-decoder models: no prefix caching, no chunked prefill.
    llm = LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS,
              max_model_len=448, max_num_batched_tokens=1500, max_num_seqs=4,
              dtype="float32", seed=0, gpu_memory_utilization=0.2,
              limit_mm_per_prompt={"audio": 1}, enforce_eager=True, **kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    preempted = count_preemptions(sched)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    results = llm.generate(requests(WhisperTokenizer.from_pretrained(model)), greedy,
                           use_tqdm=False)
    out = {"outputs": [list(r.outputs[0].token_ids) for r in results],
           "cached_tokens": [r.num_cached_tokens or 0 for r in results],
           "preempted": len(preempted), "scheduler": type(sched).__name__,
           "manager": type(sched.kv_cache_manager).__name__,
           "caching": sched.cache_config.enable_prefix_caching}
    del llm, sched
    gc.collect()
    return out


def main() -> None:
    model = Path(sys.argv[1])
    build(model)
    os.environ["VLLM_PLUGINS"] = ""  # kvcore comes in only through scheduler_cls
    results = {"stock": run(str(model), False), "kvcore": run(str(model), True)}
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
