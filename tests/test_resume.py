"""Exact resume: a run stopped at step k and resumed ends with the same weights and the same metrics.jsonl as
an uninterrupted run (fp32 on CPU: bit-identical), here with the stop mid-epoch and an epoch size (21 rows)
that is not a multiple of the global batch (4). Also: checkpoints are atomic and pruned, and a checkpoint of
another run is refused."""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from rlhf.config.loader import load_config
from rlhf.config.schema import ConfigError, DPORunConfig, SFTRunConfig
from rlhf.trainers.checkpoint import Checkpoints

pytestmark = pytest.mark.usefixtures("ray_session")

# Wall-clock measurements differ between any two runs; everything else must be identical.
TIMING_KEYS = ("step_time_s",)


def _overrides(model, data, out, *extra):
    # 21 rows / global batch 4 -> 5 steps per epoch (one row dropped per epoch), 2 epochs -> 10 steps.
    return [f"model.path={model}", f"data.train_path={data}", f"train.output_dir={out}",
            "train.global_batch_size=4", "train.micro_batch_size=1", "train.num_workers=2", "strategy.zero_stage=2",
            "train.max_epochs=2", "train.lr=1e-3", "train.warmup_steps=2", "train.seed=3", "data.max_length=64",
            "logging.tensorboard=false", *extra]


def _rows(out, name="metrics.jsonl"):
    with open(os.path.join(out, name)) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in f]


def _weights(final_dir):
    from safetensors.torch import load_file

    out = {}
    for path in glob.glob(os.path.join(final_dir, "*.safetensors")):
        out.update(load_file(path))
    return out


def _assert_identical(a_dir, b_dir, files=("metrics.jsonl",)):
    for name in files:
        assert _rows(a_dir, name) == _rows(b_dir, name), name
    a, b = _weights(os.path.join(a_dir, "final")), _weights(os.path.join(b_dir, "final"))
    assert a and set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def _stop_and_resume(cls, preset, train, base_overrides, out, stop_after):
    stopped = train(load_config(cls, preset, [*base_overrides(out), f"train.stop_after_steps={stop_after}",
                                              "train.save_every=3", "train.keep_checkpoints=1"]))
    assert stopped.stopped_at == stop_after and stopped.final_dir is None
    assert not os.path.exists(os.path.join(out, "final"))
    # keep_checkpoints=1: the periodic step-3 and step-6 checkpoints are gone, the stop's step-7 one stays
    assert [step for step, _ in Checkpoints(out, keep=1).complete()] == [stop_after]
    assert len(_rows(out)) == stop_after
    resumed = train(load_config(cls, preset, [*base_overrides(out), "train.resume=true", "train.save_every=3",
                                              "train.keep_checkpoints=1"]))
    assert resumed.final_dir and resumed.stopped_at is None
    return resumed


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


def _kill_a_worker_after(checkpoint_dir, role="policy"):
    """A thread that SIGKILLs one live TrainerWorker process once ``checkpoint_dir`` exists: a real crash.

    Ray titles an actor's process ``ray::TrainerWorker...``; the tests run one training at a time, so the live
    ones belong to this run."""
    import signal
    import threading
    import time

    import psutil

    killed = {}

    def watch():
        deadline = time.time() + 300
        while time.time() < deadline and not os.path.isdir(checkpoint_dir):
            time.sleep(0.05)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if (proc.info["cmdline"] or [""])[0].startswith("ray::TrainerWorker"):
                killed["pid"] = proc.info["pid"]
                os.kill(proc.info["pid"], signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


def test_a_killed_worker_restarts_from_the_checkpoint_and_ends_identical(sft_whole, tiny_model, sft_data,
                                                                         tmp_path, capsys):
    from rlhf.trainers.sft import train_sft

    out = str(tmp_path / "crash")
    thread, killed = _kill_a_worker_after(os.path.join(out, "checkpoints", "step_000004"))
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
    thread, killed = _kill_a_worker_after(os.path.join(out, "checkpoints", "step_000002"))
    with pytest.raises(WorkerError, match=r"policy rank [01] died during"):
        train_sft(load_config(SFTRunConfig, None, [*_overrides(tiny_model, sft_data, out), "train.save_every=2"]))
    thread.join(timeout=10)
    assert killed
    assert Checkpoints(out, keep=2).latest()[1]["step"] >= 2
    assert not os.path.exists(os.path.join(out, "final"))


def test_dpo_resumed_equals_uninterrupted_with_eval(tiny_model, pair_data, tmp_path):
    from rlhf.trainers.dpo import train_dpo

    def base(out):
        return _overrides(tiny_model, pair_data, out, f"data.eval_path={pair_data}", "train.eval_every=2",
                          "dpo.ref_mode=precompute")

    train_dpo(load_config(DPORunConfig, None, base(str(tmp_path / "whole"))))
    _stop_and_resume(DPORunConfig, None, train_dpo, base, str(tmp_path / "split"), stop_after=7)
    _assert_identical(str(tmp_path / "whole"), str(tmp_path / "split"), files=("metrics.jsonl", "eval.jsonl"))


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
