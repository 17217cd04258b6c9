"""Errors the engine raises about its own state or a request's results (bad arguments raise
:class:`kvcore.errors.InvalidArgumentError`)."""

from __future__ import annotations

from typing import Any


class EngineDeadError(RuntimeError):
    """The engine cannot run any more (a tensor-parallel forward failed or a worker died, or it
    was closed with workers); build a new one."""


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN or infinite logits for some requests: those requests were aborted
    (their KV of that step left the prefix cache); the others ran on.

    ``request_ids``: the failed requests; ``outputs``: every request's output of the call, in
    prompt order (the failed ones finished ``"abort"``), or ``[]`` from ``LLM.step``."""

    def __init__(self, request_ids: list[str], outputs: list[Any] | None = None) -> None:
        super().__init__(f"NaN or infinite logits for request(s) {', '.join(map(repr, request_ids))}"
                         ": they were aborted; the engine is usable")
        self.request_ids = request_ids
        self.outputs = outputs if outputs is not None else []
