"""Bad input through the real CLI: a clear one-line error naming the key / file and line, exit code 2, and
nothing written to ``final/``. Everything here fails during validation, before any actor starts.

Every invocation is ``python -m rlhf.cli.<module> args...`` as the interpreter runs it (``runpy.run_module`` as
``__main__``: the module's own ``sys.exit(main())``, the exit status from its ``SystemExit``, an uncaught exception
printed as a traceback with status 1), with its stdout and stderr captured at the file-descriptor level. The
invocations share one Python process (:data:`SERVER`, started once for this module): one interpreter start and one
import of torch / transformers instead of one per case, which was nearly all of each case's seconds. After each
invocation the server also reports whether Ray was started, which none of these may do.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest
from shared_helpers import uneven_sft_rows, write_jsonl

# Reads one JSON request a line on stdin, ``[module, [args...]]``, runs it as ``python -m module args...`` would, and
# answers on the file descriptor argv[1]: ``[exit status, stdout, stderr, whether Ray is initialized]``.
SERVER = r"""
import json, os, runpy, sys, tempfile, traceback

replies = os.fdopen(int(sys.argv[1]), "w")
scratch = tempfile.mkdtemp(prefix="cli-errors-")


def exit_status(code, err):
    # what the interpreter does with SystemExit(code) at the top level
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=err)
    return 1


for line in sys.stdin:
    module, args = json.loads(line)
    paths = [os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    files = [open(path, "w") for path in paths]
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as e:
        status = exit_status(e.code, sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for f in files:
            f.close()
        sys.argv = argv
        os.chdir(cwd)
    out, err = (open(path).read() for path in paths)
    ray = sys.modules.get("ray")
    started = bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())
    replies.write(json.dumps([status, out, err, started]) + "\n")
    replies.flush()
"""


class _Server:
    def __init__(self):
        read_fd, write_fd = os.pipe()
        env = dict(os.environ, DS_ACCELERATOR="cpu", RAY_ADDRESS="")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(write_fd)],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
            text=True,
        )
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)

    def __call__(self, module, *args, timeout=300):
        name = f"rlhf.cli.{module}"
        self.proc.stdin.write(json.dumps([name, [str(a) for a in args]]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.replies], [], [], timeout)
        assert ready, f"python -m {name} took more than {timeout} s"
        line = self.replies.readline()
        assert line, f"the CLI server died (exit status {self.proc.poll()})"
        status, out, err, ray_started = json.loads(line)
        assert not ray_started, f"python -m {name} {args} started Ray: {err[-3000:]}"
        return subprocess.CompletedProcess([sys.executable, "-m", name, *args], status, out, err)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.replies.close()


@pytest.fixture(scope="module")
def cli():
    """``cli(module, *args)``: ``python -m rlhf.cli.<module> args...`` (see the module docstring), as a
    ``subprocess.CompletedProcess`` (``returncode``, ``stdout``, ``stderr``)."""
    server = _Server()
    yield server
    server.close()


def _base(model, data, out):
    return [
        f"model.path={model}",
        f"data.train_path={data}",
        f"train.output_dir={out}",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
    ]


def test_unknown_key_suggests_the_close_match(cli, tiny_model, sft_data, tmp_path):
    proc = cli("train_sft", *_base(tiny_model, sft_data, tmp_path / "o"), "train.micro_bach_size=2")
    assert proc.returncode == 2
    assert "unknown config key 'train.micro_bach_size'" in proc.stderr and "train.micro_batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args,corrected",
    [
        (["--train.lr", "1e-4"], "train.lr=1e-4"),
        (["--train.lr=1e-4"], "train.lr=1e-4"),
        (["--lr", "1e-4"], "train.lr=1e-4"),
    ],
)
def test_an_override_written_as_an_option_gets_its_key_value_form(cli, args, corrected, tiny_model, sft_data, tmp_path):
    proc = cli("train_sft", *_base(tiny_model, sft_data, tmp_path / "o"), *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"overrides are KEY=VALUE without dashes; write: {corrected}" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_dotted_key_in_a_yaml_file_is_read(cli, tiny_model, sft_data, tmp_path):
    """``model.path: x`` in a YAML file used to be 'unknown config key 'model.path'; did you mean 'model.path'?'."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model.path: {tiny_model}\ndata.train_path: {sft_data}\ntrain.learning_rate: 1e-4\n")
    proc = cli("train_sft", "--config", str(config), f"train.output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown config key 'train.learning_rate'; did you mean 'train.lr'?"


def test_a_yaml_syntax_error_names_the_file_and_line(cli, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /m\ntrain:\n  lr: [1\n  seed: 3\n")
    proc = cli("train_sft", "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {config}:5:7: invalid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence, line 4)"
    )


def test_indivisible_global_batch_names_the_keys(cli, tiny_model, sft_data, tmp_path):
    proc = cli("train_sft", *_base(tiny_model, sft_data, tmp_path / "o"), "train.num_workers=3")
    assert proc.returncode == 2
    assert "train.global_batch_size" in proc.stderr and "train.micro_batch_size x train.num_workers" in proc.stderr


def test_missing_model_path_is_named(cli, sft_data, tmp_path):
    proc = cli("train_sft", f"data.train_path={sft_data}")
    assert proc.returncode == 2 and "model.path is required" in proc.stderr


def test_model_path_that_is_not_a_model_is_named(cli, sft_data, tmp_path):
    proc = cli("train_sft", *_base(str(tmp_path), sft_data, tmp_path / "o"))
    assert proc.returncode == 2 and "model.path" in proc.stderr and "config.json" in proc.stderr


def test_malformed_jsonl_row_names_file_and_line_and_writes_no_final(cli, tiny_model, tmp_path):
    rows = uneven_sft_rows(8, seed=1)
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with open(path, "a") as f:
        f.write('{"prompt": "1+1=", "response": "2"\n')  # line 9: truncated JSON
    out = tmp_path / "out"
    proc = cli("train_sft", *_base(tiny_model, path, out))
    assert proc.returncode == 2
    assert f"{path}:9: invalid JSON" in proc.stderr
    assert not (out / "final").exists()


def test_missing_field_names_the_field_and_line(cli, tiny_model, tmp_path):
    rows = uneven_sft_rows(6, seed=2)
    del rows[3]["response"]
    path = write_jsonl(tmp_path / "missing.jsonl", rows)
    proc = cli("train_sft", *_base(tiny_model, path, tmp_path / "out"))
    assert proc.returncode == 2 and f"{path}:4: missing field 'response'" in proc.stderr


def test_dpo_rows_need_chosen_and_rejected(cli, tiny_model, sft_data, tmp_path):
    proc = cli("train_dpo", *_base(tiny_model, sft_data, tmp_path / "out"))
    assert proc.returncode == 2 and "missing field 'chosen'" in proc.stderr and ":1:" in proc.stderr


def test_unknown_dpo_loss_lists_valid_names(cli, tiny_model, pair_data, tmp_path):
    proc = cli("train_dpo", *_base(tiny_model, pair_data, tmp_path / "out"), "dpo.loss_type=sigmod")
    assert proc.returncode == 2 and "sigmoid" in proc.stderr and "ipo" in proc.stderr


def test_too_few_rows_for_one_step(cli, tiny_model, tmp_path):
    path = write_jsonl(tmp_path / "three.jsonl", uneven_sft_rows(3, seed=3))
    proc = cli("train_sft", *_base(tiny_model, path, tmp_path / "out"))
    assert proc.returncode == 2 and "3 usable rows" in proc.stderr and "train.global_batch_size=4" in proc.stderr


def test_rl_bad_reward_function_is_named_before_any_actor(cli, tiny_model, sft_data, tmp_path):
    proc = cli(
        "train_ppo",
        f"model.path={tiny_model}",
        f"data.train_path={sft_data}",
        f"train.output_dir={tmp_path / 'out'}",
        f"reward.functions=[{tmp_path}/nope.py:score]",
    )
    assert proc.returncode == 2 and "nope.py:score" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "final").exists()


def test_rl_unknown_estimator_lists_valid_names(cli, tiny_model, sft_data, tmp_path):
    proc = cli(
        "train_ppo",
        f"model.path={tiny_model}",
        f"data.train_path={sft_data}",
        "reward.functions=[rlhf.synthetic.arithmetic:reward]",
        "algo.advantage_estimator=grop",
    )
    assert proc.returncode == 2 and "Did you mean 'grpo'" in proc.stderr and "reinforce_pp" in proc.stderr


@pytest.mark.parametrize("module", ["train_sft", "train_dpo", "train_rm", "train_ppo"])
def test_help_lists_every_key(cli, module):
    proc = cli(module, "--help")
    assert proc.returncode == 0
    for key in (
        "model.path",
        "data.train_path",
        "train.global_batch_size",
        "train.micro_batch_size",
        "train.num_workers",
        "train.max_epochs",
        "train.max_steps",
        "train.lr",
        "train.seed",
        "train.output_dir",
        "strategy.zero_stage",
    ):
        assert key in proc.stdout, f"{module} --help lacks {key}"
