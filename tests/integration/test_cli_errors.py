"""Bad input through the real CLI: a clear one-line error naming the key / file and line, exit code 2, and
nothing written to ``final/``. Everything here fails during validation, before any actor starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared_helpers import uneven_sft_rows, write_jsonl


def _cli(module, *overrides, cwd=None):
    env = dict(os.environ, DS_ACCELERATOR="cpu", RAY_ADDRESS="")
    return subprocess.run([sys.executable, "-m", f"rlhf.cli.{module}", *overrides], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def _base(model, data, out):
    return [f"model.path={model}", f"data.train_path={data}", f"train.output_dir={out}", "train.global_batch_size=4",
            "train.micro_batch_size=2"]


def test_unknown_key_suggests_the_close_match(tiny_model, sft_data, tmp_path):
    proc = _cli("train_sft", *_base(tiny_model, sft_data, tmp_path / "o"), "train.micro_bach_size=2")
    assert proc.returncode == 2
    assert "unknown config key 'train.micro_bach_size'" in proc.stderr and "train.micro_batch_size" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args,corrected", [(["--train.lr", "1e-4"], "train.lr=1e-4"),
                                           (["--train.lr=1e-4"], "train.lr=1e-4"),
                                           (["--lr", "1e-4"], "train.lr=1e-4")])
def test_an_override_written_as_an_option_gets_its_key_value_form(args, corrected, tiny_model, sft_data, tmp_path):
    proc = _cli("train_sft", *_base(tiny_model, sft_data, tmp_path / "o"), *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"overrides are KEY=VALUE without dashes; write: {corrected}" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_dotted_key_in_a_yaml_file_is_read(tiny_model, sft_data, tmp_path):
    """``model.path: x`` in a YAML file used to be 'unknown config key 'model.path'; did you mean 'model.path'?'."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model.path: {tiny_model}\ndata.train_path: {sft_data}\ntrain.learning_rate: 1e-4\n")
    proc = _cli("train_sft", "--config", str(config), f"train.output_dir={tmp_path / 'o'}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unknown config key 'train.learning_rate'; did you mean 'train.lr'?"


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  path: /m\ntrain:\n  lr: [1\n  seed: 3\n")
    proc = _cli("train_sft", "--config", str(config))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {config}:5:7: invalid YAML: expected ',' or ']', but got ':' "
                                   "(while parsing a flow sequence, line 4)")


def test_indivisible_global_batch_names_the_keys(tiny_model, sft_data, tmp_path):
    proc = _cli("train_sft", *_base(tiny_model, sft_data, tmp_path / "o"), "train.num_workers=3")
    assert proc.returncode == 2
    assert "train.global_batch_size" in proc.stderr and "train.micro_batch_size x train.num_workers" in proc.stderr


def test_missing_model_path_is_named(sft_data, tmp_path):
    proc = _cli("train_sft", f"data.train_path={sft_data}")
    assert proc.returncode == 2 and "model.path is required" in proc.stderr


def test_model_path_that_is_not_a_model_is_named(sft_data, tmp_path):
    proc = _cli("train_sft", *_base(str(tmp_path), sft_data, tmp_path / "o"))
    assert proc.returncode == 2 and "model.path" in proc.stderr and "config.json" in proc.stderr


def test_malformed_jsonl_row_names_file_and_line_and_writes_no_final(tiny_model, tmp_path):
    rows = uneven_sft_rows(8, seed=1)
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with open(path, "a") as f:
        f.write('{"prompt": "1+1=", "response": "2"\n')  # line 9: truncated JSON
    out = tmp_path / "out"
    proc = _cli("train_sft", *_base(tiny_model, path, out))
    assert proc.returncode == 2
    assert f"{path}:9: invalid JSON" in proc.stderr
    assert not (out / "final").exists()


def test_missing_field_names_the_field_and_line(tiny_model, tmp_path):
    rows = uneven_sft_rows(6, seed=2)
    del rows[3]["response"]
    path = write_jsonl(tmp_path / "missing.jsonl", rows)
    proc = _cli("train_sft", *_base(tiny_model, path, tmp_path / "out"))
    assert proc.returncode == 2 and f"{path}:4: missing field 'response'" in proc.stderr


def test_dpo_rows_need_chosen_and_rejected(tiny_model, sft_data, tmp_path):
    proc = _cli("train_dpo", *_base(tiny_model, sft_data, tmp_path / "out"))
    assert proc.returncode == 2 and "missing field 'chosen'" in proc.stderr and ":1:" in proc.stderr


def test_unknown_dpo_loss_lists_valid_names(tiny_model, pair_data, tmp_path):
    proc = _cli("train_dpo", *_base(tiny_model, pair_data, tmp_path / "out"), "dpo.loss_type=sigmod")
    assert proc.returncode == 2 and "sigmoid" in proc.stderr and "ipo" in proc.stderr


def test_too_few_rows_for_one_step(tiny_model, tmp_path):
    path = write_jsonl(tmp_path / "three.jsonl", uneven_sft_rows(3, seed=3))
    proc = _cli("train_sft", *_base(tiny_model, path, tmp_path / "out"))
    assert proc.returncode == 2 and "3 usable rows" in proc.stderr and "train.global_batch_size=4" in proc.stderr


def test_rl_bad_reward_function_is_named_before_any_actor(tiny_model, sft_data, tmp_path):
    proc = _cli("train_ppo", f"model.path={tiny_model}", f"data.train_path={sft_data}",
                f"train.output_dir={tmp_path / 'out'}", f"reward.functions=[{tmp_path}/nope.py:score]")
    assert proc.returncode == 2 and "nope.py:score" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "final").exists()


def test_rl_unknown_estimator_lists_valid_names(tiny_model, sft_data, tmp_path):
    proc = _cli("train_ppo", f"model.path={tiny_model}", f"data.train_path={sft_data}",
                "reward.functions=[rlhf.synthetic.arithmetic:reward]", "algo.advantage_estimator=grop")
    assert proc.returncode == 2 and "Did you mean 'grpo'" in proc.stderr and "reinforce_pp" in proc.stderr


@pytest.mark.parametrize("module", ["train_sft", "train_dpo", "train_rm", "train_ppo"])
def test_help_lists_every_key(module):
    proc = _cli(module, "--help")
    assert proc.returncode == 0
    for key in ("model.path", "data.train_path", "train.global_batch_size", "train.micro_batch_size",
                "train.num_workers", "train.max_epochs", "train.max_steps", "train.lr", "train.seed",
                "train.output_dir", "strategy.zero_stage"):
        assert key in proc.stdout, f"{module} --help lacks {key}"
