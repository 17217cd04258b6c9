"""``kvcore replay TRACE`` on malformed Mooncake traces: one line on stderr,
``kvcore: error: <path>:<line>: <what is wrong>``, exit status 2 -- never a hang, never a traceback
-- and :func:`~kvcore.sim.replay.replay` refusing arrival times that would stall its clock."""

from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvcore.errors import InvalidArgumentError
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.traces import HashIdTokens, TraceRequest, load_mooncake
from tests.test_cli import run

T = TypeVar("T")

GOOD = b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'


def record(**fields: Any) -> bytes:
    """A good record with ``fields`` replaced (or removed, for the value ``...``)."""
    rec: dict[str, Any] = {"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}
    rec.update(fields)
    return json.dumps({k: v for k, v in rec.items() if v is not ...}).encode()


def raw(text: str) -> bytes:
    """A record written by hand (for what json.dumps would not write: NaN, 1e400, ...)."""
    return text.encode()


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()``, failing the test (not hanging it) if it runs longer than ``seconds``."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            result["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s (a replay that never ends?)"
    if "error" in result:
        raise result["error"]
    value: T = result["value"]
    return value


# (case id, bad line, physical lines before it, phrase the error must contain)
BAD_LINES: list[tuple[str, bytes, int, str]] = [
    ("not-json", b"nope", 1, "malformed record: invalid JSON"),
    ("truncated-json", GOOD[:-5], 0, "malformed record: invalid JSON"),
    ("json-list", b"[1, 2]", 0, "expected a JSON object, got [1, 2]"),
    ("json-number", b"5", 1, "expected a JSON object, got 5"),
    ("json-null", b"null", 0, "expected a JSON object, got null"),
    ("json-string", b'"hello"', 1, 'expected a JSON object, got "hello"'),
    ("invalid-utf8", b'{"timestamp": 0, "x": "\xff\xfe"}', 1, "invalid UTF-8"),
    ("deeply-nested", b"[" * 100_000 + b"]" * 100_000, 1, "nested too deeply"),
    ("int-over-digit-limit", raw('{"timestamp": 1' + "0" * 5000 + "}"), 0, "invalid JSON"),
    ("missing-timestamp", record(timestamp=...), 1, "missing field 'timestamp'"),
    ("missing-output-length", record(output_length=...), 0, "missing field 'output_length'"),
    ("missing-hash-ids", record(hash_ids=...), 1, "missing field 'hash_ids'"),
    ("timestamp-nan", raw('{"timestamp": NaN, "input_length": 5, "output_length": 1, '
                          '"hash_ids": [1]}'), 0, "timestamp must be a finite number >= 0"),
    ("timestamp-infinity", raw('{"timestamp": Infinity, "input_length": 5, "output_length": 1, '
                               '"hash_ids": [1]}'), 1, "timestamp must be a finite number"),
    ("timestamp-1e400", raw('{"timestamp": 1e400, "input_length": 5, "output_length": 1, '
                            '"hash_ids": [1]}'), 1, "timestamp must be a finite number"),
    ("timestamp-huge-int", raw('{"timestamp": 1' + "0" * 400 + ', "input_length": 5, '
                               '"output_length": 1, "hash_ids": [1]}'), 1, "timestamp 1000"),
    ("timestamp-negative", record(timestamp=-1.5), 1, "timestamp must be a finite number >= 0 "
                                                       "(ms), got -1.5"),
    ("timestamp-string", record(timestamp="12"), 0, 'timestamp must be a finite number >= 0 '
                                                     '(ms), got "12"'),
    ("timestamp-bool", record(timestamp=True), 1, "timestamp must be a finite number >= 0 "
                                                   "(ms), got true"),
    ("timestamp-null", record(timestamp=None), 1, "timestamp must be a finite number >= 0 "
                                                   "(ms), got null"),
    ("input-length-float", record(input_length=5.7), 1, "input_length must be an integer >= 1, "
                                                         "got 5.7"),
    ("input-length-integral-float", record(input_length=5.0), 0, "input_length must be an "
                                                                  "integer >= 1, got 5.0"),
    ("input-length-string", record(input_length="12"), 1, 'input_length must be an integer >= 1, '
                                                           'got "12"'),
    ("input-length-bool", record(input_length=True), 1, "input_length must be an integer >= 1, "
                                                         "got true"),
    ("input-length-zero", record(input_length=0, hash_ids=[]), 1, "input_length must be an "
                                                                   "integer >= 1, got 0"),
    ("output-length-negative", record(output_length=-1), 1, "output_length must be an integer "
                                                             ">= 0, got -1"),
    ("output-length-float", record(output_length=1.5), 0, "output_length must be an integer "
                                                           ">= 0, got 1.5"),
    ("output-length-bool", record(output_length=False), 1, "output_length must be an integer "
                                                            ">= 0, got false"),
    ("hash-ids-not-a-list", record(hash_ids="1"), 1, 'hash_ids must be a list of integers, '
                                                      'got "1"'),
    ("hash-ids-string-item", record(hash_ids=["3"]), 1, 'hash_ids[0] must be an integer, got "3"'),
    ("hash-ids-float-item", record(input_length=600, hash_ids=[1, 1.5]), 1,
     "hash_ids[1] must be an integer, got 1.5"),
    ("hash-ids-bool-item", record(hash_ids=[True]), 0, "hash_ids[0] must be an integer, got true"),
    ("hash-ids-too-few", record(input_length=1000, hash_ids=[1]), 1,
     "input_length 1000 needs 2 hash ids"),
    ("hash-ids-too-many", record(input_length=5, hash_ids=[1, 2]), 1,
     "input_length 5 needs 1 hash ids"),
]


def write_bad(tmp_path: Path, bad: bytes, before: int) -> tuple[Path, int]:
    """A trace whose line ``before + 1`` is ``bad``, after ``before`` good lines."""
    lines = [GOOD] * before
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join([*lines, bad]) + b"\n")
    return path, before + 1


@pytest.mark.parametrize("bad, before, phrase", [c[1:] for c in BAD_LINES],
                         ids=[c[0] for c in BAD_LINES])
def test_malformed_line_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           bad: bytes, before: int, phrase: str) -> None:
    path, lineno = write_bad(tmp_path, bad, before)
    rc, out, err = within(60, lambda: run(capsys, "replay", str(path), "--no-progress"))
    assert rc == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvcore: error: {path}:{lineno}: "), err
    assert phrase in err, err
    assert out == ""


def test_line_numbers_count_blank_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD + b"\n\n  \t\n" + record(output_length=-3) + b"\n")
    rc, _, err = run(capsys, "replay", str(path))
    assert rc == 2 and f"{path}:4: output_length" in err
    path.write_bytes(GOOD + b"\n\n  \r\n" + GOOD + b"\r\n\n")  # blank lines and CRLF are fine
    assert len(load_mooncake(path)) == 2


def test_extra_fields_and_bom_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + record(model="x", extra={"a": [1]}) + b"\n" + GOOD)
    r0, _ = load_mooncake(path)
    assert (r0.num_prompt_tokens, r0.output_len, r0.hash_ids) == (5, 1, (1,))
    assert r0.arrival_ms == 0.0 and isinstance(r0.arrival_ms, float)


@pytest.mark.parametrize("content, phrase", [
    (b"", "the trace has no requests"),
    (b"\n   \n\n", "the trace has no requests"),
])
def test_empty_trace_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes,
                               phrase: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    rc, _, err = run(capsys, "replay", str(path))
    assert rc == 2 and err == f"kvcore: error: {path}: {phrase}\n"


def test_directory_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "replay", str(tmp_path))
    assert rc == 2 and err == f"kvcore: error: trace file is a directory: {tmp_path}\n"


def test_unreadable_file_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD)

    def denied(self: Path, *args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "open", denied)  # works as root too, unlike chmod
    rc, _, err = run(capsys, "replay", str(path))
    assert rc == 2 and err == f"kvcore: error: cannot read trace file {path}: Permission denied\n"


def test_nan_timestamp_is_refused_quickly(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD + b"\n" + raw('{"timestamp": NaN, "input_length": 5, '
                                        '"output_length": 1, "hash_ids": [1]}'))
    with pytest.raises(InvalidArgumentError, match=r":2: timestamp .* got NaN"):
        within(30, lambda: load_mooncake(path))


def _request(rid: str, arrival_ms: float, n_in: int = 5, n_out: int = 1) -> TraceRequest:
    return TraceRequest(rid, arrival_ms, n_in, n_out, prompt=tuple(range(max(n_in, 0))))


@pytest.mark.parametrize("bad, match", [
    (_request("r1", float("nan")), "arrival_ms must be a finite number >= 0, got nan"),
    (_request("r1", float("inf")), "arrival_ms .* got inf"),
    (_request("r1", -1.0), "arrival_ms .* got -1.0"),
    (_request("r1", 10**400), "arrival_ms"),
    (_request("r1", 0.0, n_out=-1), "output_len must be an integer >= 0, got -1"),
    (_request("r1", 0.0, n_in=-2), "num_prompt_tokens must be an integer >= 0, got -2"),
])
def test_replay_refuses_requests_that_would_stall(bad: TraceRequest, match: str) -> None:
    # A NaN arrival used to make the replay loop forever: the clock never reached it.
    with pytest.raises(InvalidArgumentError, match=match):
        within(30, lambda: replay([_request("r0", 0.0), bad], ReplayConfig(num_blocks=64)))


@pytest.mark.parametrize("field", ["time_scale", "step_base_ms", "step_ms_per_token"])
def test_replay_refuses_a_stalling_time_model(field: str) -> None:
    cfg = ReplayConfig(num_blocks=64)
    setattr(cfg, field, float("nan"))
    with pytest.raises(InvalidArgumentError, match=f"{field} must be a finite number"):
        within(30, lambda: replay([_request("r0", 0.0), _request("r1", 5.0)], cfg))


def test_non_monotone_timestamps_are_replayed(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    stamps = [50, 0, 12.5, 3]
    path.write_bytes(b"\n".join(record(timestamp=t, input_length=600, hash_ids=[7, i])
                                for i, t in enumerate(stamps)))
    reqs = load_mooncake(path)
    assert [r.arrival_ms for r in reqs] == [50.0, 0.0, 12.5, 3.0]  # file order, as documented
    result = within(60, lambda: replay(reqs, ReplayConfig(block_size=16, num_blocks=256)))
    assert result.num_finished == 4
    rc, out, err = run(capsys, "replay", str(path), "--json", "--block-size", "16")
    assert rc == 0, err
    assert json.loads(out)["replay"]["num_finished"] == 4


def test_hash_id_tokens_accept_any_json_int() -> None:
    # Negative and huge hash ids are valid JSON integers; token generation must not overflow.
    src = HashIdTokens()
    assert len(src.block(-1)) == 512 and len(src.block(10**30)) == 512


def test_a_request_longer_than_the_model_length_is_refused_before_its_tokens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A line whose hash ids imply a 102,400,000-token prompt: one line naming the line and the
    model length, exit 2, at once (its tokens would need gigabytes)."""
    ids = list(range(200_000))
    trace = tmp_path / "huge.jsonl"
    trace.write_bytes(GOOD + b"\n" + record(input_length=102_400_000, hash_ids=ids) + b"\n")
    rc, out, err = within(20, lambda: run(capsys, "replay", str(trace)))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "huge.jsonl:2: request of 102,400,000 prompt + 1 output tokens is longer than the " \
           "model length (max_model_len 1,048,576)" in err
    # --max-model-len moves the limit; a request that fits it exactly is accepted.
    fits = tmp_path / "fits.jsonl"
    fits.write_bytes(record(input_length=1023, output_length=1, hash_ids=[1, 2]) + b"\n")
    rc, _, err = run(capsys, "replay", str(fits), "--max-model-len", "1024", "--json")
    assert rc == 0, err
    rc, _, err = run(capsys, "replay", str(fits), "--max-model-len", "1023")
    assert rc == 2 and "fits.jsonl:1: request of 1,023 prompt + 1 output tokens" in err


def test_load_mooncake_max_model_len(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(GOOD + b"\n" + record(input_length=600, output_length=0,
                                            hash_ids=[1, 2]) + b"\n")
    assert len(load_mooncake(trace, max_model_len=601)) == 2  # output 0 still makes one token
    with pytest.raises(InvalidArgumentError, match=r"t\.jsonl:2: .*max_model_len 600"):
        load_mooncake(trace, max_model_len=600)
    with pytest.raises(InvalidArgumentError, match="max_model_len must be an int >= 2, got 1"):
        load_mooncake(trace, max_model_len=1)


class _NoTokens(HashIdTokens):
    def tokens(self, hash_ids: Any, num_tokens: int) -> list[int]:
        raise AssertionError(f"made the tokens of a {num_tokens}-token prompt")


@pytest.mark.parametrize("policy", ["lru", "belady"])
def test_replay_rejects_an_overlong_request_without_making_its_tokens(policy: str) -> None:
    huge = TraceRequest("huge", 0.0, 102_400_000, 1, hash_ids=tuple(range(200_000)),
                        source=_NoTokens())
    small = TraceRequest("small", 1.0, 40, 2, prompt=tuple(range(40)))
    result = replay([huge, small], ReplayConfig(max_model_len=4096, eviction_policy=policy))
    assert (result.num_rejected, result.num_finished) == (1, 1)
