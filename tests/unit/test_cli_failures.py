"""A run-time failure ends the CLI in one line naming who failed, where and why, with its traceback in
``train.output_dir/error.log`` (issue #37, item 5); bad input keeps its exit status 2."""

from __future__ import annotations

import pytest

from rlhf.cli.common import run_cli
from rlhf.config.schema import SFTRunConfig
from rlhf.distributed.errors import WorkerError, cause_line
from rlhf.envs.base import EnvError
from rlhf.trainers.run import failure_at

# what Ray puts in a dead actor's message when its constructor raised: vLLM's reason is the last line
RAY_CREATION_DEATH = """The actor died because of an error raised in its creation task, ray::RolloutEngine.__init__() \
(pid=123, ip=127.0.0.1, actor_id=abc)
  File "/x/rlhf/rollout/vllm/engine.py", line 80, in __init__
    self.llm = LLM(**kwargs)
  File "/x/vllm/config.py", line 900, in __post_init__
    raise ValueError(
ValueError: User-specified max_model_len (1124) is greater than the derived max_model_len (512). To allow \
overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"""


def _cli(tmp_path, failure):
    def train(cfg):
        with failure_at("rl step 3"):
            raise failure

    argv = ["model.path=/m", "data.train_path=/d", f"train.output_dir={tmp_path}"]
    return run_cli(SFTRunConfig, train, "train_ppo", argv)


def test_a_dead_engine_is_one_line_with_vllms_reason_the_step_and_the_traceback(tmp_path, capsys):
    cause = RuntimeError(RAY_CREATION_DEATH)
    failure = WorkerError(f"rollout engine 0 died during generate: {cause_line(cause)}")
    failure.__cause__ = cause
    assert _cli(tmp_path, failure) == 1
    err = capsys.readouterr().err
    assert err == (
        "error: rollout engine 0 died during generate: ValueError: User-specified max_model_len (1124) is greater than "
        "the derived max_model_len (512). To allow overriding this maximum, set the env var "
        f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (rl step 3; traceback: {tmp_path}/error.log)\n"
    )
    saved = (tmp_path / "error.log").read_text()
    assert "ray::RolloutEngine.__init__()" in saved and "Traceback" in saved  # the whole chain, cause included


def test_an_agent_failure_keeps_its_own_step_episode_and_cause(tmp_path, capsys):
    failure = EnvError("RL step 3: agent 'a.py:run' raised KeyError: 'a' (episode 5)", "a.py:run", 5)
    assert _cli(tmp_path, failure) == 1
    assert capsys.readouterr().err == (
        f"error: RL step 3: agent 'a.py:run' raised KeyError: 'a' (episode 5) (rl step 3; traceback: "
        f"{tmp_path}/error.log)\n"
    )


def test_an_unexpected_error_is_its_type_and_stated_cause(tmp_path, capsys):
    assert _cli(tmp_path / "absent", RuntimeError("while stepping\nTypeError: bad operand")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: RuntimeError: TypeError: bad operand (rl step 3; traceback: ")
    path = err.rsplit("traceback: ", 1)[1].rstrip(")\n")
    assert "while stepping" in open(path).read()  # no output dir yet: a temporary file


@pytest.mark.parametrize(
    "text, line",
    [
        ("The actor died unexpectedly before finishing this task.\n\tclass_name: X", "The actor died unexpectedly "
         "before finishing this task."),
        ("a\nb\ntorch.OutOfMemoryError: CUDA out of memory", "torch.OutOfMemoryError: CUDA out of memory"),
        ("", "RuntimeError"),
    ],
)  # fmt: skip
def test_cause_line_takes_the_stated_error_else_the_first_line(text, line):
    assert cause_line(RuntimeError(text)) == line


def test_an_environment_spec_that_does_not_load_is_bad_input(tmp_path, capsys):
    failure = EnvError("environment spec 'my_agent.py:run': file 'my_agent.py' not found", "my_agent.py:run")
    assert _cli(tmp_path, failure) == 2
    assert capsys.readouterr().err == "error: environment spec 'my_agent.py:run': file 'my_agent.py' not found\n"
    assert not (tmp_path / "error.log").exists()
