"""What ``LLM.generate`` is given, checked before anything is admitted: prompts (text or token
ids), sampling params; and the tokenizer an engine uses when it is given none."""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any

from kvcore.errors import InvalidArgumentError
from runner.sampler import SamplingParams
from runner.tokenizer import ByteTokenizer


def prompt_token_ids(index: int, prompt: Any, tokenizer: Any, max_model_len: int,
                     vocab_size: int) -> list[int]:
    """Prompt ``index`` (a ``str``, tokenized with ``tokenizer``, or a list of int token ids) as
    a checked list of token ids: non-empty, shorter than ``max_model_len``, ids in
    ``[0, vocab_size)``; else :class:`InvalidArgumentError` naming it."""
    if isinstance(prompt, str):
        what = f"prompt {index} (tokenized)"
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        what = f"prompt {index}"
        ids = prompt
    else:
        hint = (" (wrap a single tokenized prompt: [[1, 2, 3]])"
                if isinstance(prompt, int) else "")
        raise InvalidArgumentError(f"prompt {index}: expected a str or a list of int token "
                                   f"ids, got {type(prompt).__name__}{hint}")
    n = len(ids)  # checked before anything walks or hashes the tokens
    if n == 0:
        raise InvalidArgumentError(f"{what} is empty")
    if n >= max_model_len:
        raise InvalidArgumentError(
            f"{what} has {n} tokens; it must be shorter than max_model_len="
            f"{max_model_len} to leave room to generate")
    return check_token_ids(ids, vocab_size, what)


def sampling_params_list(params: Any, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        raise InvalidArgumentError("sampling_params must be a SamplingParams or a list of them, "
                                   f"got {type(params).__name__}")
    if len(params) != num_prompts:
        raise InvalidArgumentError(f"{len(params)} sampling params for {num_prompts} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise InvalidArgumentError(
                f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return list(params)


def check_token_ids(ids: Any, vocab_size: int, what: str) -> list[int]:
    """A copy of ``ids`` as a list of ints in ``[0, vocab_size)``, or InvalidArgumentError
    naming the first bad one (integral non-``bool`` numbers, e.g. numpy ints, become ints)."""
    if all(t.__class__ is int for t in ids):
        out = list(ids)
    else:
        out = []
        for pos, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidArgumentError(f"{what}: token id {t!r} at position {pos} is not an "
                                           f"int ({type(t).__name__})")
            out.append(int(t))
    if out and (min(out) < 0 or max(out) >= vocab_size):
        pos, bad = next((i, t) for i, t in enumerate(out) if not 0 <= t < vocab_size)
        raise InvalidArgumentError(f"{what}: token id {bad} at position {pos} is outside the "
                                   f"vocabulary [0, {vocab_size})")
    return out


def default_tokenizer(model: Any, cfg: Any) -> Any:
    if isinstance(model, (str, Path)):
        try:
            import transformers

            return transformers.AutoTokenizer.from_pretrained(str(model), local_files_only=True)
        except Exception:  # no tokenizer files in the folder: fall back to bytes
            pass
    if cfg.vocab_size < ByteTokenizer().vocab_size:
        raise ValueError(f"vocab_size {cfg.vocab_size} is too small for the byte tokenizer (259)")
    return ByteTokenizer()
