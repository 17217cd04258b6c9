"""``python -m runner.generate`` (also the ``kvcore-generate`` script): run the engine end to end.

With no ``--model`` it builds a tiny random Qwen3-shaped model (byte-level tokenizer) on the
CPU, so a fresh install can exercise the whole stack; ``--model DIR`` loads a local folder with
``config.json`` and ``*.safetensors`` (and its tokenizer, if present).  On the CPU the engine
picks torch's thread count unless ``--threads`` or ``OMP_NUM_THREADS`` says (see
:mod:`runner.threads`).  ``--help`` lists every option with its default.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from runner.engine import LLM
from runner.sampler import SamplingParams

DEFAULT_PROMPTS = ["The quick brown fox", "KV caches are", "Once upon a time,",
                   "The quick brown fox jumps"]


def tiny_config() -> object:
    import transformers

    return transformers.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    vocab_size=512, max_position_embeddings=1024,
                                    tie_word_embeddings=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option says what it does and its default (``--help``)."""
    ap = argparse.ArgumentParser(
        prog="python -m runner.generate",
        description="Generate text with the kvcore runner engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="With no --model: a tiny random Qwen3-shaped model with a byte tokenizer, on the "
               "CPU.")
    ap.add_argument("--model", metavar="DIR",
                    help="local model folder (config.json, *.safetensors, tokenizer if any); "
                         "none: a tiny random model")
    ap.add_argument("--prompt", action="append", metavar="TEXT",
                    help="prompt text (repeatable); none: four built-in prompts")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens to generate per prompt")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling: keep the smallest set of tokens with this mass (1: off)")
    ap.add_argument("--top-k", type=int, default=0,
                    help="sample among the k most likely tokens (0: off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random weights (no --model) and of sampling")
    ap.add_argument("--backend", default="torch", choices=("torch", "triton", "flash_attn"),
                    help="attention backend")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    ap.add_argument("--num-blocks", type=int,
                    help="KV-cache blocks (none: from free GPU memory, or 256 MiB on the CPU)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ranks)")
    ap.add_argument("--threads", type=int,
                    help="torch CPU threads per rank (none: $OMP_NUM_THREADS if set, else the "
                         "cores not busy with other work)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="turn the prefix cache off")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
        t0 = time.perf_counter()
        llm = LLM(args.model or tiny_config(), backend=args.backend, block_size=args.block_size,
                  num_blocks=args.num_blocks, tensor_parallel_size=args.tp, seed=args.seed,
                  enable_prefix_caching=not args.no_prefix_caching, cpu_threads=args.threads)
        load_s = time.perf_counter() - t0
        prompts = args.prompt or DEFAULT_PROMPTS
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        gen_s = time.perf_counter() - t0
        llm.close()
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"runner.generate: error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs):
        print(f"{prompt!r} -> {out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}, "
              f"{out.num_cached_tokens} prompt tokens from the prefix cache]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"model ready in {load_s:.1f}s; {total} tokens in {gen_s:.2f}s "
          f"({total / gen_s:.1f} tok/s) on {llm.device}, backend {args.backend}, "
          f"{llm.kv_config.num_groups} KV-cache group(s) of {llm.runner.num_blocks} blocks"
          + (f", {torch.get_num_threads()} CPU thread(s)" if llm.device.type == "cpu" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
