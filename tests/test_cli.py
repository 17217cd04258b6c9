"""The ``kvcore`` console script: replay output, JSON, plots, bench pass-through, and bad input
reported in one line with exit status 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcore.cli import main
from kvcore.sim.traces import default_trace_path
from tests.factories import run_main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_main(main, capsys, *argv)


def test_replay_default_workload(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "replay")
    assert rc == 0, err
    assert "128 of 128 requests finished" in out and "token hit rate:  83.33%" in out


def test_replay_json_with_policies(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "replay", "--workload", "few-shot", "--json", "--policy", "lru,belady",
                     "--num-blocks", "200")
    assert rc == 0
    data = json.loads(out)
    assert data["num_blocks"] == 200 and data["replay"]["num_finished"] == 128
    assert set(data["policies"]) == {"lru", "belady"}
    assert data["policies"]["belady"] >= data["policies"]["lru"]
    assert 0 < data["replay"]["token_hit_rate"] <= data["ideal_hit_rate"] + 1e-9


def test_replay_eviction_policy_contract(capsys: pytest.CaptureFixture[str]) -> None:
    """`--eviction-policy NAME [--queue-hints DEPTH] --json` prints replay.token_hit_rate;
    `recommended` picks the README's policy and depth; `--queue-hints 0` turns hints off."""
    from kvcore.eviction import RECOMMENDED

    common = ("replay", "--workload", "multi-turn", "--num-blocks", "400", "--json")
    results = {}
    for extra in ((), ("--eviction-policy", "slru"), ("--eviction-policy", "s3fifo",
                                                      "--queue-hints", "8"),
                  ("--eviction-policy", "recommended"),
                  ("--eviction-policy", "recommended", "--queue-hints", "0"),
                  ("--eviction-policy", "belady"), ("--eviction-policy", "reuse_oracle")):
        rc, out, err = run(capsys, *common, *extra)
        assert rc == 0, err
        data = json.loads(out)
        assert data["replay"]["num_finished"] == 96
        results[extra] = data
    rate = {k: v["replay"]["token_hit_rate"] for k, v in results.items()}
    assert results[()]["eviction_policy"] == "lru" and results[()]["queue_hints"] == 0
    rec = results[("--eviction-policy", "recommended")]
    assert (rec["eviction_policy"], rec["queue_hints"]) == tuple(RECOMMENDED)
    off = results[("--eviction-policy", "recommended", "--queue-hints", "0")]
    assert (off["eviction_policy"], off["queue_hints"]) == (RECOMMENDED.policy, 0)
    assert results[("--eviction-policy", "s3fifo", "--queue-hints", "8")]["queue_hints"] == 8
    # Under this much pressure the offline bound beats LRU, and SLRU's scan resistance helps.
    assert rate[("--eviction-policy", "belady")] > rate[()]
    assert rate[("--eviction-policy", "slru")] > rate[()]
    assert rate[("--eviction-policy", "reuse_oracle")] >= rate[()]


def test_replay_progress_goes_to_stderr_with_json(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"  # more than 200 requests: the bar's threshold
    trace.write_text("".join(
        json.dumps({"timestamp": i, "input_length": 600, "output_length": 2,
                    "hash_ids": [i % 7, i]}) + "\n" for i in range(250)))
    rc, out, err = run(capsys, "replay", str(trace), "--block-size", "16", "--json",
                       "--policy", "lru,slru", "--num-blocks", "64")
    assert rc == 0, err
    json.loads(out)  # stdout stays pure JSON
    assert "replay" in err and "policies" in err  # the bars, on stderr


def test_plot_marks_the_offline_bound_and_leaves_out_skipped_capacities() -> None:
    from kvcore.sim.plots import plot_hit_rate_curves
    from kvcore.sim.policies import PolicyResult

    curves = {p: [PolicyResult(p, 4, 0, 0, 0, 10), PolicyResult(p, 64, 50, 100, 3, 2),
                  PolicyResult(p, 128, 60, 100, 1, 0)] for p in ("lru", "belady")}
    ax = plot_hit_rate_curves(curves, block_size=16, title="trace.jsonl")
    lines = {line.get_label(): line for line in ax.get_lines()}
    bound = next(line for label, line in lines.items() if label.startswith("belady"))
    assert "offline bound" in bound.get_label() and bound.get_linestyle() == "--"
    lru = next(line for label, line in lines.items() if label.startswith("lru"))
    assert lru.get_linestyle() == "-" and list(lru.get_xdata()) == [64 * 16, 128 * 16]
    assert ax.get_title() == "trace.jsonl"


def test_plot_legend_covers_no_curve_and_notes_skipped_requests_once() -> None:
    """The legend stands beside the axes (it used to sit on the Belady curve), and the requests
    skipped at small capacities are said once, not on every line."""
    from kvcore.sim.plots import plot_hit_rate_curves
    from kvcore.sim.policies import PolicyResult

    curves = {p: [PolicyResult(p, 4, 0, 0, 0, 10), PolicyResult(p, 64, 50 + 40 * (p == "belady"),
                                                                100, 3, 2),
                  PolicyResult(p, 128, 60 + 30 * (p == "belady"), 100, 1, 0)]
              for p in ("lru", "fifo", "lfu", "belady")}
    ax = plot_hit_rate_curves(curves, block_size=16, ideal=0.95)
    fig = ax.figure
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # outside the axes: over no data
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(labels) == 5 and not any("skipped" in label for label in labels)
    notes = [t.get_text() for t in ax.texts if "skipped" in t.get_text()]
    assert notes == ["requests larger than the cache skipped: 2 at 1,024 tokens"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_replay_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "curve.png"
    rc, out, _ = run(capsys, "replay", "--workload", "multi-turn", "--plot", str(png))
    assert rc == 0 and png.stat().st_size > 1000 and "plot written" in out


def test_replay_trace_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "replay", str(default_trace_path()), "--limit", "200",
                     "--block-size", "512", "--json")
    assert rc == 0 and json.loads(out)["replay"]["num_requests"] == 200


def test_replay_the_shipped_trace_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # any directory: the trace is package data
    monkeypatch.delenv("KVCORE_MOONCAKE_TRACE", raising=False)
    rc, out, err = run(capsys, "replay", "mooncake-synthetic", "--limit", "50", "--block-size",
                       "512", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["source"] == "mooncake-synthetic" and data["replay"]["num_requests"] == 50


@pytest.mark.parametrize("argv, message", [
    (("replay", "missing.jsonl"), "trace file not found"),
    (("replay", ""), "trace file path is empty"),
    (("replay", "."), "trace file is a directory"),
    (("replay", "--capacity-tokens", "-5"), "positive integer"),
    (("replay", "--num-blocks", "0"), "positive integer"),
    (("replay", "--policy", "mru"), "unknown eviction policy"),
    (("replay", "--eviction-policy", "mru"), "unknown eviction policy 'mru'"),
    (("replay", "--eviction-policy", "slru:protected_share=7"), "protected_share"),
    (("replay", "--queue-hints", "-1"), "must be an integer >= 0, got '-1'"),
    (("replay", "--workload", "nope"), "unknown workload"),
    (("replay", "--num-blocks", "10", "--capacity-tokens", "100"), "not allowed with"),
    (("frobnicate",), "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                      message: str) -> None:
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_malformed_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\nnope\n')
    rc, _, err = run(capsys, "replay", str(bad))
    assert rc == 2 and "bad.jsonl:2: malformed" in err


def test_bench_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "bench", "--no-peer", "pool", "--pool-sizes", "1000",
                     "--batch-sizes", "16", "--repeats", "1")
    assert rc == 0 and "BlockPool: ns per block" in out and "alloc+free" in out


def test_console_script_help() -> None:
    exe = shutil.which("kvcore", path=str(Path(sys.executable).parent))
    assert exe is not None, "the kvcore console script is not installed"
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    assert "replay" in res.stdout and "bench" in res.stdout and "examples:" in res.stdout
