"""Our Llama / Qwen2 / Qwen3 / Mistral implementations against transformers' own models with the
same weights (fp32, CPU): packed prefill, incremental decode through shuffled paged blocks,
prefill after a cached prefix, tied embeddings, RoPE scaling types, safetensors loading, and
tensor parallelism (TP=2 over gloo equals TP=1)."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from runner.attention import AttentionMetadata, GroupMetadata, TorchAttentionBackend
from runner.distributed import TPGroup
from runner.models import build_model, load_model
from runner.models.weights import hf_state_items

TOL = 1e-4
BS = 4
NUM_BLOCKS = 64
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)


def hf_config(kind: str, **kw: Any) -> Any:
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[kind]
    extra: dict[str, Any] = {"qwen3": {"head_dim": 16}, "mistral": {"sliding_window": 7},
                             "qwen2": {"use_sliding_window": True, "sliding_window": 6,
                                       "max_window_layers": 1}}.get(kind, {})
    cfg = cls(**{**COMMON, **extra, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def hf_model(cfg: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().float()
    if getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2":
        with torch.no_grad():  # transformers initialises biases to 0: make them matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(std=0.1)
    return model


class Paged:
    """A tiny stand-in for the engine: per-sequence block tables over shuffled block ids."""

    def __init__(self, model: Any, seed: int = 0) -> None:
        self.model = model
        ids = list(range(1, NUM_BLOCKS))  # block 0 is the null block
        random.Random(seed).shuffle(ids)
        self.free = ids
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.caches = [torch.zeros(2, NUM_BLOCKS, BS, model.num_kv_heads_per_rank, model.head_dim)
                       for _ in range(model.num_layers)]

    def step(self, chunks: Sequence[tuple[int, list[int]]]) -> torch.Tensor:
        """Run ``(seq_id, new_tokens)`` chunks in one packed forward; returns logits for every
        new token."""
        ids, pos, slots, q_lens, seq_lens, tables = [], [], [], [], [], []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * BS < start + len(toks):
                table.append(self.free.pop())
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(table[p // BS] * BS + p % BS)
            self.lens[sid] = start + len(toks)
            q_lens.append(len(toks))
            seq_lens.append(start + len(toks))
            tables.append(table)
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t)
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        meta = AttentionMetadata(cu, torch.tensor(seq_lens, dtype=torch.int32), max(q_lens),
                                 max(seq_lens), [GroupMetadata(torch.tensor(slots), bt)],
                                 seq_lens, q_lens)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta,
                                TorchAttentionBackend())
            return self.model.compute_logits(hidden)


def reference(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def assert_packed_prefill_matches(model: Any, hf: Any, label: str) -> None:
    """Three prompts (5, 17, 33 tokens) prefilled in one packed step give transformers' logits."""
    rng = random.Random(1)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 17, 33)]
    logits = Paged(model).step(list(enumerate(prompts)))
    start = 0
    for p in prompts:
        diff = (logits[start:start + len(p)] - reference(hf, p)).abs().max().item()
        assert diff <= TOL, f"{label}: {diff}"
        start += len(p)


def assert_paged_decode_matches(model: Any, hf: Any, steps: int) -> None:
    """Two sequences (6 and 11 prompt tokens) decode ``steps`` tokens each, sharing the batch,
    through shuffled paged blocks; every step's logits equal transformers' for the whole
    sequence so far."""
    paged = Paged(model, seed=3)
    rng = random.Random(2)
    seqs = {0: [rng.randrange(300) for _ in range(6)], 1: [rng.randrange(300) for _ in range(11)]}
    paged.step(list(seqs.items()))
    for _ in range(steps):
        chunk = []
        for sid in seqs:
            seqs[sid].append(rng.randrange(300))
            chunk.append((sid, seqs[sid][-1:]))
        logits = paged.step(chunk)
        for row, sid in enumerate(seqs):
            want = reference(hf, seqs[sid])[-1]
            assert (logits[row] - want).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_packed_prefill_matches_transformers(kind: str) -> None:
    cfg = hf_config(kind, attention_bias=kind == "llama")
    hf = hf_model(cfg)
    assert_packed_prefill_matches(build_model(cfg, weights=hf_state_items(hf)), hf, kind)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_incremental_decode_through_paged_cache(kind: str) -> None:
    cfg = hf_config(kind)
    hf = hf_model(cfg)
    assert_paged_decode_matches(build_model(cfg, weights=hf_state_items(hf)), hf, steps=9)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prefill_after_cached_prefix(kind: str) -> None:
    cfg = hf_config(kind)
    hf = hf_model(cfg)
    paged = Paged(build_model(cfg, weights=hf_state_items(hf)))
    tokens = [random.Random(4).randrange(300) for _ in range(21)]
    paged.step([(0, tokens[:8])])
    logits = paged.step([(0, tokens[8:])])
    assert (logits - reference(hf, tokens)[8:]).abs().max().item() <= TOL


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings(tie: bool) -> None:
    cfg = hf_config("qwen3", tie_word_embeddings=tie)
    hf = hf_model(cfg)
    ours = build_model(cfg, weights=hf_state_items(hf))
    assert (ours.lm_head is None) == tie
    tokens = list(range(10, 30))
    assert (Paged(ours).step([(0, tokens)]) - reference(hf, tokens)).abs().max().item() <= TOL


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_rope_scaling_types(rope: dict) -> None:  # type: ignore[type-arg]
    cfg = hf_config("llama", rope_scaling={**rope, "rope_theta": 5000.0})
    hf = hf_model(cfg)
    ours = build_model(cfg, weights=hf_state_items(hf))
    tokens = [random.Random(5).randrange(300) for _ in range(40)]
    assert (Paged(ours).step([(0, tokens)]) - reference(hf, tokens)).abs().max().item() <= TOL


def test_load_model_from_safetensors_folder(tmp_path: Path) -> None:
    cfg = hf_config("qwen2")
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_model(tmp_path)
    tokens = list(range(40, 70))
    assert (Paged(ours).step([(0, tokens)]) - reference(hf, tokens)).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="missing"):
        build_model(cfg, weights=[("model.norm.weight", torch.ones(64))])
    with pytest.raises(ValueError, match="unsupported model type"):
        build_model(transformers.GPT2Config())


def test_random_init_is_deterministic() -> None:
    cfg = hf_config("llama")
    a, b = build_model(cfg, seed=7), build_model(cfg, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# -- tensor parallelism ---------------------------------------------------------------------------

def _tp_worker(rank: int, world: int, store: str, kind: str, tokens: list[int], out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = build_model(hf_config(kind), tp=TPGroup(rank, world), seed=11)
        logits = Paged(model).step([(0, tokens)])
        if rank == 0:
            out.put(logits.tolist())  # plain data: the child's shared memory dies with it
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The work is done and reported: leave without interpreter finalisation, whose C++ static
    # destructors (gloo / c10d threads) can abort a spawn child at exit ("terminate called
    # without an active exception") long after the result is in.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tensor_parallel_two_ranks_equal_one(kind: str, tmp_path: Path) -> None:
    tokens = list(range(3, 30))
    single = Paged(build_model(hf_config(kind), seed=11)).step([(0, tokens)])
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    ctx_procs = mp.start_processes(_tp_worker, args=(2, str(tmp_path / "store"), kind, tokens, queue),
                                   nprocs=2, join=False, start_method="spawn")
    sharded = torch.tensor(queue.get())  # read before joining: a large put blocks the child
    while not ctx_procs.join():
        pass
    assert (sharded - single).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="not divisible"):
        build_model(hf_config(kind, num_key_value_heads=1), tp=TPGroup(0, 2))
