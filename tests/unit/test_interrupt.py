"""SIGINT / SIGTERM (``rlhf.trainers.interrupt``): the first only asks for a stop, the second stops at once; the
command lines exit with 128 + the signal and the run's message, no traceback. (A signalled real run that resumes
bit-identically: tests/integration/test_resume.py.)"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

from rlhf.config import SFTRunConfig
from rlhf.trainers.interrupt import RunInterrupted, StopSignals
from rlhf.trainers.kinds import kinds


@pytest.fixture
def guarded():
    """A SIGINT / SIGTERM that the code under test does not catch fails the test instead of ending pytest."""

    def unexpected(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the test's own handler")

    previous = {s: signal.signal(s, unexpected) for s in (signal.SIGINT, signal.SIGTERM)}
    yield unexpected
    for s, handler in previous.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_asks_the_second_stops_at_once(signum, code, guarded, capsys):
    with StopSignals("sft") as stop:
        os.kill(os.getpid(), signum)  # handled in this (main) thread before os.kill returns to the next line
        assert stop.requested and stop.signum == signum
        assert "stopping after the step in progress" in capsys.readouterr().err
        with pytest.raises(RunInterrupted) as second:
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("not stopped at once")
    assert second.value.at_once and second.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is guarded and signal.getsignal(signal.SIGTERM) is guarded  # restored
    assert RunInterrupted("m", signum).exit_code == code


def test_a_stopped_run_exits_with_128_plus_the_signal_and_its_message(tmp_path, capsys, monkeypatch):
    from rlhf.cli.common import run_cli

    def train(cfg):
        raise RunInterrupted("[sft] stopped by SIGTERM after step 3: checkpoint c; resume with: x", signal.SIGTERM)

    argv = ["model.path=/m", "data.train_path=/d", f"train.output_dir={tmp_path}"]
    assert run_cli(SFTRunConfig, train, "train_sft", argv) == 143
    out = capsys.readouterr()
    assert (
        out.err == "[sft] stopped by SIGTERM after step 3: checkpoint c; resume with: x\n"
        and "Traceback" not in out.out
    )


def test_every_trainer_names_the_command_that_resumes_it():
    for kind in kinds():
        assert importlib.util.find_spec(kind.cli_module) is not None
        assert kind.resume_command("/runs/a b") == (
            f"python -m {kind.cli_module} --config '/runs/a b/config.yaml' train.resume=true"
        )
