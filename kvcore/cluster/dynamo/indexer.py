"""NVIDIA Dynamo's standalone KV indexer, run as a child process that kvcore starts and stops.

``python -m dynamo.indexer`` (package ``ai-dynamo-runtime``, kvcore's ``dynamo`` extra) keeps a
radix tree of the blocks each worker holds, built from the workers' ZeroMQ KV-event streams in
vLLM's format, and answers over HTTP:

* ``POST /register {"instance_id", "endpoint", "replay_endpoint", "block_size", "model_name"}``
  starts a SUB listener on a worker's PUB endpoint.  The listener asks the replay endpoint for
  the batches it missed only when it sees a sequence gap (a fresh listener expects sequence 0).
* ``POST /query {"token_ids", "model_name"}`` hashes the tokens itself, block by block, and
  returns per worker (and data-parallel rank) the device-tier tokens of the longest prefix it
  holds: ``{"scores": {"<worker>": {"<dp rank>": tokens}}, ...}``.
* ``GET /workers`` lists the registered workers.

:class:`DynamoIndexer` finds a free port, starts the process, waits until it answers, and always
stops it on ``stop``/``__exit__`` (terminate, then kill).  The process

* listens on ``host``, 127.0.0.1 unless the caller asks otherwise.  Version 1.6.1 has no option
  for it and binds ``0.0.0.0``: it runs under :mod:`kvcore.proc.loopback`, which moves its
  wildcard binds to ``host`` (Linux; elsewhere it refuses to start, and ``host="0.0.0.0"`` runs
  it on every interface, as it comes);
* ends with kvcore however kvcore ends, SIGKILL included (:mod:`kvcore.proc.lifeline`);
* runs in its own session: a Ctrl-C in the terminal reaches kvcore, which then stops it (the
  indexer never dies under a replay still querying it).

Its output goes to a temporary file whose tail is quoted when it fails.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any

from kvcore.errors import InvalidArgumentError, KVCoreError
from kvcore.proc import loopback
from kvcore.proc.lifeline import guarded

PACKAGE = "ai-dynamo-runtime"
INSTALL_HINT = "pip install 'kvcore[dynamo]'"
MODULE = "dynamo.indexer"
NATIVE_MODULE = "dynamo._core"
"""The extension module whose code binds the indexer's HTTP socket."""
HOST = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"


class DynamoUnavailableError(KVCoreError, ImportError):
    """The ``ai-dynamo-runtime`` package (the module ``dynamo.indexer``) is not installed."""


class DynamoIndexerError(KVCoreError, RuntimeError):
    """The indexer process did not start, exited, or answered a request with an error."""


def dynamo_available() -> bool:
    """Whether ``python -m dynamo.indexer`` can run in this interpreter's environment."""
    try:
        return importlib.util.find_spec(MODULE) is not None
    except ModuleNotFoundError:  # no top-level ``dynamo`` package at all
        return False


def require_dynamo() -> None:
    """Raise :class:`DynamoUnavailableError`, naming the package, unless Dynamo is installed."""
    if not dynamo_available():
        raise DynamoUnavailableError(
            f"the dynamo router runs NVIDIA Dynamo's KV indexer (python -m {MODULE}), from the "
            f"package {PACKAGE}, which is not installed in {sys.prefix}: {INSTALL_HINT}")


def free_port(host: str = HOST) -> int:
    """A TCP port the OS reports free on ``host`` now (it may be taken before it is used:
    :class:`DynamoIndexer` retries with another one when its bind fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _tail(log: IO[bytes], limit: int = 2000) -> str:
    log.flush()
    log.seek(0)
    text = log.read().decode(errors="replace")
    return text[-limit:].strip() or "(no output)"


class DynamoIndexer:
    """One ``dynamo.indexer`` process; see the module docstring.

    Args:
        threads: the indexer's ``--threads`` (1: its single-threaded indexer).
        model_name: the model name workers are registered and queried under.
        start_timeout: seconds to wait for the process to answer.
        request_timeout: seconds for one HTTP request.
        host: the IPv4 address the indexer listens on (default 127.0.0.1, this machine only);
            ``"0.0.0.0"`` exposes it on every interface.
    """

    START_ATTEMPTS = 3

    def __init__(self, *, threads: int = 1, model_name: str = "default",
                 start_timeout: float = 60.0, request_timeout: float = 30.0,
                 host: str = HOST) -> None:
        if type(threads) is not int or threads < 1:
            raise InvalidArgumentError(f"threads must be a positive int, got {threads!r}")
        if not isinstance(model_name, str) or not model_name:
            raise InvalidArgumentError(f"model_name must be a non-empty str, got {model_name!r}")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise InvalidArgumentError(
                f"host must be an IPv4 address (127.0.0.1, or 0.0.0.0 for every interface), "
                f"got {host!r}") from None
        self.host = host
        self._connect_host = HOST if host == EVERY_INTERFACE else host
        self.threads = threads
        self.model_name = model_name
        self.start_timeout = start_timeout
        self.request_timeout = request_timeout
        self.port: int | None = None
        self.start_s = 0.0  # how long the start took
        self.num_queries = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._conn: http.client.HTTPConnection | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> DynamoIndexer:
        """Start the process on a free port and wait until it answers; raises
        :class:`DynamoUnavailableError` when the package is missing and
        :class:`DynamoIndexerError` when the process fails (its output quoted)."""
        if self._proc is not None:
            raise DynamoIndexerError("the indexer is already started")
        require_dynamo()
        t0 = time.perf_counter()
        last = ""
        for _ in range(self.START_ATTEMPTS):
            self.port = free_port(self.host)
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
            self._proc = subprocess.Popen(
                self.command(self.port), stdin=subprocess.DEVNULL, stdout=self._log,
                stderr=subprocess.STDOUT, start_new_session=True)
            try:
                if self._wait_until_up():
                    self.start_s = time.perf_counter() - t0
                    return self
            except BaseException:
                self.stop()
                raise
            last = _tail(self._log)
            refused = self._proc.returncode == loopback.REFUSED
            self.stop()
            if refused:
                raise DynamoIndexerError(
                    f"python -m {MODULE} was not started: {last}; DynamoIndexer(host="
                    f"{EVERY_INTERFACE!r}) runs it on every interface")
            if "in use" not in last:  # anything but a port taken meanwhile: do not retry
                break
        raise DynamoIndexerError(f"python -m {MODULE} did not start: {last}")

    def command(self, port: int) -> list[str]:
        """The command line that runs the indexer on ``port``: under the lifeline, and under
        the loopback launcher unless it listens on every interface."""
        args = ["--port", str(port), "--threads", str(self.threads),
                "--model-name", self.model_name]
        if self.host == EVERY_INTERFACE:
            return guarded([sys.executable, "-m", MODULE, *args])
        return guarded([sys.executable, loopback.LAUNCHER, self.host, NATIVE_MODULE, MODULE,
                        *args])

    def _wait_until_up(self) -> bool:
        """True once ``GET /workers`` answers; False if the process exited first."""
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                workers = self._request("GET", "/workers", timeout=1.0)
            except OSError:
                self._conn = None
                time.sleep(0.05)
                continue
            if isinstance(workers, list) and self._proc.poll() is None:
                return True
        assert self._log is not None
        raise DynamoIndexerError(f"python -m {MODULE} did not answer on port {self.port} within "
                                 f"{self.start_timeout:.0f}s: {_tail(self._log)}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL to its process group after ``timeout``);
        idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # Its own session, so its own group: a watching lifeline and the indexer.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def output(self) -> str:
        """The tail of the process's output so far (for error messages and tests)."""
        return _tail(self._log) if self._log is not None else "(not started)"

    def __enter__(self) -> DynamoIndexer:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP API -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None,
                 timeout: float | None = None) -> Any:
        """One request on a kept-alive connection (reopened once if the server closed it);
        returns the decoded JSON answer; raises :class:`DynamoIndexerError` on an HTTP error."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(
                    self._connect_host, self.port, timeout=timeout or self.request_timeout)
            try:
                self._conn.request(method, path, body=data, headers=headers)
                response = self._conn.getresponse()
                payload = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._conn.close()
                self._conn = None
                if attempt or not self.running:
                    raise
        if response.status >= 300:
            raise DynamoIndexerError(f"{method} {path}: HTTP {response.status}: "
                                     f"{payload.decode(errors='replace')[:500]}")
        return json.loads(payload) if payload else None

    def _api(self, method: str, path: str, body: Any = None) -> Any:
        if self._proc is None:
            raise DynamoIndexerError("the indexer is not started")
        try:
            return self._request(method, path, body)
        except OSError as exc:
            raise DynamoIndexerError(
                f"{method} {path} failed ({exc}); the indexer "
                + ("is running" if self.running else f"exited: {self.output()}")) from exc

    def register(self, worker_id: int, endpoint: str, replay_endpoint: str | None,
                 block_size: int) -> None:
        """Subscribe the indexer to a worker's PUB ``endpoint`` (with its replay socket)."""
        body: dict[str, Any] = {"instance_id": worker_id, "endpoint": endpoint,
                                "block_size": block_size, "model_name": self.model_name}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._api("POST", "/register", body)

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: the registered workers as the indexer describes them."""
        out = self._api("GET", "/workers")
        assert isinstance(out, list)
        return out

    def query(self, token_ids: Sequence[int]) -> dict[int, int]:
        """Worker id → device-tier tokens of the longest prefix of ``token_ids`` it holds (the
        largest over its data-parallel ranks); workers holding nothing are absent."""
        self.num_queries += 1
        out = self._api("POST", "/query", {"token_ids": list(token_ids),
                                           "model_name": self.model_name})
        return {int(worker): max(ranks.values())
                for worker, ranks in out.get("scores", {}).items() if ranks}
