"""Exact resume: a run stopped at step k and resumed ends with the same weights and the same metrics.jsonl as
an uninterrupted run (fp32 on CPU: bit-identical), here with the stop mid-epoch and an epoch size (21 rows)
that is not a multiple of the global batch (4). Also: checkpoints are atomic and pruned, and a checkpoint of
another run is refused; a killed worker restarts (or exits) cleanly. (DPO: test_resume_dpo.py.)"""
from __future__ import annotations

import os

import pytest

from rlhf.config.loader import load_config
from rlhf.config.schema import ConfigError, SFTRunConfig
from rlhf.trainers.checkpoint import Checkpoints

from shared_helpers import kill_an_actor_once
from resume_helpers import _assert_identical, _overrides, _stop_and_resume

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def sft_whole(tiny_model, sft_data, tmp_path_factory):
    """The uninterrupted SFT run the interrupted ones are compared with."""
    from rlhf.trainers.sft import train_sft

    out = str(tmp_path_factory.mktemp("sft") / "whole")
    assert train_sft(load_config(SFTRunConfig, None, _overrides(tiny_model, sft_data, out))).steps == 10
    return out


def test_sft_resumed_mid_epoch_equals_uninterrupted(sft_whole, tiny_model, sft_data, tmp_path):
    from rlhf.trainers.sft import train_sft

    def base(out):
        return _overrides(tiny_model, sft_data, out)

    _stop_and_resume(SFTRunConfig, None, train_sft, base, str(tmp_path / "split"), stop_after=7)
    _assert_identical(sft_whole, str(tmp_path / "split"))


def test_a_killed_worker_restarts_from_the_checkpoint_and_ends_identical(sft_whole, tiny_model, sft_data,
                                                                         tmp_path, capsys):
    from rlhf.trainers.sft import train_sft

    out = str(tmp_path / "crash")
    thread, killed = kill_an_actor_once(os.path.join(out, "checkpoints", "step_000004"), "ray::TrainerWorker")
    result = train_sft(load_config(SFTRunConfig, None, [*_overrides(tiny_model, sft_data, out), "train.save_every=2",
                                                        "train.on_failure=restart"]))
    thread.join(timeout=10)
    assert killed, "the test never killed a worker"
    printed = capsys.readouterr().out
    assert "[restart 1/3] policy rank" in printed and "died during" in printed
    assert result.final_dir
    _assert_identical(sft_whole, out)


def test_a_killed_worker_with_on_failure_exit_names_it_and_keeps_the_checkpoint(tiny_model, sft_data, tmp_path):
    from rlhf.distributed.errors import WorkerError
    from rlhf.trainers.sft import train_sft

    out = str(tmp_path / "crash")
    thread, killed = kill_an_actor_once(os.path.join(out, "checkpoints", "step_000002"), "ray::TrainerWorker")
    with pytest.raises(WorkerError, match=r"policy rank [01] died during"):
        train_sft(load_config(SFTRunConfig, None, [*_overrides(tiny_model, sft_data, out), "train.save_every=2"]))
    thread.join(timeout=10)
    assert killed
    assert Checkpoints(out, keep=2).latest()[1]["step"] >= 2
    assert not os.path.exists(os.path.join(out, "final"))


def test_a_checkpoint_of_another_run_is_refused(tiny_model, sft_data, tmp_path):
    from rlhf.trainers.sft import train_sft

    out = str(tmp_path / "run")
    train_sft(load_config(SFTRunConfig, None, [*_overrides(tiny_model, sft_data, out), "train.stop_after_steps=2"]))
    with pytest.raises(ConfigError, match=r"train.resume: .*step_000002 belongs to another run: "
                                          r"train.global_batch_size=4 in the checkpoint, 8 now"):
        train_sft(load_config(SFTRunConfig, None, [*_overrides(tiny_model, sft_data, out), "train.resume=true",
                                                   "train.global_batch_size=8"]))


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
