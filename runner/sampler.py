"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request seeds.

Sampling uses the Gumbel-max trick (argmax of logits/T + Gumbel noise), so one noise draw per
vocabulary entry decides the token.  A request with a ``seed`` draws its noise from its own
generator, advanced once per sampled token, so its tokens do not depend on which other requests
share the batch; requests without a seed share the engine's generator.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcore.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stop settings (``temperature=0``: greedy).

    Every field is checked on construction; a bad value raises
    :class:`~kvcore.errors.InvalidArgumentError` (a ``ValueError``) naming the field and the
    value.  ``temperature`` and ``top_p`` must be finite real numbers (stored as ``float``);
    ``top_k``, ``max_tokens`` and ``seed`` ints (``bool`` is refused everywhere a number is
    expected).  ``top_k=0`` disables top-k; ``top_k=-1``, vLLM's spelling of the same, is
    accepted and stored as ``0``.  ``stop_token_ids`` may be any list or tuple of non-negative
    ints and is stored as a tuple.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, stored as 0): no top-k
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise InvalidArgumentError(f"temperature must be >= 0, got {self.temperature!r}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        top_k = _int("top_k", self.top_k)
        if top_k < -1:
            raise InvalidArgumentError(
                f"top_k must be >= 0 (0 or -1 disables top-k), got {self.top_k!r}")
        max_tokens = _int("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        seed = None if self.seed is None else _int("seed", self.seed, "None or an int")
        if seed is not None and not -(1 << 63) <= seed < 1 << 64:
            raise InvalidArgumentError(f"seed must be in [-2**63, 2**64), got {self.seed!r}")
        if self.ignore_eos.__class__ is not bool:
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = self.stop_token_ids
        if not isinstance(stop, (tuple, list)):
            raise InvalidArgumentError(
                f"stop_token_ids must be a tuple or list of ints, got {stop!r}")
        stop_ids: list[int] = []
        for i, t in enumerate(stop):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise InvalidArgumentError(
                    f"stop_token_ids[{i}] must be an int >= 0, got {t!r}")
            stop_ids.append(int(t))
        # Store the normalised values (frozen: bypass __setattr__).
        for name, value in (("temperature", temperature), ("top_p", top_p),
                            ("top_k", max(top_k, 0)), ("max_tokens", max_tokens),
                            ("seed", seed), ("stop_token_ids", tuple(stop_ids))):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _real(name: str, value: object) -> float:
    """``value`` as a finite float; ints and floats only (not ``bool``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an int too large for a float
        out = math.inf
    if not math.isfinite(out):
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    return out


def _int(name: str, value: object, what: str = "an int") -> int:
    """``value`` as an int; ``bool`` and floats (even integral ones) are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be {what}, got {value!r}")
    return int(value)


class Sampler:
    """Samples one token per row of ``logits`` ([num_seqs, vocab])."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._request_generators[request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 request_ids: Sequence[str]) -> torch.Tensor:
        logits = logits.float()
        flags = [p.greedy for p in params]
        if all(flags):  # decided on the host: no device round trip
            return logits.argmax(dim=-1)
        greedy = torch.tensor(flags, device=logits.device)
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                             device=logits.device)
        scaled = logits / temps[:, None]
        scaled = _apply_top_k_top_p(scaled, params)
        noise = torch.empty_like(scaled)
        shared = [i for i, p in enumerate(params) if p.seed is None]
        if shared:
            u = torch.rand((len(shared), scaled.shape[1]), generator=self.generator,
                           device=logits.device)
            noise[shared] = -torch.log(-torch.log(u.clamp_(1e-20, 1.0)))
        for i, (p, rid) in enumerate(zip(params, request_ids)):
            if p.seed is not None:
                u = torch.rand((scaled.shape[1],), generator=self._generator(rid, p.seed),
                               device=logits.device)
                noise[i] = -torch.log(-torch.log(u.clamp_(1e-20, 1.0)))
        sampled = (scaled + noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)[:, None]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop |= before >= torch.tensor(top_p, device=logits.device)[:, None]
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
