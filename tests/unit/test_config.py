"""Tests for rlhf.config: YAML/preset/override loading, type coercion, error messages, CLI, round trip."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import pytest
import yaml

from rlhf.config import (
    ConfigError,
    DPORunConfig,
    RewardModelRunConfig,
    SFTRunConfig,
    available_presets,
    config_to_dict,
    describe_keys,
    load_config,
    parse_cli,
    save_config,
)
from rlhf.ops.preference import DPO_LOSSES  # the project's own module: an import error must fail, not skip

REQUIRED = ["model.path=/models/tiny", "data.train_path=/data/train.jsonl"]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _error(cls: type, config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, config_file, [*REQUIRED, *overrides])
    return str(info.value)


# Module level so typing.get_type_hints can resolve their (string) annotations.
@dataclass(frozen=True)
class _Inner:
    count: Optional[int] = None
    name: Optional[str] = None


@dataclass(frozen=True)
class _Outer:
    needed: str  # no default
    inner: _Inner = field(default_factory=_Inner)
    sizes: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Optionals:
    inner: _Inner = field(default_factory=_Inner)
    sizes: List[int] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ precedence


def test_defaults_only():
    cfg = load_config(SFTRunConfig, None, REQUIRED)
    assert cfg.model.path == "/models/tiny"
    assert cfg.data.train_path == "/data/train.jsonl"
    assert cfg.train.micro_batch_size == 1 and cfg.train.lr == 1e-5 and cfg.strategy.zero_stage == 2


def test_precedence_defaults_yaml_override(tmp_path):
    path = _write(tmp_path / "run.yaml", "train:\n  lr: 0.01\n  seed: 7\n  global_batch_size: 4\n")
    cfg = load_config(SFTRunConfig, path, [*REQUIRED, "train.seed=9"])
    assert cfg.train.lr == 0.01  # YAML over default
    assert cfg.train.seed == 9  # override over YAML
    assert cfg.train.global_batch_size == 4  # YAML, untouched by overrides
    assert cfg.train.warmup_steps == 0  # default, untouched by YAML


def test_later_override_wins():
    cfg = load_config(SFTRunConfig, None, [*REQUIRED, "train.seed=1", "train.seed=2"])
    assert cfg.train.seed == 2


def test_yaml_can_set_required_keys(tmp_path):
    path = _write(tmp_path / "run.yaml", "model:\n  path: /m\ndata:\n  train_path: /d\n")
    cfg = load_config(SFTRunConfig, str(path))
    assert (cfg.model.path, cfg.data.train_path) == ("/m", "/d")


def test_empty_section_in_yaml_keeps_defaults(tmp_path):
    path = _write(tmp_path / "run.yaml", "train:\n  # nothing set yet\nlogging:\n")
    cfg = load_config(SFTRunConfig, path, REQUIRED)
    assert cfg.train.micro_batch_size == 1 and cfg.logging.print_every == 1


def test_section_mapping_override_merges():
    cfg = load_config(SFTRunConfig, None, [*REQUIRED, "train.lr=0.5", "train={seed: 3, warmup_steps: 4}"])
    assert (cfg.train.lr, cfg.train.seed, cfg.train.warmup_steps) == (0.5, 3, 4)


# ------------------------------------------------------------------------------------------ presets


def test_presets_are_listed():
    assert {"sft_tiny", "dpo_tiny", "rm_tiny"} <= set(available_presets())


def test_preset_by_name():
    cfg = load_config(SFTRunConfig, "sft_tiny", REQUIRED)
    assert cfg.train.micro_batch_size == 4 and cfg.train.global_batch_size == 16
    assert cfg.train.lr == pytest.approx(1e-3)
    assert cfg.data.max_length == 512 and cfg.strategy.zero_stage == 2
    assert load_config(SFTRunConfig, "sft_tiny.yaml", REQUIRED) == cfg


def test_rm_preset():
    cfg = load_config(RewardModelRunConfig, "rm_tiny", REQUIRED)
    assert cfg.rm.use_margin is False and cfg.train.micro_batch_size == 4 and cfg.data.max_length == 512


def test_dpo_preset():
    cfg = load_config(DPORunConfig, "dpo_tiny", REQUIRED)
    assert cfg.dpo.beta is None and cfg.dpo.trained_beta == 0.1 and cfg.dpo.loss_type == "sigmoid"
    assert load_config(DPORunConfig, "dpo_tiny", [*REQUIRED, "dpo.loss_type=simpo"]).dpo.trained_beta == 2.0
    assert cfg.train.global_batch_size == 16


@pytest.mark.parametrize("name", ["sft_tiny", "dpo_tiny", "rm_tiny", "grpo_tiny"])
def test_presets_do_not_set_paths(name):
    from rlhf.config.loader import PRESET_DIR

    data = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
    assert "path" not in (data.get("model") or {})
    assert "train_path" not in (data.get("data") or {})
    assert "output_dir" not in (data.get("train") or {})  # one fixed directory per preset: runs overwrote each other


def test_preset_still_requires_model_path():
    message = _error_without_required(SFTRunConfig, "sft_tiny", [])
    assert message == "model.path is required (an HF model directory or a hub id, org/name)"


def test_missing_config_file_lists_presets():
    message = _error(SFTRunConfig, "no_such_preset")
    assert "'no_such_preset' not found" in message
    for name in ("sft_tiny", "dpo_tiny", "rm_tiny"):
        assert name in message


# ------------------------------------------------------------------------------------------ defaults: inheritance


def test_defaults_inheritance_relative_path(tmp_path, monkeypatch):
    _write(tmp_path / "conf" / "base" / "common.yaml", "train:\n  lr: 0.02\n  seed: 5\ndata:\n  max_length: 99\n")
    child = _write(tmp_path / "conf" / "child.yaml", "defaults: [base/common.yaml]\ntrain:\n  seed: 6\n")
    monkeypatch.chdir(tmp_path)  # defaults resolve relative to the including file, not the CWD
    cfg = load_config(SFTRunConfig, child, REQUIRED)
    assert cfg.train.lr == 0.02  # inherited
    assert cfg.train.seed == 6  # child over parent, within the same section
    assert cfg.data.max_length == 99  # another inherited section


def test_defaults_preset_and_order(tmp_path):
    _write(tmp_path / "a.yaml", "train:\n  seed: 1\n  warmup_steps: 1\n")
    _write(tmp_path / "b.yaml", "train:\n  seed: 2\n")
    child = _write(tmp_path / "child.yaml", "defaults: [sft_tiny, a.yaml, b.yaml]\n")
    cfg = load_config(SFTRunConfig, child, REQUIRED)
    assert cfg.train.micro_batch_size == 4  # from the preset
    assert cfg.train.seed == 2  # later default wins
    assert cfg.train.warmup_steps == 1


def test_defaults_single_string(tmp_path):
    _write(tmp_path / "base.yaml", "train:\n  seed: 11\n")
    child = _write(tmp_path / "child.yaml", "defaults: base.yaml\n")
    assert load_config(SFTRunConfig, child, REQUIRED).train.seed == 11


def test_defaults_diamond_is_not_a_cycle(tmp_path):
    _write(tmp_path / "root.yaml", "train:\n  seed: 3\n")
    _write(tmp_path / "left.yaml", "defaults: [root.yaml]\n")
    _write(tmp_path / "right.yaml", "defaults: [root.yaml]\n")
    top = _write(tmp_path / "top.yaml", "defaults: [left.yaml, right.yaml]\n")
    assert load_config(SFTRunConfig, top, REQUIRED).train.seed == 3


def test_defaults_cycle_is_an_error(tmp_path):
    _write(tmp_path / "a.yaml", "defaults: [b.yaml]\n")
    b = _write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    message = _error(SFTRunConfig, b)
    assert "cycle" in message and "a.yaml" in message


def test_defaults_missing_file(tmp_path):
    child = _write(tmp_path / "child.yaml", "defaults: [missing.yaml]\n")
    assert "'missing.yaml' not found" in _error(SFTRunConfig, child)


def test_defaults_bad_type(tmp_path):
    child = _write(tmp_path / "child.yaml", "defaults: {a: 1}\n")
    assert "'defaults' must be a list" in _error(SFTRunConfig, child)


# ------------------------------------------------------------------------------------------ type coercion


def test_int_from_override_and_yaml_text(tmp_path):
    cfg = load_config(SFTRunConfig, None, [*REQUIRED, "train.micro_batch_size=2", "train.global_batch_size=8.0"])
    assert cfg.train.micro_batch_size == 2 and type(cfg.train.micro_batch_size) is int
    assert cfg.train.global_batch_size == 8 and type(cfg.train.global_batch_size) is int
    path = _write(tmp_path / "run.yaml", "train:\n  seed: '17'\n")
    assert load_config(SFTRunConfig, path, REQUIRED).train.seed == 17


@pytest.mark.parametrize("value", ["abc", "true", "1.5", "[1]"])
def test_int_rejects(value):
    expected = {"abc": "'abc'", "true": "True", "1.5": "1.5", "[1]": "[1]"}[value]
    assert _error(SFTRunConfig, None, [f"train.seed={value}"]) == f"train.seed: expected int, got {expected}"


def test_bad_int_message_exact():
    message = _error(SFTRunConfig, None, ["train.micro_batch_size=abc"])
    assert message == "train.micro_batch_size: expected int, got 'abc'"


def test_float_accepts_int_and_exponent_text(tmp_path):
    cfg = load_config(SFTRunConfig, None, [*REQUIRED, "train.lr=1", "train.adam_eps=1e-6"])
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.train.adam_eps == pytest.approx(1e-6)
    path = _write(tmp_path / "run.yaml", "train:\n  lr: 3e-4\n")  # PyYAML reads this as a string
    assert load_config(SFTRunConfig, path, REQUIRED).train.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("value", ["fast", "true", "[0.1]"])
def test_float_rejects(value):
    assert _error(SFTRunConfig, None, [f"train.lr={value}"]).startswith("train.lr: expected float, got ")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("true", True),
        ("false", False),
        ("1", True),
        ("0", False),
        ("yes", True),
        ("no", False),
        ("True", True),
        ("off", False),
    ],
)
def test_bool_values(text, expected):
    cfg = load_config(SFTRunConfig, None, [*REQUIRED, f"logging.tensorboard={text}"])
    assert cfg.logging.tensorboard is expected


@pytest.mark.parametrize("value", ["maybe", "2", "0.5"])
def test_bool_rejects(value):
    assert _error(SFTRunConfig, None, [f"logging.tensorboard={value}"]).startswith(
        "logging.tensorboard: expected bool, got "
    )


def test_str_keeps_raw_override_text():
    cfg = load_config(
        SFTRunConfig,
        None,
        ["model.path=123", "data.train_path=/d", "model.tokenizer_path=1.10", "data.split='quoted'"],
    )
    assert cfg.model.path == "123"
    assert cfg.model.tokenizer_path == "1.10"  # not the float 1.1
    assert cfg.data.split == "quoted"  # YAML quotes are removed


def test_str_empty_override():
    overrides = [*REQUIRED, "strategy.deepspeed_config=/x.json", "strategy.deepspeed_config="]
    cfg = load_config(SFTRunConfig, None, overrides)
    assert cfg.strategy.deepspeed_config == ""


def test_str_null_is_an_error():
    assert _error(SFTRunConfig, None, ["strategy.deepspeed_config=null"]) == (
        "strategy.deepspeed_config: expected str, got null"
    )


def test_str_rejects_yaml_bool(tmp_path):
    path = _write(tmp_path / "run.yaml", "data:\n  split: yes\n")
    assert _error(SFTRunConfig, path) == "data.split: expected str, got True"


def test_tuple_from_list(tmp_path):
    cfg = load_config(SFTRunConfig, None, [*REQUIRED, "train.adam_betas=[0.8, 0.99]"])
    assert cfg.train.adam_betas == (0.8, 0.99) and isinstance(cfg.train.adam_betas, tuple)
    path = _write(tmp_path / "run.yaml", "train:\n  adam_betas: [0, 0.5]\n")
    betas = load_config(SFTRunConfig, path, REQUIRED).train.adam_betas
    assert betas == (0.0, 0.5) and all(type(b) is float for b in betas)


def test_tuple_wrong_length_names_key():
    message = _error(SFTRunConfig, None, ["train.adam_betas=[0.9]"])
    assert message.startswith("train.adam_betas: expected a list of 2 values")


def test_tuple_bad_item_names_index():
    assert _error(SFTRunConfig, None, ["train.adam_betas=[0.9, x]"]) == "train.adam_betas[1]: expected float, got 'x'"


def test_tuple_rejects_scalar():
    assert _error(SFTRunConfig, None, ["train.adam_betas=0.9"]).startswith("train.adam_betas: expected")


def test_optional_and_list_and_nested():
    cfg = load_config(_Optionals, None, ["inner.count=3", "inner.name=null", "sizes=[1, 2.0]"])
    assert cfg.inner.count == 3 and cfg.inner.name is None and cfg.sizes == [1, 2]
    cfg = load_config(_Optionals, None, ["inner.count=null", "inner.name=abc"])
    assert cfg.inner.count is None and cfg.inner.name == "abc"
    with pytest.raises(ConfigError, match=r"^inner\.count: expected int, got 'x'$"):
        load_config(_Optionals, None, ["inner.count=x"])
    with pytest.raises(ConfigError, match=r"^sizes\[1\]: expected int, got 'b'$"):
        load_config(_Optionals, None, ["sizes=[1, b]"])


def test_required_leaf_without_default():
    with pytest.raises(ConfigError, match=r"^needed is required$"):
        load_config(_Outer)
    assert load_config(_Outer, None, ["needed=x"]).needed == "x"


# ------------------------------------------------------------------------------------------ errors


def test_unknown_override_key_suggests():
    message = _error(SFTRunConfig, None, ["train.micro_bach_size=2"])
    assert message == "unknown config key 'train.micro_bach_size'; did you mean 'train.micro_batch_size'?"


def test_unknown_top_level_key_suggests():
    message = _error(SFTRunConfig, None, ["trian.lr=1"])
    assert message.startswith("unknown config key 'trian.lr'; did you mean 'train.lr'")


def test_unknown_key_in_wrong_section_suggests_right_one():
    assert "did you mean 'strategy.zero_stage'" in _error(SFTRunConfig, None, ["train.zero_stage=3"])
    assert "did you mean 'train.lr'" in _error(SFTRunConfig, None, ["lr=1"])


def test_unknown_key_without_match_lists_section_keys():
    message = _error(SFTRunConfig, None, ["train.qqqqqqqqqqqq=1"])
    assert message.startswith("unknown config key 'train.qqqqqqqqqqqq'; valid keys in 'train': ")
    assert "micro_batch_size" in message and "adam_betas" in message
    top = _error(SFTRunConfig, None, ["qqqqqqqqqqqq=1"])
    assert "valid keys at the top level: model, data, train, strategy, ray, logging" in top


def test_unknown_key_past_a_leaf():
    assert _error(SFTRunConfig, None, ["train.lr.x=1"]).startswith(
        "unknown config key 'train.lr.x'; did you mean 'train.lr'"
    )


def test_unknown_yaml_keys(tmp_path):
    nested = _write(tmp_path / "nested.yaml", "train:\n  micro_bach_size: 2\n")
    assert _error(SFTRunConfig, nested) == (
        "unknown config key 'train.micro_bach_size'; did you mean 'train.micro_batch_size'?"
    )
    top = _write(tmp_path / "top.yaml", "trainer:\n  lr: 1\n")
    assert _error(SFTRunConfig, top).startswith("unknown config key 'trainer'; did you mean 'train'")


def test_dotted_keys_in_yaml_are_read_as_the_nested_form(tmp_path):
    path = _write(
        tmp_path / "run.yaml",
        "model.path: /m\ndata:\n  train_path: /d\ntrain.lr: 0.5\ntrain:\n  seed: 3\n"
        "strategy: {zero_stage: 1}\nlogging:\n  wandb_project: p\n",
    )
    cfg = load_config(SFTRunConfig, path)
    assert (cfg.model.path, cfg.data.train_path, cfg.train.lr, cfg.train.seed) == ("/m", "/d", 0.5, 3)
    assert cfg.strategy.zero_stage == 1 and cfg.logging.wandb_project == "p"
    nested = _write(tmp_path / "nested.yaml", "strategy:\n  zero.stage: 1\n")  # a dotted key inside a section
    assert _error(SFTRunConfig, nested) == ("unknown config key 'strategy.zero'; did you mean 'strategy.zero_stage'?")


def test_dotted_keys_in_yaml_below_the_top_level_expand_too(tmp_path):
    path = _write(tmp_path / "run.yaml", "train:\n  lr: 0.25\nmodel:\n  path: /m\ndata: {train_path: /d}\n")
    assert load_config(SFTRunConfig, path).train.lr == 0.25
    dpo = _write(tmp_path / "dpo.yaml", "dpo.beta: 0.3\n")
    assert load_config(DPORunConfig, dpo, REQUIRED).dpo.beta == pytest.approx(0.3)
    assert load_config(SFTRunConfig, None, [*REQUIRED, "train={lr: 0.5, seed: 9}"]).train.seed == 9


def test_a_key_set_both_dotted_and_nested_in_one_file_is_named(tmp_path):
    path = _write(tmp_path / "run.yaml", "train.lr: 0.5\ntrain:\n  lr: 0.1\n")
    assert _error(SFTRunConfig, path) == (
        f"{path}: 'train.lr' is set twice (as a dotted key and inside its section); keep one"
    )
    scalar = _write(tmp_path / "scalar.yaml", "train: 3\ntrain.lr: 0.5\n")
    assert "'train' is set twice" in _error(SFTRunConfig, scalar)


def test_dotted_keys_override_a_defaults_file_like_nested_ones(tmp_path):
    _write(tmp_path / "base.yaml", "train:\n  lr: 0.1\n  seed: 4\n")
    child = _write(tmp_path / "child.yaml", "defaults: [base.yaml]\ntrain.lr: 0.2\n")
    cfg = load_config(SFTRunConfig, child, REQUIRED)
    assert (cfg.train.lr, cfg.train.seed) == (0.2, 4)  # across files the later one wins: no "set twice"


@pytest.mark.parametrize(
    "cls,key,expected",
    [
        (SFTRunConfig, "learning_rate", "'train.lr'"),
        (SFTRunConfig, "train.learning_rate", "'train.lr'"),
        (SFTRunConfig, "per_device_train_batch_size", "'train.micro_batch_size'"),
        (SFTRunConfig, "train.per_device_train_batch_size", "'train.micro_batch_size'"),
        (SFTRunConfig, "micro_train_batch_size", "'train.micro_batch_size'"),
        (SFTRunConfig, "num_train_epochs", "'train.max_epochs'"),
        (SFTRunConfig, "pretrain", "'model.path'"),
        (SFTRunConfig, "model_name_or_path", "'model.path'"),
        (SFTRunConfig, "max_len", "'data.max_length'"),
        (SFTRunConfig, "save_path", "'train.output_dir'"),
        (SFTRunConfig, "train_batch_size", "'train.global_batch_size'"),
        (SFTRunConfig, "logging_steps", "'logging.print_every'"),
        (SFTRunConfig, "save_steps", "'train.save_every'"),
        (SFTRunConfig, "apply_chat_template", "'data.chat_template'"),
        (SFTRunConfig, "assistant_only_loss", "'data.assistant_turns'"),
        (SFTRunConfig, "dataset_config", "'data.config_name'"),
        (DPORunConfig, "beta", "'dpo.beta'"),
        ("rl", "beta", "'algo.kl_coef'"),
        ("rl", "num_generations", "'rollout.n_samples_per_prompt'"),
        ("rl", "max_completion_length", "'rollout.max_new_tokens'"),
        ("rl", "rollout_batch_size", "'rollout.prompts_per_step'"),
    ],
)
def test_names_from_other_toolkits_suggest_this_projects_key(cls, key, expected):
    from rlhf.config.rl_schema import RLRunConfig

    cls = RLRunConfig if cls == "rl" else cls
    extra = ["reward.functions=[m:f]"] if cls is RLRunConfig else []
    message = _error(cls, None, [*extra, f"{key}=1"])
    assert message.startswith(f"unknown config key {key!r}; did you mean {expected}"), message


def test_learning_rate_under_train_suggests_lr_only():
    message = _error(SFTRunConfig, None, ["train.learning_rate=1e-4"])
    assert message == "unknown config key 'train.learning_rate'; did you mean 'train.lr'?"  # not min_lr_ratio


def test_gradient_accumulation_steps_explains_that_it_is_derived():
    message = _error(SFTRunConfig, None, ["gradient_accumulation_steps=4"])
    assert "did you mean 'train.global_batch_size'?" in message
    assert "train.global_batch_size / (train.micro_batch_size x train.num_workers)" in message


def test_a_suggestion_is_never_the_key_itself():
    """Every foreign name, bare and under every section, and every valid leaf one level too deep: the keys
    suggested never include the key written (the old message for a YAML 'model.path' key suggested itself)."""
    from rlhf.config.loader import _all_keys
    from rlhf.config.suggest import FOREIGN_KEYS

    sections = ["", "model.", "data.", "train.", "strategy.", "logging."]
    keys = [prefix + name for name in FOREIGN_KEYS for prefix in sections]
    keys += [f"{key}.x" for key in _all_keys(SFTRunConfig) if "." in key]
    for key in keys:
        with pytest.raises(ConfigError) as info:
            load_config(SFTRunConfig, None, [*REQUIRED, f"{key}=1"])
        message = str(info.value)
        assert message.startswith(f"unknown config key {key!r}; "), message
        assert f"did you mean {key!r}" not in message and f"or {key!r}" not in message, message


def test_dpo_section_unknown_for_sft():
    message = _error(SFTRunConfig, None, ["dpo.beta=0.2"])
    assert message.startswith("unknown config key 'dpo.beta'")


def test_override_without_equals():
    message = _error(SFTRunConfig, None, ["train.micro_batch_size"])
    assert "invalid override 'train.micro_batch_size'" in message and "KEY=VALUE" in message
    assert "KEY=VALUE" in _error(SFTRunConfig, None, ["=3"])
    assert "KEY=VALUE" in _error(SFTRunConfig, None, ["train..lr=3"])


def test_section_set_to_scalar():
    message = _error(SFTRunConfig, None, ["train=5"])
    assert message.startswith("train: is a config section") and "got 5" in message


def test_yaml_section_set_to_scalar(tmp_path):
    path = _write(tmp_path / "run.yaml", "strategy: 3\n")
    assert _error(SFTRunConfig, path).startswith("strategy: is a config section")
    # An override below a scalar section is refused too, rather than silently dropping the YAML value.
    assert _error(SFTRunConfig, path, ["strategy.zero_stage=1"]).startswith("strategy: is a config section")


def test_bad_yaml_files(tmp_path):
    bad = _write(tmp_path / "bad.yaml", "model:\n  path: /m\ntrain:\n  lr: [1\n  seed: 3\n")
    assert _error(SFTRunConfig, bad) == (  # one line: file, line and column, PyYAML's problem and its context
        f"{bad}:5:7: invalid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence, line 4)"
    )
    assert "top level must be a mapping" in _error(SFTRunConfig, _write(tmp_path / "list.yaml", "- 1\n"))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe")  # was a UnicodeDecodeError traceback
    assert _error(SFTRunConfig, binary).startswith(f"cannot read config file {binary}: ")


def _error_without_required(cls: type, config_file: str | None, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, config_file, overrides)
    return str(info.value)


def test_missing_model_path():
    assert _error_without_required(SFTRunConfig, None, ["data.train_path=/d"]) == (
        "model.path is required (an HF model directory or a hub id, org/name)"
    )


def test_missing_train_path():
    message = _error_without_required(SFTRunConfig, None, ["model.path=/m"])
    assert message.startswith("data.train_path is required")


def test_global_batch_not_divisible():
    message = _error(SFTRunConfig, None, ["train.global_batch_size=10", "train.micro_batch_size=4"])
    assert message.startswith("train.global_batch_size (10) must be divisible by")
    assert "4 x 1 = 4" in message


def test_global_batch_divisible_over_workers():
    cfg = load_config(
        SFTRunConfig, None, [*REQUIRED, "train.global_batch_size=16", "train.micro_batch_size=2", "train.num_workers=4"]
    )
    assert cfg.train.grad_accum_steps == 2
    message = _error(
        SFTRunConfig, None, ["train.global_batch_size=16", "train.micro_batch_size=4", "train.num_workers=3"]
    )
    assert message.startswith("train.global_batch_size (16)")


def test_token_budget_replaces_the_micro_batch_size_and_needs_rows_that_divide_over_ranks():
    cfg = load_config(
        SFTRunConfig,
        None,
        [
            *REQUIRED,
            "train.global_batch_size=12",
            "train.micro_batch_size=8",
            "train.num_workers=3",
            "train.max_tokens_per_micro_batch=4096",
            "train.packing=true",
        ],
    )
    assert (cfg.train.engine_micro_batch_size, cfg.train.grad_accum_steps) == (1, 4)  # at most a rank's 4 rows
    assert cfg.train.describe_batching() == "4 rows x ranks 3 in micro-batches of <= 4096 tokens, packed"
    message = _error(
        SFTRunConfig,
        None,
        ["train.global_batch_size=10", "train.num_workers=3", "train.max_tokens_per_micro_batch=512"],
    )
    assert message.startswith(
        "train.global_batch_size (10) must be divisible by train.num_workers (3): under "
        "train.max_tokens_per_micro_batch"
    )
    assert _error(SFTRunConfig, None, ["train.max_tokens_per_micro_batch=-1"]).startswith(
        "train.max_tokens_per_micro_batch must be >= 0"
    )


def test_packing_refuses_eager_attention():
    message = _error(DPORunConfig, None, ["train.packing=true", "model.attn_implementation=eager"])
    assert message.startswith(
        "train.packing needs a variable-length attention, which model.attn_implementation=eager does not have"
    )
    load_config(DPORunConfig, None, [*REQUIRED, "train.packing=true", "model.attn_implementation=sdpa"])


def test_rl_token_budget_must_hold_the_longest_row():
    from rlhf.config.rl_schema import RLRunConfig

    rl = [
        *REQUIRED,
        "reward.functions=[rlhf.synthetic.arithmetic:reward]",
        "rollout.max_prompt_length=16",
        "rollout.max_new_tokens=6",
    ]
    with pytest.raises(
        ConfigError,
        match=r"^train.max_tokens_per_micro_batch \(21\) must hold the longest row a "
        r"step can train on: 22 tokens \(rollout.max_prompt_length \+ "
        r"rollout.max_new_tokens\)",
    ):
        load_config(RLRunConfig, "grpo_tiny", [*rl, "train.max_tokens_per_micro_batch=21"])
    assert load_config(RLRunConfig, "grpo_tiny", [*rl, "train.max_tokens_per_micro_batch=22"]).train.packing is False


def test_zero_stage_out_of_range():
    assert _error(SFTRunConfig, None, ["strategy.zero_stage=5"]) == "strategy.zero_stage must be 0, 1, 2 or 3, got 5"


def test_section_validation_message_unchanged():
    assert _error(SFTRunConfig, None, ["data.max_length=1"]) == "data.max_length must be >= 2, got 1"
    assert _error(SFTRunConfig, None, ["train.lr_scheduler=step"]) == (
        "train.lr_scheduler must be one of constant, linear, cosine; got 'step'"
    )


def test_unknown_dpo_loss_type_lists_valid_names():
    message = _error(DPORunConfig, None, ["dpo.loss_type=sigmod"])
    assert message.startswith("dpo.loss_type: ")
    assert "sigmod" in message and "did you mean 'sigmoid'" in message.lower()
    for name in DPO_LOSSES.names():
        assert name in message


def test_dpo_overrides():
    cfg = load_config(DPORunConfig, "dpo_tiny", [*REQUIRED, "dpo.beta=0.5", "dpo.ref_mode=online"])
    assert cfg.dpo.beta == 0.5 and cfg.dpo.ref_mode == "online"
    assert _error(DPORunConfig, None, ["dpo.beta=0"]) == "dpo.beta must be > 0, got 0.0"


# ------------------------------------------------------------------------------------------ CLI


def test_parse_cli_success_with_intermixed_args():
    cfg = parse_cli(SFTRunConfig, ["model.path=/m", "--config", "sft_tiny", "data.train_path=/d", "train.seed=3"])
    assert cfg.model.path == "/m" and cfg.train.micro_batch_size == 4 and cfg.train.seed == 3


def test_parse_cli_config_error_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(SFTRunConfig, [*REQUIRED, "train.micro_bach_size=2"], prog="train_sft")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'train.micro_bach_size'")
    assert "did you mean 'train.micro_batch_size'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,corrected",
    [
        (["--train.lr", "1e-4"], "train.lr=1e-4"),
        (["--train.lr=1e-4"], "train.lr=1e-4"),
        (["--lr", "1e-4"], "train.lr=1e-4"),
        (["--lr"], "train.lr=VALUE"),
        (["--learning-rate", "3e-5", "--seed", "3"], "train.lr=3e-5 train.seed=3"),
        (["--train.resume"], "train.resume=true"),
        (["--train.max_steps", "-1"], "train.max_steps=-1"),
    ],
)
def test_parse_cli_overrides_written_as_options_get_their_key_value_form(args, corrected, capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(SFTRunConfig, [*REQUIRED, *args, "train.seed=1"], prog="train_sft")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"overrides are KEY=VALUE without dashes; write: {corrected}\n" in err, err
    assert f"unrecognized arguments {' '.join(args)!r}" in err


def test_parse_cli_own_options_are_not_taken_for_overrides():
    cfg = parse_cli(
        SFTRunConfig,
        ["--config", "sft_tiny", *REQUIRED, "--dry-run", "-c", "sft_tiny", "--config=sft_tiny", "train.seed=-3"],
    )
    assert cfg.train.seed == -3 and cfg.train.micro_batch_size == 4


def test_parse_cli_missing_required_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(SFTRunConfig, ["--config", "sft_tiny"])
    assert info.value.code == 2
    assert (
        capsys.readouterr().err.strip() == "error: model.path is required (an HF model directory or a hub id, org/name)"
    )


def test_parse_cli_help_lists_keys(capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(DPORunConfig, ["--help"], prog="train_dpo")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: train_dpo")
    assert "train.micro_batch_size" in out and "samples per forward, per rank" in out
    assert "dpo.loss_type" in out and "--config" in out and "sft_tiny" in out
    line = next(row for row in out.splitlines() if row.strip().startswith("train.adam_betas"))
    assert "tuple[float, float]" in line and "[0.9, 0.95]" in line


# ------------------------------------------------------------------------------------------ describe_keys


def test_describe_keys():
    rows = describe_keys(SFTRunConfig)
    by_key = {key: (type_name, default, text) for key, type_name, default, text in rows}
    assert len(by_key) == len(rows)  # no duplicates
    assert by_key["train.micro_batch_size"] == (
        "int",
        1,
        "samples per forward, per rank (not used under max_tokens_per_micro_batch)",
    )
    assert by_key["model.path"] == ("str", "", "required: an HF model directory or a hub id (org/name[@revision])")
    assert by_key["train.adam_betas"][:2] == ("tuple[float, float]", (0.9, 0.95))
    assert by_key["logging.tensorboard"] == ("bool", True, "")
    assert "dpo.beta" not in by_key and "train" not in by_key  # leaves only, of this run config
    assert rows[0][0] == "model.path"  # declaration order


def test_describe_keys_sections_and_optionals():
    rows = {key: (type_, default) for key, type_, default, _ in describe_keys(DPORunConfig)}
    assert rows["dpo.beta"] == ("float | None", None) and rows["dpo.label_smoothing"] == ("float", 0.0)
    rows = {key: (type_name, default) for key, type_name, default, _ in describe_keys(_Outer)}
    assert rows["inner.count"] == ("int | None", None)
    assert rows["sizes"] == ("list[int]", [])
    assert rows["needed"] == ("str", dataclasses.MISSING)


# ------------------------------------------------------------------------------------------ round trip


def test_config_to_dict_plain():
    cfg = load_config(SFTRunConfig, "sft_tiny", REQUIRED)
    data = config_to_dict(cfg)
    assert data["train"]["adam_betas"] == [0.9, 0.95] and isinstance(data["train"]["adam_betas"], list)
    assert data["model"]["path"] == "/models/tiny" and data["data"]["max_length"] == 512
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # plain types only


@pytest.mark.parametrize(
    "cls,preset", [(SFTRunConfig, "sft_tiny"), (RewardModelRunConfig, "rm_tiny"), (DPORunConfig, "dpo_tiny")]
)
def test_round_trip(tmp_path, cls, preset):
    cfg = load_config(
        cls,
        preset,
        [*REQUIRED, "train.adam_betas=[0.8, 0.9]", "model.tokenizer_path=123", "strategy.deepspeed_config="],
    )
    path = save_config(cfg, tmp_path / "out" / "config.yaml")
    assert path == tmp_path / "out" / "config.yaml"
    assert yaml.safe_load(path.read_text()) == config_to_dict(cfg)
    assert load_config(cls, path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temporary file left behind


def test_save_config_replaces_existing(tmp_path):
    path = _write(tmp_path / "config.yaml", "old: content\n")
    cfg = load_config(SFTRunConfig, None, [*REQUIRED, "train.seed=123"])
    save_config(cfg, path)
    assert load_config(SFTRunConfig, path).train.seed == 123


# ------------------------------------------------------------------------------------------ import weight


def test_import_is_light():
    code = "import sys, rlhf.config; print(sorted(m for m in ('torch', 'ray', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
