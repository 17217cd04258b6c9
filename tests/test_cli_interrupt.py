"""Lost work: Ctrl-C ends a replay at its next step with one line and the partial results
(``--json`` marks them ``partial``); ``--plot`` is checked before the run; the plot's legend
covers no curve and says once which requests were skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcore.cli import main
from kvcore.sim.interrupt import INTERRUPTED, SigintStop
from kvcore.sim.replay import ReplayConfig, replay
from kvcore.sim.workloads import shared_prefix
from tests.factories import run_main

REPO = Path(__file__).resolve().parents[1]


def _interrupt_a_replay(*extra: str) -> tuple[int, str, str]:
    """``kvcore replay`` of the shipped trace in a process of its own, sent SIGINT once its replay
    loop runs (its progress bar is on stderr)."""
    # A user's terminal delivers Ctrl-C; a suite run as a background job inherits an ignored
    # SIGINT, which the command rightly keeps ignored: give the child the terminal's default.
    proc = subprocess.Popen([sys.executable, "-m", "kvcore.cli", "replay", "mooncake-synthetic",
                             "--block-size", "512", *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + 120
    while b"req/s]" not in seen and time.monotonic() < deadline:  # a bar with a rate: running
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk, "kvcore replay ended before it was interrupted"
        seen += chunk
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.decode(), (seen + err).decode()


def _last_lines(err: str) -> list[str]:
    """stderr without the progress bar's carriage-return updates."""
    return [line.rsplit("\r", 1)[-1] for line in err.splitlines() if line.rsplit("\r", 1)[-1]]


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_ctrl_c_prints_one_line_and_the_partial_results(as_json: bool) -> None:
    rc, out, err = _interrupt_a_replay("--policy", "lru", *(["--json"] if as_json else []))
    assert rc == INTERRUPTED and "Traceback" not in err
    notes = [line for line in _last_lines(err) if line.startswith("kvcore:")]
    assert len(notes) == 1 and notes[0].startswith(
        "kvcore: interrupted: partial results (the replay stopped after ")
    assert notes[0].endswith(" of 3,993 requests finished; --policy not run)")
    if as_json:
        data = json.loads(out)
        assert data["partial"] is True and data["replay"]["interrupted"] is True
        assert 0 <= data["replay"]["num_finished"] < data["requests"] == 3993
        assert "policies" not in data
    else:
        assert out.startswith("replayed mooncake-synthetic: ") and "token hit rate:" in out
        assert "of 3993 requests finished" in out and "3993 of 3993" not in out


def test_ctrl_c_during_the_policy_simulation_keeps_the_replay(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kvcore.sim.policies

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvcore.sim.policies, "hit_rate_curve", interrupted)
    rc, out, err = run_main(main, capsys, "replay", "--policy", "lru,belady", "--json")
    assert rc == INTERRUPTED
    data = json.loads(out)
    assert data["partial"] is True and data["replay"]["interrupted"] is False
    assert data["replay"]["num_finished"] == 128 and "policies" not in data
    assert err.strip() == ("kvcore: interrupted: partial results (the replay was complete; "
                           "--policy not run)")


def test_replay_stops_when_asked_and_says_so() -> None:
    trace = shared_prefix(num_groups=4, prompts_per_group=8, system_len=128, question_len=32,
                          output_len=16, interval_ms=1.0)
    cfg = ReplayConfig(block_size=16, num_blocks=200, max_num_seqs=4)
    full = replay(trace, cfg)
    calls = iter(range(1_000_000))
    part = replay(trace, cfg, should_stop=lambda: next(calls) >= 10)
    assert not full.interrupted and part.interrupted
    assert part.steps <= 10 and part.num_finished < full.num_finished == len(trace)


def test_cluster_replay_stops_when_asked() -> None:
    from kvcore.sim.cluster import ClusterConfig, replay_cluster

    trace = shared_prefix(num_groups=4, prompts_per_group=8, system_len=128, question_len=32,
                          output_len=16, interval_ms=1.0)
    calls = iter(range(1_000_000))
    part = replay_cluster(trace, ReplayConfig(block_size=16, num_blocks=200), ClusterConfig(2),
                          should_stop=lambda: next(calls) >= 10)
    assert part.interrupted and part.num_finished < len(trace)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are the main thread's")
def test_sigint_stop_records_the_first_ctrl_c_and_lets_the_second_through() -> None:
    # As at a terminal, even when the suite runs as a background job (SIGINT ignored).
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _first_ctrl_c_then_the_second()
    finally:
        signal.signal(signal.SIGINT, original)


def _first_ctrl_c_then_the_second() -> None:
    before = signal.getsignal(signal.SIGINT)
    stop = SigintStop()
    with stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs between bytecodes of this thread
        assert stop.requested and stop()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("plot, message", [
    ("missing-dir/curve.png", "--plot missing-dir/curve.png: directory missing-dir does not exist"),
    (".", "--plot .: is a directory, not a file"),
    ("curve.xyz", "--plot curve.xyz: matplotlib cannot write 'xyz' files (use one of "),
    ("", "--plot: the file name is empty"),
])
def test_plot_path_is_checked_before_the_run(plot: str, message: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import kvcore.sim.replay

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the replay ran before the plot path was checked")

    monkeypatch.setattr(kvcore.sim.replay, "replay", never)
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_main(main, capsys, "replay", "mooncake-synthetic", "--plot", plot)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"kvcore: error: {message}")
