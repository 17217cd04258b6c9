"""CPU threads: the engine picks a sane torch thread count by default (the idle cores' share,
at least one) and respects an explicit setting (``cpu_threads`` / ``--threads``, else
``OMP_NUM_THREADS``); ``runner.generate --help`` describes every option with its default."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

import runner.threads as threads
from runner.engine import LLM
from runner.threads import auto_cpu_threads, resolve_cpu_threads


@pytest.fixture(autouse=True)
def keep_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def tiny() -> Any:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1,
                                    vocab_size=300, max_position_embeddings=64)


@pytest.mark.parametrize(("cpus", "load", "world", "want"), [
    (2, 4.0, 1, 1),  # a busy 2-core machine: one thread, not two spinning on each other
    (2, 0.1, 1, 2),
    (16, 3.2, 1, 13),
    (16, 0.0, 2, 8),  # two ranks share the cores
    (4, 10.0, 2, 1),
    (1, 0.0, 1, 1),
])
def test_auto_threads_are_the_idle_cores_share(cpus: int, load: float, world: int,
                                               want: int) -> None:
    assert auto_cpu_threads(cpus, load, world) == want


def test_an_explicit_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    monkeypatch.setattr(threads, "busy_cpus", lambda: 6.0)
    assert resolve_cpu_threads(None, env={}) == 2
    assert resolve_cpu_threads(5, env={"OMP_NUM_THREADS": "3"}) == 5
    assert resolve_cpu_threads(None, env={"OMP_NUM_THREADS": "3"}) is None  # torch read it


def test_the_cpu_engine_sets_its_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "busy_cpus", lambda: 5.0)
    torch.set_num_threads(2)
    LLM(tiny(), device="cpu", num_blocks=8, block_size=4)
    assert torch.get_num_threads() == 1  # busy: the default chose one
    LLM(tiny(), device="cpu", num_blocks=8, block_size=4, cpu_threads=2)
    assert torch.get_num_threads() == 2  # explicit
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    LLM(tiny(), device="cpu", num_blocks=8, block_size=4)
    assert torch.get_num_threads() == 2  # left alone


def test_engines_built_by_the_tests_leave_the_thread_count_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's tests run on one torch thread count whatever the load (tests/runner/
    conftest.py): an engine built on a busy or an idle machine leaves the process's count as it
    was, so the summation order of every later comparison does not follow the load."""
    before = torch.get_num_threads()
    for load in (5.0, 0.0):
        monkeypatch.setattr(threads, "busy_cpus", lambda load=load: load)
        LLM(tiny(), device="cpu", num_blocks=8, block_size=4)
        assert torch.get_num_threads() == before, load


def test_generate_help_describes_every_option_with_its_default(
        capsys: pytest.CaptureFixture[str]) -> None:
    from runner.generate import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1].split("\n\n", 1)[0]
    blocks = re.split(r"\n(?=  -)", options.strip("\n"))
    assert len(blocks) >= 14
    for block in blocks:
        name = block.split()[0]
        if name.startswith("-h"):
            continue
        described = re.sub(r"^\s*--\S+( [A-Z_{},a-z]+)?", "", block, count=1).strip()
        assert "(default:" in described and len(described.split("(default:")[0]) > 5, block
    assert "--threads" in text


def test_generate_takes_threads(capsys: pytest.CaptureFixture[str]) -> None:
    from runner.generate import main

    assert main(["--max-tokens", "2", "--prompt", "ab", "--threads", "1"]) == 0
    assert "1 CPU thread(s)" in capsys.readouterr().out and torch.get_num_threads() == 1
