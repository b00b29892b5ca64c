"""Exact resume: a run stopped at step k and resumed ends with the same weights and the same metrics.jsonl as
an uninterrupted run (fp32 on CPU: bit-identical), here with the stop mid-epoch and an epoch size (21 rows)
that is not a multiple of the global batch (4). Also: checkpoints are atomic and pruned, and a checkpoint of
another run is refused; a killed worker restarts (or exits) cleanly; a SIGTERM checkpoints the step in progress and
the command it prints resumes the run exactly. (DPO: test_resume_dpo.py.)

Actor start-up is most of a run's seconds here, so runs are shared: the stopped-and-resumed run also has a worker
killed after its resume (it restarts from its newest checkpoint and still ends as the uninterrupted run),
and the checkpoint left by the run killed with ``train.on_failure=exit`` is the one a resume of another run's
config is refused.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import threading
import time

import pytest
from resume_helpers import _assert_identical, _overrides, _stop_and_resume
from shared_helpers import kill_an_actor_once, run_main, tee_stdout

from rlhf.config.loader import load_config
from rlhf.config.schema import ConfigError, SFTRunConfig
from rlhf.distributed.errors import WorkerError
from rlhf.trainers.checkpoint import Checkpoints

pytestmark = pytest.mark.usefixtures("ray_session")

# the run killed with train.on_failure=exit (and the refused resume of its checkpoint): one rank is enough to kill
ONE_RANK = ("train.num_workers=1",)


@pytest.fixture(scope="module")
def sft_whole(tiny_model, sft_data, tmp_path_factory):
    """The uninterrupted SFT run the interrupted ones are compared with."""
    from rlhf.trainers.offline.sft import train_sft

    out = str(tmp_path_factory.mktemp("sft") / "whole")
    assert train_sft(load_config(SFTRunConfig, None, _overrides(tiny_model, sft_data, out))).steps == 10
    return out


@pytest.fixture(scope="module")
def sft_split(tiny_model, sft_data, tmp_path_factory):
    """Stopped at step 7 (mid-epoch 2) and resumed (``_stop_and_resume``: checkpoints every 3 steps, one kept). In
    the resumed part, with ``train.on_failure=restart``, a worker is SIGKILLed once the step-9 checkpoint exists: the
    run restarts from it with new actors and finishes. Returns the output directory, whether a worker was killed,
    what the driver printed and the run's result."""
    from rlhf.trainers.offline.sft import train_sft

    out = str(tmp_path_factory.mktemp("sft") / "split")

    def base(directory):
        return [*_overrides(tiny_model, sft_data, directory), "train.on_failure=restart"]

    thread, killed = kill_an_actor_once(os.path.join(out, "checkpoints", "step_000009"), "ray::TrainerWorker")
    with tee_stdout() as printed:
        result = _stop_and_resume(SFTRunConfig, None, train_sft, base, out, stop_after=7)
    thread.join(timeout=10)
    return out, killed, printed.getvalue(), result


def test_sft_resumed_mid_epoch_equals_uninterrupted(sft_whole, sft_split):
    out, _, _, _ = sft_split
    _assert_identical(sft_whole, out)


def test_a_killed_worker_restarts_from_the_checkpoint_and_ends_identical(sft_whole, sft_split):
    """The worker killed in the stopped-and-resumed run above: the restart is said, and the run still ends with
    the uninterrupted run's rows and bit-identical weights."""
    out, killed, printed, result = sft_split
    assert killed, "the test never killed a worker"
    assert "[restart 1/3] policy rank" in printed and "died during" in printed
    assert result.final_dir
    _assert_identical(sft_whole, out)


def _signal_after(metrics_path: str, rows: int, signum: int) -> threading.Thread:
    """Send ``signum`` to this process once ``metrics_path`` holds ``rows`` rows (a step in progress after them)."""

    def wait_then_signal():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.exists(metrics_path):
                with open(metrics_path) as f:
                    if sum(1 for _ in f) >= rows:
                        break
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.start()
    return thread


def test_sigterm_checkpoints_the_step_and_the_printed_command_resumes_it_identically(
    sft_whole, tiny_model, sft_data, tmp_path, capsys, monkeypatch
):
    """SIGTERM (what SLURM and Kubernetes send before a kill) mid-run, through the command line: the step in progress
    ends, its checkpoint is written, the last line is the resume command and the exit status 143, no traceback.
    The printed command, run as it stands, ends with the uninterrupted run's rows and bit-identical weights."""

    def unhandled(signum, frame):  # the run must handle it; reaching this fails the test instead of ending pytest
        raise AssertionError("SIGTERM reached the test's own handler")

    previous = signal.signal(signal.SIGTERM, unhandled)
    out = str(tmp_path / "signalled")
    try:
        thread = _signal_after(os.path.join(out, "metrics.jsonl"), 3, signal.SIGTERM)
        rc, printed, err = run_main(
            "rlhf.cli.train_sft", _overrides(tiny_model, sft_data, out), tmp_path, capsys, monkeypatch
        )
        thread.join(timeout=10)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert rc == 143 and "Traceback" not in printed + err, err
    stopped = re.search(
        r"\[sft\] stopped by SIGTERM after step (\d+): checkpoint (\S+); resume with: (.+)$", err.strip()
    )
    assert stopped, err
    step, checkpoint, command = int(stopped.group(1)), stopped.group(2), stopped.group(3)
    assert 3 <= step < 10 and checkpoint.endswith(f"step_{step:06d}") and os.path.isdir(checkpoint)
    assert not os.path.exists(os.path.join(out, "final"))
    python, dash_m, module, *argv = shlex.split(command)
    assert (python, dash_m, module) == ("python", "-m", "rlhf.cli.train_sft")
    rc, printed, err = run_main(module, argv, tmp_path, capsys, monkeypatch)
    assert rc == 0, err
    assert f"resumed from {checkpoint} (step {step})" in printed
    _assert_identical(sft_whole, out)


@pytest.fixture(scope="module")
def sft_exited(tiny_model, sft_data, tmp_path_factory):
    """On one rank (its only worker is the one killed; a rank fewer to start), the worker SIGKILLed once the step-2
    checkpoint exists, ``train.on_failure=exit`` (the default): returns the output directory, the error the run
    ended with and whether a worker was killed."""
    from rlhf.trainers.offline.sft import train_sft

    out = str(tmp_path_factory.mktemp("sft") / "crash")
    thread, killed = kill_an_actor_once(os.path.join(out, "checkpoints", "step_000002"), "ray::TrainerWorker")
    error = None
    try:
        train_sft(
            load_config(SFTRunConfig, None, [*_overrides(tiny_model, sft_data, out, *ONE_RANK), "train.save_every=2"])
        )
    except WorkerError as exc:
        error = exc
    thread.join(timeout=10)
    return out, error, killed


def test_a_killed_worker_with_on_failure_exit_names_it_and_keeps_the_checkpoint(sft_exited):
    out, error, killed = sft_exited
    assert isinstance(error, WorkerError), "the run did not fail with a WorkerError"
    assert re.search(r"policy rank 0 died during", str(error)), str(error)
    assert killed
    assert Checkpoints(out, keep=2).latest()[1]["step"] >= 2
    assert not os.path.exists(os.path.join(out, "final"))


def test_a_checkpoint_of_another_run_is_refused(sft_exited, tiny_model, sft_data):
    """The killed run's newest checkpoint, resumed with another global batch (and its one rank, so that the batch
    is the one difference): refused before anything starts."""
    from rlhf.trainers.offline.sft import train_sft

    out, _, _ = sft_exited
    newest = os.path.basename(Checkpoints(out, keep=2).latest()[0])
    with pytest.raises(
        ConfigError,
        match=rf"train.resume: .*{newest} belongs to another run: "
        r"train.global_batch_size=4 in the checkpoint, 8 now",
    ):
        train_sft(
            load_config(
                SFTRunConfig,
                None,
                [
                    *_overrides(tiny_model, sft_data, out, *ONE_RANK),
                    "train.resume=true",
                    "train.global_batch_size=8",
                ],
            )
        )


def test_half_written_checkpoints_are_never_picked(tmp_path):
    store = Checkpoints(str(tmp_path), keep=2)

    class Group:
        def __init__(self, fail=False):
            self.fail = fail

        def save_checkpoint(self, directory):
            os.makedirs(directory)
            if self.fail:
                raise RuntimeError("disk full")

    store.save(1, {"policy": Group()}, {"x": 1})
    with pytest.raises(RuntimeError, match="disk full"):
        store.save(2, {"policy": Group(fail=True)}, {"x": 2})
    path, state = store.latest()
    assert path.endswith("step_000001") and state == {"x": 1, "step": 1}
    assert os.path.isdir(path + "/../step_000002.tmp")  # left behind by the crash, ignored ...
    store.remove_partial()
    assert not os.path.exists(os.path.join(store.root, "step_000002.tmp"))  # ... and cleaned on the next start
    for step in (2, 3, 4):
        store.save(step, {"policy": Group()}, {})
    assert [s for s, _ in store.complete()] == [3, 4]
