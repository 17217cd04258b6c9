"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Nothing sorts the vocabulary on the common paths, and nothing loops over requests in Python
except the ones with a ``seed``.  Each row of ``logits`` ([num_seqs, vocab]) takes one of:

* **greedy** (``temperature < 1e-5``): ``argmax``.
* **unrestricted** (``top_k`` 0 or >= vocab, ``top_p`` 1): the Gumbel-max trick over the whole
  vocabulary, ``argmax(logits + T * G)`` with ``G = -log(-log U)``, ``U`` uniform; for ``T > 0``
  that is ``argmax(logits / T + G)``, an exact draw from ``softmax(logits / T)``.
* **restricted** (top-k and/or top-p): ``torch.topk`` of a bounded candidate set, ``k`` = the
  row's ``top_k``, or ``candidates`` (256) when it asks for top-p only.  Top-k is then exact (its
  set is the candidates).  Top-p keeps rank ``r`` while the mass of strictly better tokens is
  ``< top_p``, the mass normalised over the top-k set, or over the whole vocabulary (a
  ``logsumexp`` pass, no sort) for top-p-only rows.  For those the candidates are enough iff their
  total mass is ``>= top_p``: every token outside them then has at least that much mass before
  it and is dropped, so the kept set is exactly what a full sort gives.  Otherwise (a flat
  distribution: the nucleus holds more than 256 tokens) the row is marked and resampled on the
  exact path (a sort of that row only).  The draw is the Gumbel-max trick over the kept
  candidates, exact for ``softmax(logits / T)`` restricted to them.

256 candidates: ``torch.topk`` costs about the same for ``k`` up to a few hundred (radix
select, then a sort of ``k`` values), and for trained models the top 256 tokens nearly always
hold 0.9-0.95 of the mass; when they do not, the fallback keeps the result exact at the cost of
one more synchronisation that step.  (Random-weight models have nearly flat distributions:
top-p-only sampling falls back there, which is correct but slow.)

Seeds: a request with a ``seed`` draws its noise from its own generator, one uniform per
vocabulary entry per step (indexed by token id, also on the candidate path), so its tokens do
not depend on which other requests share the batch; requests without a seed share the engine's
generator.  Seeded rows are computed with the others; only their noise draws loop in Python.

The result comes back to the host in one copy into a pinned buffer and one synchronisation
(a second one only on a step with a top-p fallback row).  :meth:`Sampler.sample_async` starts
that copy and returns at once (:class:`SampledTokens`): the engine's async scheduling launches
the next step, which reads this step's tokens on the device, before it waits.  Two pinned
buffers alternate, so step N+1's copy never overwrites step N's before it was read.  A step
with a row that may need the top-p fallback resolves it before returning (its wait comes
early), so the device tokens are final either way.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcore.errors import InvalidArgumentError
from runner.batch import StagingBuffer

# Temperatures below this sample greedily (as vLLM): dividing by ~0 would overflow to inf/NaN.
GREEDY_TEMPERATURE = 1e-5
# Candidates kept for rows that ask for top-p without top-k (see the module docstring).
DEFAULT_CANDIDATES = 256
# The host-side token of a row whose logits hold a NaN or an infinity (the engine fails that
# request); on the device the row keeps the token sampled from them, a valid id.
NON_FINITE = -2


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stop settings (``temperature=0``, or below ``1e-5``: greedy).

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
        return self.temperature < GREEDY_TEMPERATURE


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
    """Samples one token per row of ``logits`` ([num_seqs, vocab]); returns a CPU int64 tensor.

    ``candidates``: the candidate count for top-p-only rows (see the module docstring)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu",
                 candidates: int = DEFAULT_CANDIDATES) -> None:
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.candidates = candidates
        self._request_generators: dict[str, torch.Generator] = {}
        self._staging = StagingBuffer(self.device, 1 << 14)
        self._cuda = self.device.type == "cuda"
        # CUDA: two pinned host buffers and their copy events, used in turn (one step may be in
        # flight while the next one samples).
        self._host_tokens: list[torch.Tensor | None] = [None, None]
        self._events: list[Any] = [torch.cuda.Event(), torch.cuda.Event()] if self._cuda else []
        self._turn = 0
        self.num_exact_rows = 0  # rows resampled on the exact (sorting) path, for benchmarks

    def forget(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._request_generators[request_id] = gen
        return gen

    # -- entry points ---------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 request_ids: Sequence[str]) -> torch.Tensor:
        """The tokens, on the host (a CPU int64 tensor): one device-to-host copy and one
        synchronisation (two on a step where a top-p row needs the exact path)."""
        return torch.tensor(self.sample_async(logits, params, request_ids).wait(),
                            dtype=torch.int64)

    def sample_async(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                     request_ids: Sequence[str]) -> SampledTokens:
        """The tokens, final on the device, with their copy to the host started (no wait,
        unless a row may need the top-p fallback: see the module docstring)."""
        tokens = self.sample(logits, params, request_ids)
        # Rows with a NaN or an infinity come back as NON_FINITE in the same copy (no extra
        # wait); the device keeps their sampled ids, which the next step may read.
        marked = tokens.masked_fill(~torch.isfinite(logits).all(dim=-1), NON_FINITE)
        if not self._may_fall_back(params, logits.shape[1]):
            return self._start_copy(marked, tokens)
        host = self._start_copy(marked, tokens).wait()
        rows = [i for i, t in enumerate(host) if t == -1]
        if rows:
            self.num_exact_rows += len(rows)
            exact = self._exact_rows(logits, rows, params, request_ids)
            tokens[torch.tensor(rows, device=tokens.device)] = exact
            for i, t in zip(rows, exact.tolist()):  # (not a pinned buffer: both are in use)
                host[i] = t
        if NON_FINITE in host:  # such a row may still hold the fallback's -1: a valid id instead
            tokens.clamp_(min=0)
        return SampledTokens(tokens, tokens=host)

    def _may_fall_back(self, params: Sequence[SamplingParams], vocab: int) -> bool:
        """Whether a row asks for top-p without top-k over more candidates than it gets."""
        return self.candidates < vocab and any(
            p.top_p < 1.0 and not 0 < p.top_k < vocab and not p.greedy for p in params)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               request_ids: Sequence[str]) -> torch.Tensor:
        """The tokens on the device, with -1 for rows the exact path must resample; no
        synchronisation.  Rows go to three vectorised groups (greedy, unrestricted,
        restricted); only seeded rows' noise is drawn row by row, from their own generators."""
        n, vocab = logits.shape
        if n != len(params) or n != len(request_ids):
            raise ValueError(f"{n} rows of logits for {len(params)} sampling params and "
                             f"{len(request_ids)} request ids")
        if logits.dtype != torch.float32:
            logits = logits.float()
        temps = [p.temperature for p in params]
        greedy = [t < GREEDY_TEMPERATURE for t in temps]
        if all(greedy):
            return logits.argmax(dim=-1)
        cap = min(self.candidates, vocab)
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top_p = [p.top_p for p in params]
        full: list[int] = []  # unrestricted: unseeded rows first, then seeded ones
        cand: list[int] = []  # top-k and/or top-p: likewise
        full_seeded: list[int] = []
        cand_seeded: list[int] = []
        for i, p in enumerate(params):
            if greedy[i]:
                continue
            restricted = top_k[i] or top_p[i] < 1.0
            if p.seed is None:
                (cand if restricted else full).append(i)
            else:
                (cand_seeded if restricted else full_seeded).append(i)
        if len(full) == n and min(temps) == max(temps):  # the common case: nothing to copy
            return _gumbel_argmax(logits, temps[0], self._uniform(n, vocab, []))
        num_full_unseeded, num_cand_unseeded = len(full), len(cand)
        full += full_seeded
        cand += cand_seeded

        # Per-row parameters: one staged host-to-device copy (nothing for uniform values).
        staged: list[tuple[str, Any]] = []
        full_all = full == list(range(n))
        cand_all = cand == list(range(n))
        temps_full = [temps[i] for i in full]
        full_t_uniform = bool(full) and min(temps_full) == max(temps_full)
        if full and not full_all:
            staged.append(("full_rows", np.asarray(full, dtype=np.int64)))
        if full and not full_t_uniform:
            staged.append(("full_t", np.asarray(temps_full, dtype=np.float32)[:, None]))
        ks = [top_k[i] or cap for i in cand]
        has_k = [top_k[i] > 0 for i in cand]
        any_p = any(top_p[i] < 1.0 for i in cand)
        if cand:
            if not cand_all:
                staged.append(("cand_rows", np.asarray(cand, dtype=np.int64)))
            staged.append(("cand_t", np.asarray([temps[i] for i in cand], np.float32)[:, None]))
            staged.append(("cand_k", np.asarray(ks, dtype=np.int64)))
            if any_p:
                staged.append(("cand_p", np.asarray([top_p[i] if top_p[i] < 1.0 else math.inf
                                                     for i in cand], dtype=np.float32)))
            if any(has_k) and not all(has_k):
                staged.append(("cand_has_k", np.asarray(has_k, dtype=np.bool_)))
        st = self._staging
        st.begin(st.nbytes_for(arr for _, arr in staged))
        for _, arr in staged:
            st.array(arr.shape, arr.dtype)[...] = arr
        dev = dict(zip((name for name, _ in staged), st.upload()))

        out = logits.argmax(dim=-1) if any(greedy) else None
        if full:
            x = logits if full_all else logits.index_select(0, dev["full_rows"])
            u = self._uniform(num_full_unseeded, vocab,
                              [(request_ids[i], params[i]) for i in full_seeded])
            t = temps_full[0] if full_t_uniform else dev["full_t"]
            tok = _gumbel_argmax(x, t, u)
            out = tok if full_all else _place(out, n, dev["full_rows"], tok)
        if cand:
            x = logits if cand_all else logits.index_select(0, dev["cand_rows"])
            max_k = max(ks)
            vals, idx = torch.topk(x, max_k, dim=-1)  # sorted, best first
            # Noise by rank for unseeded rows; by token id for seeded ones (a draw per vocabulary
            # entry from their own generator), so that theirs does not depend on max_k.
            u = self._uniform(num_cand_unseeded, max_k, [])
            if cand_seeded:
                by_id = self._uniform(0, vocab, [(request_ids[i], params[i])
                                                 for i in cand_seeded])
                u = torch.cat([u, by_id.gather(1, idx[num_cand_unseeded:])])
            tok = _sample_candidates(
                x, vals, idx, dev["cand_t"], dev["cand_k"], dev["cand_p"] if any_p else None,
                True if all(has_k) else (dev["cand_has_k"] if any(has_k) else False), u)
            out = tok if cand_all else _place(out, n, dev["cand_rows"], tok)
        assert out is not None
        return out

    def _uniform(self, num_shared: int, width: int,
                 seeded: Sequence[tuple[str, SamplingParams]]) -> torch.Tensor:
        """[num_shared + len(seeded), width] uniforms: the first rows from the engine's
        generator in one draw, then one row per seeded request from its own generator."""
        u = torch.empty(num_shared + len(seeded), width, device=self.device)
        if num_shared:
            torch.rand((num_shared, width), generator=self.generator, out=u[:num_shared])
        for j, (rid, p) in enumerate(seeded):
            torch.rand((width,), generator=self._generator(rid, _seed(p.seed)),
                       out=u[num_shared + j])
        return u

    # -- the exact path -------------------------------------------------------------------------
    def _exact_rows(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                    request_ids: Sequence[str]) -> torch.Tensor:
        """Resample ``rows`` with a full sort of each (their own generators for seeded rows)."""
        logits = logits.float()
        shared = [i for i in rows if params[i].seed is None]
        out: dict[int, torch.Tensor] = {}
        if shared:
            idx = torch.tensor(shared, device=logits.device)
            tok = sample_exact(logits.index_select(0, idx), [params[i] for i in shared],
                               self.generator)
            for j, i in enumerate(shared):
                out[i] = tok[j:j + 1]
        for i in rows:
            if params[i].seed is not None:
                gen = self._generator(request_ids[i], _seed(params[i].seed))
                out[i] = sample_exact(logits[i:i + 1], [params[i]], gen)
        return torch.cat([out[i] for i in rows])

    def _start_copy(self, tokens: torch.Tensor, device: torch.Tensor) -> SampledTokens:
        """Start ``tokens``' copy to the host: on CUDA into the next of the two pinned buffers
        (``non_blocking``, an event recorded after it); elsewhere nothing to start.  ``device``
        is what the next step reads on the device."""
        if not self._cuda or tokens.device.type != "cuda":
            return SampledTokens(device, tokens=None, source=tokens)
        turn = self._turn
        self._turn ^= 1
        event = self._events[turn]
        event.synchronize()  # the copy two steps back: read long ago (never a real wait)
        n = tokens.shape[0]
        buf = self._host_tokens[turn]
        if buf is None or buf.shape[0] < n:
            buf = self._host_tokens[turn] = torch.empty(max(n, 512), dtype=torch.int64,
                                                        pin_memory=True)
        buf[:n].copy_(tokens, non_blocking=True)
        event.record()
        return SampledTokens(device, host=buf[:n], event=event)


class SampledTokens:
    """One step's sampled tokens: final on the device (:attr:`device`, what the next step's
    placeholder positions read) and, after :meth:`wait`, on the host."""

    __slots__ = ("_event", "_host", "_source", "_tokens", "device")

    def __init__(self, device: torch.Tensor, *, host: torch.Tensor | None = None,
                 event: Any = None, tokens: list[int] | None = None,
                 source: torch.Tensor | None = None) -> None:
        self.device = device
        self._host = host  # a pinned buffer the copy goes to (CUDA), else None
        self._source = source  # without a copy: the tensor to read (else ``device``)
        self._event = event
        self._tokens = tokens

    def wait(self) -> list[int]:
        """The tokens as ints (:data:`NON_FINITE` for rows with NaN or infinite logits): waits
        for the copy (CUDA; the step's one synchronisation)."""
        if self._tokens is None:
            if self._event is not None:
                self._event.synchronize()
            src = self._host if self._host is not None else (
                self._source if self._source is not None else self.device)
            self._tokens = src.tolist()
        return self._tokens


def _seed(value: int | None) -> int:
    if value is None:
        raise ValueError("expected a seeded request")
    return value


def _place(out: torch.Tensor | None, n: int, rows: torch.Tensor,
           tok: torch.Tensor) -> torch.Tensor:
    """``out`` (allocated on first use) with ``tok`` written at ``rows``."""
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=tok.device)
    return out.index_copy_(0, rows, tok)


def _neg_gumbel(u: torch.Tensor) -> torch.Tensor:
    """``log(-log U)`` in place for ``U`` uniform in [0, 1): minus a standard Gumbel sample.
    (``U = 0``, probability 2**-24, gives +inf, i.e. Gumbel -inf: that token cannot win; never
    NaN.)"""
    return u.log_().neg_().log_()


def _gumbel_argmax(x: torch.Tensor, temperature: float | torch.Tensor,
                   u: torch.Tensor) -> torch.Tensor:
    """One exact draw per row from ``softmax(x / T)`` with the uniforms ``u`` (consumed):
    ``argmax(x - T * log(-log U))`` = ``argmax(x / T + G)`` for ``T > 0``; ``temperature``: a
    float or [rows, 1]."""
    q = _neg_gumbel(u)
    if isinstance(temperature, torch.Tensor):
        torch.addcmul(x, q, temperature.neg(), out=q)
    else:
        torch.add(x, q, alpha=-temperature, out=q)
    return q.argmax(dim=-1)


def _sample_candidates(x: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor,
                       temperature: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None,
                       has_top_k: bool | torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Top-k / top-p sampling on each row's best logits ``vals`` (token ids ``idx``, both
    [rows, max_k], best first) of ``x`` (see the module docstring).  Per row: ``temperature``
    ([rows, 1]), ``k`` its candidate count (its top-k, or the cap), ``top_p`` (inf: none;
    ``None``: no row has one), ``has_top_k`` whether it asked for top-k (else its top-p mass is
    normalised over the whole vocabulary; a bool stands for every row); ``u``: uniforms
    [rows, max_k] by rank (consumed).  Rows whose candidates hold less than ``top_p`` of the
    mass come back as -1."""
    vocab = x.shape[1]
    rows, max_k = vals.shape
    vals = vals / temperature
    rank = torch.arange(max_k, device=x.device)[None, :]
    keep = (rank < k[:, None]).expand(rows, max_k)
    covered: torch.Tensor | None = None
    if top_p is not None:
        masked = vals.masked_fill(~keep, -math.inf)
        if has_top_k is True:
            norm = torch.logsumexp(masked, dim=-1, keepdim=True)
        else:
            lse_full = torch.logsumexp(x / temperature, dim=-1, keepdim=True)
            if has_top_k is False:
                norm = lse_full
            else:
                assert isinstance(has_top_k, torch.Tensor)
                norm = torch.where(has_top_k[:, None],
                                   torch.logsumexp(masked, dim=-1, keepdim=True), lse_full)
        probs = (masked - norm).exp_()
        cum = probs.cumsum(dim=-1)
        keep = keep & ((cum - probs) < top_p[:, None])  # strictly better tokens' mass < top_p
        keep[:, 0] = True
        if has_top_k is not True:
            # Enough candidates iff they hold top_p of the mass (or are the whole vocabulary).
            covered = (cum[:, -1] >= top_p) | (k >= vocab)
            if isinstance(has_top_k, torch.Tensor):
                covered |= has_top_k
    scores = vals.masked_fill_(~keep, -math.inf)
    scores -= _neg_gumbel(u)
    tok = idx.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    if covered is not None:
        tok = torch.where(covered, tok, torch.full_like(tok, -1))
    return tok


def sample_exact(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generator: torch.Generator) -> torch.Tensor:
    """The reference path: sort each row, apply top-k then top-p on the sorted probabilities,
    Gumbel-max over the whole kept set (greedy rows: argmax).  Exact; O(vocab log vocab)."""
    logits = logits.float()
    n, vocab = logits.shape
    temps = [p.temperature for p in params]
    greedy = torch.tensor([t < GREEDY_TEMPERATURE for t in temps], device=logits.device)
    t = torch.tensor([t if t >= GREEDY_TEMPERATURE else 1.0 for t in temps],
                     device=logits.device)[:, None]
    sorted_logits, order = (logits / t).sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                     device=logits.device)[:, None]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, -math.inf), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params],
                         device=logits.device)[:, None]
    drop |= before >= top_p
    drop[:, 0] = False  # always keep the best token
    scores = sorted_logits.masked_fill(drop, -math.inf)
    scores -= _neg_gumbel(torch.rand((n, vocab), generator=generator, device=logits.device))
    sampled = order.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)
