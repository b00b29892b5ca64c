"""Output directories never lose a run: a new directory when ``train.output_dir`` is not set; a directory holding a
run (finished or not) is refused unless ``train.resume`` or ``train.overwrite``; overwrite deletes every artifact
of the old run, TensorBoard events included, and nothing else. Run directories are made by the toolkit's own
writers (no training); the refusals happen before Ray starts, which the CLI tests check."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from rlhf.config.loader import load_config, save_config
from rlhf.config.schema import ConfigError, SFTRunConfig
from rlhf.trainers import output_dir as od
from rlhf.trainers.checkpoint import Checkpoints, RunCheckpoints
from rlhf.utils.metrics import RunWriters, read_metrics

USER_FILES = {"notes.txt": "my notes", "data/rows.jsonl": "{}\n"}


def _cfg(out, *extra):
    return load_config(
        SFTRunConfig, None, ["model.path=m", "data.train_path=d.jsonl", f"train.output_dir={out}", *extra]
    )


class _Saver:
    """Stands in for a worker group, a policy or a tokenizer: writes a file where it is told to save."""

    def save_checkpoint(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{id(self)}.bin"), "w") as f:
            f.write("state")

    def save_pretrained(self, directory, *options):  # a policy's takes merged=, a tokenizer's nothing
        self.save_checkpoint(directory)

    def placements(self):
        return [{"placement_group": "pg-0", "bundle": 0}]


def _write_run(out, finished=True, checkpoint=False, wandb=False, steps=(1,)):
    """A run directory as the toolkit's writers leave it: config.yaml, metrics/eval rows with TensorBoard events,
    optionally a checkpoint, final/, W&B files."""
    from rlhf.trainers.run import save_final

    cfg = _cfg(out, "logging.tensorboard=true", f"logging.wandb={'true' if wandb else 'false'}")
    os.makedirs(out, exist_ok=True)
    save_config(cfg, os.path.join(out, "config.yaml"))
    writers = RunWriters(cfg, resume_after=None, with_eval=True)
    for step in steps:
        writers.metrics.log({"step": step, "loss": 1.0 / step})
        writers.eval.log({"step": step, "loss": 0.5})
    writers.close()
    if checkpoint:
        Checkpoints(out, keep=2).save(steps[-1], {"policy": _Saver()}, {"identity": _identity(cfg)})
    if finished:
        save_final(_Saver(), _Saver(), out)
    return cfg


def _add_user_files(out):
    for name, text in USER_FILES.items():
        os.makedirs(os.path.dirname(os.path.join(out, name)) or out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            f.write(text)


def _snapshot(root):
    """Every file under ``root`` with its bytes and modification time."""
    found = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = (f.read(), os.stat(path).st_mtime_ns)
    return found


def _identity(cfg):
    return {"train.seed": cfg.train.seed}


def _prepared(cfg):
    """What a runner does before its first write: the checkpoints, then the output directory."""
    checkpoints = RunCheckpoints(cfg.train, _identity(cfg), "sft")
    checkpoints.prepare()
    od.prepare_output_dir(cfg, checkpoints)
    return checkpoints


# ------------------------------------------------------------------------------------------ a new directory


def test_an_empty_output_dir_gets_a_new_directory_chosen_once_and_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = od.claim_output_dir(_cfg(""), "sft")
    path = cfg.train.output_dir
    assert re.fullmatch(r"outputs/sft-\d{8}-\d{6}", path), path
    assert f"[sft] output directory: {path} (new: train.output_dir is not set)" in capsys.readouterr().out
    assert not os.path.exists(path)  # chosen, not created: a run that fails validation leaves nothing behind
    assert od.claim_output_dir(cfg, "sft") == cfg  # a set directory stays (what a restart of the invocation sees)


def test_a_new_directory_never_reuses_a_taken_name(tmp_path):
    now = 1_700_000_000.0
    first = od.new_output_dir("dpo", now=now, root=str(tmp_path))
    os.makedirs(first)
    second = od.new_output_dir("dpo", now=now, root=str(tmp_path))
    os.makedirs(second)
    assert second == first + "-2" and od.new_output_dir("dpo", now=now, root=str(tmp_path)) == first + "-3"


def test_resume_without_an_output_dir_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"^train\.output_dir must name the run to continue when train\.resume"):
        _cfg("", "train.resume=true")


def test_the_trainer_names_of_the_run_configs():
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.config.schema import DPORunConfig, RewardModelRunConfig
    from rlhf.trainers.kinds import kind_of

    configs = (SFTRunConfig, DPORunConfig, RewardModelRunConfig, RLRunConfig)
    names = {cls.__name__: kind_of(object.__new__(cls)).run_name for cls in configs}
    assert names == {"SFTRunConfig": "sft", "DPORunConfig": "dpo", "RewardModelRunConfig": "rm", "RLRunConfig": "rl"}


# ----------------------------------------------------------------------------------- what marks a run


def test_every_file_the_writers_leave_marks_the_run_and_overwrite_deletes_them_all(tmp_path, capsys):
    """Every writer of the toolkit (config, metrics + eval + TensorBoard, W&B, checkpoints and a half-written one,
    placement.json, final/ and its staging leftover, the report plot) and a user's own files: overwrite leaves
    exactly the user's files, and the new run's config.yaml."""
    pytest.importorskip("wandb")
    from rlhf.trainers.online.roles import write_placement

    out = str(tmp_path / "run")
    _write_run(out, checkpoint=True, wandb=True)
    os.makedirs(os.path.join(out, "checkpoints", "step_000002.tmp"))  # a crash mid-save
    os.makedirs(os.path.join(out, f".final.tmp-{os.getpid() + 1}"))  # a crash mid-save of final/
    write_placement({"policy": _Saver(), "rollout": _Saver()}, out)
    with open(os.path.join(out, "report.png"), "wb") as f:  # python -m rlhf.cli.report RUN
        f.write(b"\x89PNG")
    _add_user_files(out)
    written = set(os.listdir(out)) - {"notes.txt", "data"}
    assert {
        "config.yaml",
        "metrics.jsonl",
        "eval.jsonl",
        "tensorboard",
        "checkpoints",
        "final",
        "placement.json",
        "wandb",
        "wandb_run_id",
        "report.png",
    } <= written
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(out, "tensorboard")))
    assert set(od.run_artifacts(out, derived=True)) == written  # nothing the toolkit wrote goes unnoticed

    _prepared(_cfg(out, "train.overwrite=true"))
    assert "[sft] deleted the previous run in" in capsys.readouterr().out
    left = _snapshot(out)
    assert set(left) == {*USER_FILES, "config.yaml"}
    assert {name: left[name][0].decode() for name in USER_FILES} == USER_FILES


def test_a_users_own_files_do_not_make_a_run_and_their_config_yaml_is_never_replaced(tmp_path):
    out = tmp_path / "mine"
    _add_user_files(str(out))
    assert od.run_artifacts(str(out)) == []
    (out / "config.yaml").write_text("train:\n  lr: 0.1\n")  # the user's own, not one a run saved
    assert od.run_artifacts(str(out)) == []
    for flags in ((), ("train.overwrite=true",)):
        with pytest.raises(ConfigError, match=r"config\.yaml that no run wrote"):
            od.claim_output_dir(_cfg(out, *flags), "sft")
    assert (out / "config.yaml").read_text() == "train:\n  lr: 0.1\n"


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        od.claim_output_dir(_cfg(path), "sft")


# ------------------------------------------------------------------------------------ refused, allowed


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "unfinished"])
def test_a_directory_holding_a_run_is_refused_naming_both_keys_and_nothing_changes(finished, tmp_path):
    out = str(tmp_path / "run")
    _write_run(out, finished=finished, checkpoint=not finished)
    before = _snapshot(out)
    for attempt in (lambda cfg: od.claim_output_dir(cfg, "sft"), _prepared):
        with pytest.raises(ConfigError) as caught:
            attempt(_cfg(out))
        message = str(caught.value)
        assert message.startswith(f"train.output_dir: {out} holds a run (") and "config.yaml, " in message
        assert "train.resume=true" in message and "train.overwrite=true" in message
    assert _snapshot(out) == before


def test_resume_continues_a_run_with_a_checkpoint_and_deletes_nothing(tmp_path, capsys):
    out = str(tmp_path / "run")
    _write_run(out, finished=False, checkpoint=True, steps=(1, 2))
    before = _snapshot(out)
    cfg = od.claim_output_dir(_cfg(out, "train.resume=true"), "sft")
    assert "(continuing the run there: train.resume=true)" in capsys.readouterr().out
    checkpoints = _prepared(cfg)
    assert checkpoints.resuming
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k != "config.yaml"} == {
        k: v for k, v in before.items() if k != "config.yaml"
    }  # only the resolved config is written again


def test_resume_refuses_a_finished_run_it_could_only_train_again(tmp_path):
    out = str(tmp_path / "run")
    _write_run(out, finished=True, checkpoint=False)
    before = _snapshot(out)
    with pytest.raises(
        ConfigError,
        match=r"^train\.resume: .* finished and without a checkpoint for train\.resume="
        r"true to continue from; set train\.overwrite=true",
    ):
        od.claim_output_dir(_cfg(out, "train.resume=true"), "sft")
    assert _snapshot(out) == before
    _prepared(od.claim_output_dir(_cfg(out, "train.resume=true", "train.overwrite=true"), "sft"))  # both: start again
    assert od.run_artifacts(out) == ["config.yaml"]


def test_resume_without_a_checkpoint_starts_an_unfinished_run_over(tmp_path, capsys):
    out = str(tmp_path / "run")
    _write_run(out, finished=False, checkpoint=False, steps=(1, 2, 3))
    cfg = od.claim_output_dir(_cfg(out, "train.resume=true"), "sft")
    assert "has no checkpoint: it starts over from step 1" in capsys.readouterr().out
    checkpoints = _prepared(cfg)
    assert not checkpoints.resuming and od.run_artifacts(out) == ["config.yaml"]  # old logs and events gone


def test_the_saved_config_has_overwrite_spent(tmp_path):
    """Reloading a run's config.yaml (--config RUN/config.yaml) must not delete the run it is pointed at."""
    out = str(tmp_path / "run")
    _write_run(out)
    _prepared(_cfg(out, "train.overwrite=true", "train.seed=5"))
    saved = load_config(SFTRunConfig, os.path.join(out, "config.yaml"))
    assert saved.train.overwrite is False and saved.train.seed == 5 and saved.train.output_dir == out


def test_a_restart_before_the_first_checkpoint_starts_over_in_the_directory_it_owns(tmp_path, capsys):
    """train.on_failure=restart: the invocation claimed the directory once; its second attempt (resume=true, set by
    with_restarts) finds the first attempt's logs and no checkpoint, and starts over instead of being refused."""
    from rlhf.distributed.errors import WorkerError
    from rlhf.trainers.run import with_restarts

    out = str(tmp_path / "run")
    attempts = []

    def attempt(cfg):
        _prepared(cfg)
        writers = RunWriters(cfg, resume_after=None, with_eval=False)
        writers.metrics.log({"step": 1, "loss": float(len(attempts))})
        writers.close()
        attempts.append(cfg.train.resume)
        if len(attempts) == 1:
            raise WorkerError("policy rank 0 died during train_step")
        return "done"

    cfg = od.claim_output_dir(
        _cfg(out, "train.save_every=5", "train.on_failure=restart", "logging.tensorboard=true"), "sft"
    )
    assert with_restarts(cfg, attempt) == "done"
    assert attempts == [False, True] and "[restart 1/3]" in capsys.readouterr().out
    assert read_metrics(os.path.join(out, "metrics.jsonl")) == [{"step": 1, "loss": 1.0}]
    assert len(os.listdir(os.path.join(out, "tensorboard"))) == 1  # the failed attempt's events went with it


# ------------------------------------------------------------------------------------ through the CLIs


def test_the_sft_cli_refuses_before_ray_starts_and_leaves_the_run_untouched(tmp_path, monkeypatch, capsys):
    from rlhf.cli.common import run_cli
    from rlhf.trainers import context, run
    from rlhf.trainers.offline.sft import train_sft

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(run, "start_cluster", no_ray)
    monkeypatch.setattr(context, "init_ray", no_ray)
    out = str(tmp_path / "run")
    _write_run(out)
    before = _snapshot(out)
    rc = run_cli(
        SFTRunConfig, train_sft, "train_sft", ["model.path=m", "data.train_path=d.jsonl", f"train.output_dir={out}"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: train.output_dir: {out} holds a run")
    assert "train.resume=true" in err and "train.overwrite=true" in err
    assert _snapshot(out) == before


def test_the_rl_runner_refuses_before_reading_anything(tmp_path):
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.trainers.online.runner import train_ppo

    out = str(tmp_path / "run")
    _write_run(out)
    before = _snapshot(out)
    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        ["model.path=/no/model", "data.train_path=/no/prompts.jsonl", f"train.output_dir={out}"],
    )
    with pytest.raises(ConfigError, match=r"holds a run .*train\.resume=true.*train\.overwrite=true"):
        train_ppo(cfg)  # model.path does not exist: the claim comes first
    assert _snapshot(out) == before


def test_python_m_train_sft_into_a_finished_run_exits_2(tiny_model, sft_data, tmp_path):
    out = str(tmp_path / "run")
    _write_run(out)
    before = _snapshot(out)
    env = dict(os.environ, DS_ACCELERATOR="cpu", RAY_ADDRESS="")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf.cli.train_sft",
            "--config",
            "sft_tiny",
            f"model.path={tiny_model}",
            f"data.train_path={sft_data}",
            f"train.output_dir={out}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"error: train.output_dir: {out} holds a run" in proc.stderr and "Traceback" not in proc.stderr
    assert "train.overwrite=true" in proc.stderr
    assert _snapshot(out) == before


def test_the_cli_prints_the_new_directory_before_it_reads_anything(tmp_path, monkeypatch, capsys):
    from rlhf.cli.common import run_cli
    from rlhf.trainers.offline.sft import train_sft

    monkeypatch.chdir(tmp_path)
    rc = run_cli(SFTRunConfig, train_sft, "train_sft", ["model.path=/no/model", "data.train_path=d.jsonl"])
    captured = capsys.readouterr()
    assert rc == 2 and "model.path" in captured.err  # the missing model stops the run ...
    assert re.search(
        r"^\[sft\] output directory: outputs/sft-\d{8}-\d{6} \(new: train\.output_dir is not set\)$", captured.out, re.M
    )  # ... after the user was told where it would write
    assert not (tmp_path / "outputs").exists()


def test_a_checkpoint_identity_key_only_one_side_has_is_a_difference(tmp_path):
    """A setting in the identity only when it is on (an asynchronous run's rollout.max_staleness): resuming a k=1
    checkpoint with k=0, or a k=0 one with k=1, is refused, naming the key; the same identity resumes."""
    out = str(tmp_path / "run")
    cfg = _cfg(out, "train.resume=true")
    Checkpoints(out, keep=2).save(3, {"policy": _Saver()}, {"identity": {"train.seed": 42, "rollout.max_staleness": 1}})
    with pytest.raises(
        ConfigError, match=r"belongs to another run: rollout.max_staleness=1 in the checkpoint, None now"
    ):
        RunCheckpoints(cfg.train, {"train.seed": 42}, "rl").prepare()
    assert RunCheckpoints(cfg.train, {"train.seed": 42, "rollout.max_staleness": 1}, "rl").prepare() == 3
    Checkpoints(out, keep=2).save(4, {"policy": _Saver()}, {"identity": {"train.seed": 42}})
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=None in the checkpoint, 2 now"):
        RunCheckpoints(cfg.train, {"train.seed": 42, "rollout.max_staleness": 2}, "rl").prepare()
