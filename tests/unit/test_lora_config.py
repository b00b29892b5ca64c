"""model.lora.* in the run config and its checks before any actor starts (the trainers are called here, in a unit
test: a Ray cluster started by one fails the test, tests/unit/conftest.py)."""

from __future__ import annotations

import re

import pytest
from shared_helpers import uneven_pair_rows, write_jsonl

from rlhf.config import ConfigError, DPORunConfig, SFTRunConfig, load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
from rlhf.trainers.context import check_lora_targets, lora_spec
from rlhf.trainers.kinds import kind_of


def _cfg(cls, tiny_model, data, *overrides, preset=None):
    return load_config(cls, preset, [f"model.path={tiny_model}", f"data.train_path={data}", *overrides])


def test_the_keys_build_the_spec_and_bad_values_name_their_key():
    cfg = load_config(
        SFTRunConfig,
        None,
        [
            "model.path=m",
            "data.train_path=d",
            "model.lora.r=8",
            "model.lora.alpha=32",
            "model.lora.target_modules=[q_proj,v_proj]",
        ],
    )
    spec = lora_spec(cfg)
    assert (spec.r, spec.scaling, spec.target_modules) == (8, 4.0, ("q_proj", "v_proj"))
    assert lora_spec(load_config(SFTRunConfig, None, ["model.path=m", "data.train_path=d"])) is None
    bad = {
        "model.lora.r=-2": "model.lora.r must be an integer >= 0",
        "model.lora.alpha=0": "model.lora.alpha must be a finite number > 0",
        "model.lora.dropout=1.5": "model.lora.dropout must be in [0, 1)",
        "model.lora.target_modules=[]": "model.lora.target_modules must name modules",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            load_config(SFTRunConfig, None, ["model.path=m", "data.train_path=d", "model.lora.r=4", override])
    with pytest.raises(ConfigError, match=r"^model.lora.dropout is 0.1, but model.disable_dropout=true"):
        load_config(
            SFTRunConfig, None, ["model.path=m", "data.train_path=d", "model.lora.r=4", "model.lora.dropout=0.1"]
        )
    with pytest.raises(ConfigError, match="all-linear"):  # the spec's own rule: the shorthand alone
        lora_spec(
            load_config(
                SFTRunConfig,
                None,
                [
                    "model.path=m",
                    "data.train_path=d",
                    "model.lora.r=4",
                    "model.lora.target_modules=[all-linear,q_proj]",
                ],
            )
        )


def test_targets_that_match_nothing_are_named_with_the_layers_there_are(tiny_model):
    cfg = load_config(
        SFTRunConfig,
        None,
        [f"model.path={tiny_model}", "data.train_path=d", "model.lora.r=4", "model.lora.target_modules=[qkv_proj]"],
    )
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=.*qkv_proj.*matches no.*q_proj"):
        check_lora_targets(cfg, [(tiny_model, CAUSAL_LM)])
    head = load_config(
        SFTRunConfig,
        None,
        [f"model.path={tiny_model}", "data.train_path=d", "model.lora.r=4", "model.lora.target_modules=[score]"],
    )
    with pytest.raises(ConfigError, match="score"):
        check_lora_targets(head, [(tiny_model, SCALAR_HEAD)])


def test_train_sft_refuses_bad_targets_before_any_actor_starts(tiny_model, sft_data, tmp_path):
    from rlhf.trainers.offline.sft import train_sft

    cfg = _cfg(
        SFTRunConfig,
        tiny_model,
        sft_data,
        f"train.output_dir={tmp_path / 'out'}",
        "model.lora.r=4",
        "model.lora.target_modules=[not_a_layer]",
    )
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        train_sft(cfg)  # a Ray cluster started here would fail the test (unit conftest)


def test_with_lora_the_reference_is_the_base_and_asks_for_no_workers(tiny_model, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", uneven_pair_rows(4, seed=0))
    dpo = _cfg(DPORunConfig, tiny_model, pairs, "model.lora.r=4")
    assert dpo.model.reference_is_base and [a.role for a in kind_of(dpo).plan(dpo, 0.0).actors] == ["policy"]
    other = _cfg(DPORunConfig, tiny_model, pairs, "model.lora.r=4", "model.ref_path=/some/other/model")
    assert not other.model.reference_is_base and "reference" in [a.role for a in kind_of(other).plan(other, 0.0).actors]
    rl = ["reward.functions=[rlhf.synthetic.arithmetic:reward]", "algo.kl_coef=0.01", "model.lora.r=4"]
    cfg = _cfg(RLRunConfig, tiny_model, pairs, *rl, preset="grpo_tiny")
    assert "reference" not in [a.role for a in kind_of(cfg).plan(cfg, 0.0).actors]
    with pytest.raises(ConfigError, match=r"^colocate.policy_reference has nothing to colocate"):
        _cfg(RLRunConfig, tiny_model, pairs, *rl, "colocate.policy_reference=true", preset="grpo_tiny")


def test_dry_run_shows_lora_and_checks_its_targets(tiny_model, tmp_path, capsys):
    from rlhf.cli.dry_run import dry_run

    pairs = write_jsonl(tmp_path / "pairs.jsonl", uneven_pair_rows(4, seed=0))
    dry_run(
        _cfg(DPORunConfig, tiny_model, pairs, "model.lora.r=8", "model.lora.target_modules=[q_proj,v_proj]"),
        "train_dpo",
        cluster="1x4cpu",
    )
    out = capsys.readouterr().out
    assert (
        "LoRA: r 8, alpha 16 on q_proj, v_proj; the reference is the frozen base under the adapters (no "
        "reference workers)"
    ) in out and "dpo.ref_mode" not in out
    with pytest.raises(ConfigError, match="matches no Linear layer"):
        dry_run(
            _cfg(DPORunConfig, tiny_model, pairs, "model.lora.r=8", "model.lora.target_modules=[qkv]"),
            "train_dpo",
            cluster="1x4cpu",
        )


def test_the_models_lora_wraps_are_the_ones_a_run_trains(tiny_model, tmp_path):
    """The policy (a reward model's with its head), and a GAE run's critic (its own path, else the policy's)."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", uneven_pair_rows(4, seed=0))
    dpo = _cfg(DPORunConfig, tiny_model, pairs, "model.lora.r=4")
    assert kind_of(dpo).trained_models(dpo) == [(tiny_model, CAUSAL_LM)]
    rl = ["reward.functions=[rlhf.synthetic.arithmetic:reward]", "model.lora.r=4"]
    grpo = _cfg(RLRunConfig, tiny_model, pairs, *rl, preset="grpo_tiny")
    assert kind_of(grpo).trained_models(grpo) == [(tiny_model, CAUSAL_LM)]
    gae = _cfg(RLRunConfig, tiny_model, pairs, *rl, "algo.advantage_estimator=gae", preset="grpo_tiny")
    assert kind_of(gae).trained_models(gae) == [(tiny_model, CAUSAL_LM), (tiny_model, SCALAR_HEAD)]
    critic = _cfg(
        RLRunConfig,
        tiny_model,
        pairs,
        *rl,
        "algo.advantage_estimator=gae",
        f"critic.path={tmp_path}",
        preset="grpo_tiny",
    )
    assert kind_of(critic).trained_models(critic)[1] == (str(tmp_path), SCALAR_HEAD)
