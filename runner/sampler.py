"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request seeds.

Sampling uses the Gumbel-max trick (argmax of logits/T + Gumbel noise), so one noise draw per
vocabulary entry decides the token.  A request with a ``seed`` draws its noise from its own
generator, advanced once per sampled token, so its tokens do not depend on which other requests
share the batch; requests without a seed share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stop settings (``temperature=0``: greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
