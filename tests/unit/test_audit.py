"""``python -m rlhf.cli.audit``: factorisations, the lint of deliberately broken configs (each hazard -> exit 1
naming its key) and the verdict on synthetic tables. No actors: the two real audits on the tiny model are in
``tests/integration/test_audit_run.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from shared_helpers import run_main

from rlhf.audit import compare
from rlhf.audit.compare import Tolerances, WeightsDiff
from rlhf.audit.factorizations import factorizations, parse_factorizations, with_configured
from rlhf.audit.lint import Finding, from_config_error
from rlhf.audit.runner import audit_overrides, runs_deepspeed_config, split_fits, split_overrides
from rlhf.audit.trainers import infer_trainer
from rlhf.config.loader import load_config, save_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError, SFTRunConfig

AUDIT = "rlhf.cli.audit"


# --------------------------------------------------------------------------------------------- factorisations


@pytest.mark.parametrize(
    "batch, micro, ranks, expected",
    [
        (8, 2, 2, ["2x2x2", "1x4x2", "2x4x1"]),  # configured, micro 1 on its ranks, its micro on one rank
        (8, 8, 1, ["8x1x1", "1x8x1", "2x4x1"]),  # one rank already: the next split is micro 2
        (8, 1, 1, ["1x8x1", "2x4x1", "4x2x1"]),  # micro 1 and one rank already: micro 2, then 4
        (8, 1, 2, ["1x4x2", "1x8x1", "2x2x2"]),
        (12, 3, 2, ["3x2x2", "1x6x2", "3x4x1"]),
        (3, 1, 1, ["1x3x1", "3x1x1"]),  # a prime global batch on one rank has only two
        (1, 1, 1, ["1x1x1"]),
    ],
)
def test_factorisations_of_a_global_batch(batch, micro, ranks, expected):
    found = factorizations(batch, micro, ranks)
    assert [f.label for f in found] == expected
    assert found[0].why == "configured"
    assert all(f.global_batch == batch for f in found)


def test_factorisations_respect_another_groups_ranks():
    # an RL critic with 2 fixed ranks: micro x 2 must divide the batch of 4, so micro 4 on one rank is out
    fits = lambda micro, ranks: 4 % (micro * 2) == 0  # noqa: E731
    assert [f.label for f in factorizations(4, 1, 1, fits=fits)] == ["1x4x1", "2x2x1"]


def test_factorisations_given_by_hand():
    configured = factorizations(8, 2, 2)[0]
    chosen = with_configured(configured, parse_factorizations("8x1x1, 2x2x2,1x8x1", 8))
    assert [f.label for f in chosen] == ["2x2x2", "8x1x1", "1x8x1"]
    for bad in ("3x1x1", "2x2", "ax1x1", "0x8x1"):
        with pytest.raises(ValueError):
            parse_factorizations(bad, 8)


# --------------------------------------------------------------------------------------------- lint through the CLI


def _base(model, data):
    return [
        "--trainer",
        "sft",
        f"model.path={model}",
        f"data.train_path={data}",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.num_workers=2",
        "strategy.zero_stage=2",
    ]


def _ds_json(tmp_path, content) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    return str(path)


def _audit(argv, tmp_path, capsys, monkeypatch):
    rc, out, err = run_main(AUDIT, argv, tmp_path, capsys, monkeypatch)
    assert "Traceback" not in out + err
    return rc, out, err


@pytest.mark.parametrize(
    "extra, json_content, key, text",
    [
        (
            ["strategy.precision=bf16"],
            {"communication_data_type": "fp32"},
            "strategy.deepspeed_config",
            "communication_data_type: 'fp32' with bf16 training",
        ),
        (
            [],
            {"communication_data_type": "fp32"},  # auto: the GPU run it prepares trains in bf16
            "strategy.deepspeed_config",
            "[with strategy.precision=auto on GPU workers (bf16)]",
        ),
        (["strategy.precision=fp16"], None, "strategy.precision=fp16", "not supported: DeepSpeed's fp16 path"),
        (
            ["strategy.precision=fp32"],
            {"fp16": {"enabled": True, "loss_scale": 1}},
            "strategy.deepspeed_config",
            "fp16.loss_scale=1: fp16 without loss scaling",
        ),
        (
            ["strategy.precision=fp32"],
            {"fp16": {"enabled": True, "loss_scale": 128}},
            "strategy.deepspeed_config",
            "fp16.loss_scale=128: a static loss scale, no dynamic scaling",
        ),
        (
            ["strategy.precision=fp32"],
            {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
            "strategy.deepspeed_config",
            "torch_autocast.enabled: true with dtype 'bfloat16' but the run trains in fp32",
        ),
        (
            [],
            {"gradient_accumulation_steps": 4},
            "strategy.deepspeed_config",
            "gradient_accumulation_steps: 4 but the run uses 2",
        ),
        (["train.global_batch_size=6"], None, "train.global_batch_size", "must be divisible by train.micro_batch_size"),
        (["train.global_batch_size=32"], None, "train.global_batch_size=32", "has only 21 rows: not one step fits"),
        (
            ["train.max_steps=10", "train.max_epochs=2"],
            None,
            "train.max_steps=10",
            "the data gives only 2 epoch(s) x 2 steps = 4 steps",
        ),
    ],
)
def test_each_hazard_exits_1_naming_its_key_before_any_run(
    extra, json_content, key, text, tiny_model, sft_data, tmp_path, capsys, monkeypatch
):
    argv = _base(tiny_model, sft_data) + extra
    if json_content is not None:
        argv.append(f"strategy.deepspeed_config={_ds_json(tmp_path, json_content)}")
    rc, out, _ = _audit(argv, tmp_path, capsys, monkeypatch)
    assert rc == 1, out
    assert f"error    {key}: " in out and text in out, out
    assert f"VERDICT: FAIL (lint): {key}" in out and "runs:" not in out


def test_warnings_alone_pass_the_lint(tiny_model, sft_data, tmp_path, capsys, monkeypatch):
    argv = _base(tiny_model, sft_data) + [
        "model.disable_dropout=false",
        "strategy.zero_stage=0",
        "strategy.precision=bf16",
        "--lint-only",
    ]
    rc, out, _ = _audit(argv, tmp_path, capsys, monkeypatch)
    assert rc == 0, out
    assert "lint: 0 error(s), 3 warning(s)" in out
    assert "train.global_batch_size=8: data.train_path's 21 rows give 2 steps per epoch and leave 5 rows unused" in out
    assert "warning  model.disable_dropout=false: " in out
    assert "warning  strategy.zero_stage=0: bf16 training on ZeRO 0 sums the 2 micro-batch gradients" in out
    assert "VERDICT: lint ok" in out


def test_with_precision_auto_a_contradiction_of_the_cpu_run_only_is_a_warning(
    tiny_model, sft_data, tmp_path, capsys, monkeypatch
):
    ds = _ds_json(tmp_path, {"bf16": {"enabled": True}})
    argv = _base(tiny_model, sft_data) + [f"strategy.deepspeed_config={ds}", "--lint-only"]
    rc, out, _ = _audit(argv, tmp_path, capsys, monkeypatch)
    assert rc == 0, out
    assert (
        "warning  strategy.deepspeed_config: bf16.enabled: true but the run trains in fp32 (strategy.precision) "
        "[with strategy.precision=auto on CPU workers (fp32)]" in out
    )


def test_rl_hazards(tiny_model, rl_prompts, tmp_path, capsys, monkeypatch):
    argv = [
        "--config",
        "grpo_tiny",
        f"model.path={tiny_model}",
        f"data.train_path={rl_prompts}",
        "algo.advantage_estimator=gae",
        "critic.num_workers=3",
        "rollout.prompts_per_step=6",
        "rollout.n_samples_per_prompt=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
    ]
    rc, out, _ = _audit(argv, tmp_path, capsys, monkeypatch)
    assert rc == 1 and out.startswith("audit: ppo config grpo_tiny"), out
    assert "error    critic.num_workers=3: train.global_batch_size (8) must be divisible by" in out
    assert (
        "warning  rollout.prompts_per_step=6: data.train_path's 64 prompts give 10 steps per epoch and leave "
        "4 prompts unused" in out
    )
    assert "warning  train.global_batch_size=8: each rollout batch of 12 samples" in out and "leaves 4 samples" in out


def test_rl_algorithm_settings_that_train_something_else_are_warned(
    tiny_model, rl_prompts, tmp_path, capsys, monkeypatch
):
    """Read from the registry entries: a token sum under gradient clipping, and GSPO with PPO's clip range."""
    argv = [
        "--lint-only",
        "--config",
        "grpo_tiny",
        f"model.path={tiny_model}",
        f"data.train_path={rl_prompts}",
        "algo.policy_loss=gspo",
        "algo.clip_low=0.2",
        "algo.clip_high=0.2",
        "algo.loss_agg_mode=seq-mean-token-sum",
    ]
    rc, out, _ = _audit(argv, tmp_path, capsys, monkeypatch)
    assert rc == 0  # warnings alone
    assert "warning  algo.loss_agg_mode=seq-mean-token-sum: sums each response's ~" in out, out
    assert "clips almost every step" in out
    assert "warning  algo.clip_low: 0.2 / 0.2 with policy loss gspo" in out and "3e-4" not in out
    assert "its paper clips at 0.0003 / 0.0004" in out
    rc, out, _ = _audit(argv[:5], tmp_path, capsys, monkeypatch)  # the paper's settings: no such warning
    assert rc == 0 and "algo.clip" not in out and "seq-mean-token-sum" not in out


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--trainer", "sft", "data.train_path=x.jsonl"], "model.path is required"),
        (
            ["--trainer", "sft", "model.path=m", "data.train_path=x.jsonl", "train.micro_bach_size=2"],
            "unknown config key 'train.micro_bach_size'",
        ),
        (["model.path=m", "data.train_path=x.jsonl"], "cannot tell which trainer this config is for"),
        (
            ["--trainer", "sft", "model.path=m", "data.train_path=x.jsonl", "strategy.deepspeed_config=missing.json"],
            "strategy.deepspeed_config: cannot read",
        ),
    ],
)
def test_usage_and_config_errors_exit_2(argv, text, tmp_path, capsys, monkeypatch):
    rc, out, err = _audit(argv, tmp_path, capsys, monkeypatch)
    assert rc == 2 and "error: " in err and text in err, (out, err)


def test_the_runs_preflight_refuses_before_the_audits_cluster_starts(sft_data, tmp_path, capsys, monkeypatch):
    not_a_model = tmp_path / "weights"
    not_a_model.mkdir()
    rc, out, err = _audit(_base(not_a_model, sft_data), tmp_path, capsys, monkeypatch)
    assert rc == 2 and f"error: model.path: '{not_a_model}' is not an HF model directory (no config.json)" in err
    assert "lint: 0 error(s)" in out and "runs:" not in out + err, (out, err)


def test_a_global_batch_without_another_split_or_a_bad_chosen_split_exits_2(
    tiny_model, sft_data, tmp_path, capsys, monkeypatch
):
    single = [
        f"model.path={tiny_model}",
        f"data.train_path={sft_data}",
        "--trainer",
        "sft",
        "train.global_batch_size=1",
        "train.micro_batch_size=1",
    ]
    rc, _, err = _audit(single, tmp_path, capsys, monkeypatch)
    assert rc == 2 and "train.global_batch_size=1 has no other factorisation than 1x1x1" in err
    rc, _, err = _audit(_base(tiny_model, sft_data) + ["--factorizations", "3x1x1"], tmp_path, capsys, monkeypatch)
    assert rc == 2 and "--factorizations '3x1x1'" in err


def test_config_errors_that_refuse_a_hazard_become_findings():
    assert from_config_error("strategy.precision is fp16, which is not supported: ...") == Finding(
        "error", "strategy.precision=fp16", "not supported: ..."
    )
    assert from_config_error("train.global_batch_size (6) must be divisible by ...").key == "train.global_batch_size"
    assert from_config_error("model.path is required (an HF model directory or a hub id, org/name)") is None
    assert from_config_error("strategy.precision is fp64, which runs on ZeRO 0 only (... fp16 ...)") is None


# --------------------------------------------------------------------------------------------- which trainer


def test_the_trainer_is_told_by_sections_presets_and_saved_configs(tmp_path):
    ov = ["model.path=m", "data.train_path=d.jsonl"]
    assert infer_trainer("dpo_tiny", ov) == "dpo"
    assert infer_trainer("rm_tiny", ov) == "rm"
    assert infer_trainer("grpo_tiny", ov) == "ppo"
    assert infer_trainer("sft_tiny", ov) == "sft"  # no section of its own: the preset's name
    assert infer_trainer(None, ov + ["dpo.beta=0.2"]) == "dpo"
    own = tmp_path / "mine.yaml"
    own.write_text("defaults: [sft_tiny]\ntrain:\n  lr: 1.0e-4\n")
    assert infer_trainer(str(own), ov) == "sft"
    rm_file = tmp_path / "rm.yaml"
    rm_file.write_text("rm:\n  use_margin: true\n")
    assert infer_trainer(str(rm_file), ov) == "rm"
    saved = tmp_path / "config.yaml"
    save_config(load_config(SFTRunConfig, overrides=ov), saved)
    assert infer_trainer(str(saved)) == "sft"
    with pytest.raises(ConfigError, match=r"pass --trainer sft\|rm\|dpo\|ppo"):
        infer_trainer(None, ov)
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'"):
        infer_trainer("sft_tiny", ov + ["train.lrr=1"])
    with pytest.raises(ConfigError, match="not found"):
        infer_trainer(str(tmp_path / "nope.yaml"), ov)


# --------------------------------------------------------------------------------------------- the runs' configs


def test_every_runs_config_loads_and_differs_only_where_it_should(tmp_path):
    ov = [
        "model.path=m",
        "data.train_path=d.jsonl",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.num_workers=2",
        "train.save_every=5",
        "health.action=skip",
        "train.skip_steps=[3]",
        "data.eval_path=e.jsonl",
        "train.eval_every=2",
        "train.max_steps=100",
    ]
    cfg = load_config(SFTRunConfig, "sft_tiny", ov)
    for f in factorizations(8, 2, 2):
        run = load_config(
            SFTRunConfig, "sft_tiny", ov + audit_overrides(cfg, 3, str(tmp_path / f.label)) + split_overrides(cfg, f)
        )
        t = run.train
        assert (t.micro_batch_size, t.num_workers, t.grad_accum_steps) == (f.micro, f.ranks, f.accum)
        assert (t.max_steps, t.save_every, t.skip_steps, t.eval_every, run.data.eval_path) == (3, 0, (), 0, "")
        assert t.save_final and not run.logging.tensorboard and run.health.action == "warn"
        assert (t.lr, t.global_batch_size, run.strategy.zero_stage) == (cfg.train.lr, 8, 2)
    fp64 = load_config(SFTRunConfig, "sft_tiny", ov + audit_overrides(cfg, 3, str(tmp_path / "x"), "fp64"))
    assert (fp64.strategy.precision, fp64.strategy.zero_stage) == ("fp64", 0)


def test_under_a_token_budget_the_configured_run_keeps_it_and_the_others_cut_by_rows(tmp_path):
    ov = [
        "model.path=m",
        "data.train_path=d.jsonl",
        "train.global_batch_size=8",
        "train.num_workers=2",
        "train.micro_batch_size=3",
        "train.max_tokens_per_micro_batch=256",
        "train.packing=true",
    ]
    cfg = load_config(SFTRunConfig, "sft_tiny", ov)
    splits = factorizations(8, cfg.train.engine_micro_batch_size, cfg.train.num_workers)
    assert splits[0].why == "configured" and len(splits) == 3
    runs = [
        load_config(
            SFTRunConfig, "sft_tiny", ov + audit_overrides(cfg, 3, str(tmp_path / f.label)) + split_overrides(cfg, f)
        ).train
        for f in splits
    ]
    assert (runs[0].max_tokens_per_micro_batch, runs[0].num_workers) == (256, 2)
    assert all(t.max_tokens_per_micro_batch == 0 and t.packing for t in runs[1:])
    assert [(t.micro_batch_size, t.num_workers) for t in runs[1:]] == [(f.micro, f.ranks) for f in splits[1:]]


def test_rl_runs_move_the_groups_tied_to_the_policy_ranks(tmp_path):
    ov = [
        "model.path=m",
        "data.train_path=d.jsonl",
        "algo.advantage_estimator=gae",
        "train.num_workers=2",
        "critic.num_workers=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "rollout.num_engines=2",
        "colocate.hybrid_engine=true",
    ]
    cfg = load_config(RLRunConfig, "grpo_tiny", ov)
    splits = factorizations(8, 2, 2, fits=split_fits(cfg))
    assert [f.label for f in splits] == ["2x2x2", "1x4x2", "2x4x1"]
    run = load_config(
        RLRunConfig, "grpo_tiny", ov + audit_overrides(cfg, 2, str(tmp_path / "o")) + split_overrides(cfg, splits[2])
    )
    assert (run.train.num_workers, run.critic.num_workers, run.rollout.num_engines) == (1, 1, 1)
    assert run.train.max_steps == 2  # RL steps
    fixed = load_config(RLRunConfig, "grpo_tiny", ov + ["critic.num_workers=4"])
    assert not split_fits(fixed)(4, 1) and split_fits(fixed)(2, 1)  # 8 % (micro x 4 critic ranks)


def test_the_runs_deepspeed_json_drops_what_each_split_sets(tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    path = runs_deepspeed_config(user, str(tmp_path))
    assert json.loads(open(path).read()) == {
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    path = runs_deepspeed_config(user, str(tmp_path), fp64=True)
    assert json.loads(open(path).read()) == {"zero_optimization": {"overlap_comm": True}, "data_types": {}}
    assert runs_deepspeed_config({"zero_optimization": {"overlap_comm": True}}, str(tmp_path)) == ""


# --------------------------------------------------------------------------------------------- verdicts


TOL = Tolerances(first=1e-5, later=1e-3, weights=1e-3, atol=1e-5)
LABELS = {"2x2x2": "2x2x2 (configured)", "1x4x2": "1x4x2 (micro 1)", "2x4x1": "2x4x1 (one rank)"}


def _rows(losses, grad_norms, **extra):
    return [
        {
            "step": i + 1,
            "epoch": 1,
            "loss": loss,
            "grad_norm": gn,
            "lr": 1e-3,
            "num_samples": 8,
            "num_tokens": 100,
            "step_time_s": 0.1 * (i + 1),
            **{k: v[i] for k, v in extra.items()},
        }
        for i, (loss, gn) in enumerate(zip(losses, grad_norms))
    ]


def _verdict(runs, weights=(), rl=False):
    steps = compare.compare_steps(runs, TOL, rl=rl)
    return steps, compare.verdict(steps, list(weights), TOL, {k: LABELS.get(k, k) for k in runs})


def test_a_table_that_agrees_keeps_the_contract():
    runs = {
        "2x2x2": _rows([6.0, 5.0, 4.0], [9.0, 6.0, 3.0]),
        "1x4x2": _rows([6.0 * (1 + 1e-7), 5.0 * (1 + 5e-4), 4.0], [9.0, 6.0 * (1 - 2e-4), 3.0]),
        "2x4x1": _rows([6.0, 5.0, 4.0], [9.0, 6.0, 3.0]),
    }
    steps, v = _verdict(runs, [WeightsDiff("1x4x2", 2e-5, "w"), WeightsDiff("2x4x1", 0.0, "w")])
    assert v.code == 0 and v.line.startswith("VERDICT: contract kept: 3 factorisations agree on 3 step(s)")
    assert [s.status for s in steps] == ["ok"] * 3
    lines = compare.table(steps, "loss", list(runs))
    assert lines[0].split()[:3] == ["step", "lr", "loss"] and len(lines) == 4
    assert "step_time_s" not in " ".join(lines)  # timings are not compared


def test_a_table_that_breaks_at_step_2_fails_naming_step_2_and_the_metric():
    runs = {
        "2x2x2": _rows([6.0, 5.0, 4.0], [9.0, 6.0, 3.0]),
        "1x4x2": _rows([6.0, 5.0, 4.0], [9.0, 6.0 * 1.02, 3.0]),  # grad norm 2% off at step 2
        "2x4x1": _rows([6.0, 5.0, 4.0], [9.0, 6.0, 3.0]),
    }
    steps, v = _verdict(runs)
    assert v.code == 1
    assert v.line.startswith(
        "VERDICT: FAIL at step 2: grad_norm of 1x4x2 (micro 1) is 6.12 vs 6 in 2x2x2 "
        "(configured): relative difference 2.0e-02 > tolerance 1e-03"
    ), v.line
    assert [s.status for s in steps] == ["ok", "FAIL", "ok"]
    assert "FAIL grad_norm" in compare.table(steps, "loss", list(runs))[2]


def test_step_1_has_the_tight_tolerance_and_counts_must_be_equal():
    runs = {"2x2x2": _rows([6.0, 5.0], [9.0, 6.0]), "1x4x2": _rows([6.0 * (1 + 1e-4), 5.0], [9.0, 6.0])}
    assert "FAIL at step 1: loss of 1x4x2" in _verdict(runs)[1].line  # 1e-4 is fine later, not at step 1
    other = _rows([6.0, 5.0], [9.0, 6.0])
    other[1]["num_tokens"] = 99
    line = _verdict({"2x2x2": _rows([6.0, 5.0], [9.0, 6.0]), "2x4x1": other})[1].line
    assert "FAIL at step 2: num_tokens of 2x4x1 (one rank) is 99 vs 100" in line


def test_numbers_near_zero_are_compared_absolutely():
    runs = {
        "2x2x2": _rows([6.0], [9.0], **{"rewards/margin": [0.0]}),
        "1x4x2": _rows([6.0], [9.0], **{"rewards/margin": [3e-7]}),
    }
    assert _verdict(runs)[1].code == 0
    runs["1x4x2"][0]["rewards/margin"] = 3e-4
    assert "FAIL at step 1: rewards/margin" in _verdict(runs)[1].line


def test_missing_steps_metrics_and_non_finite_values_fail():
    short = _rows([6.0], [9.0])
    full = _rows([6.0, 5.0], [9.0, 6.0])
    assert "1x4x2 (micro 1) logged no step 2" in _verdict({"2x2x2": full, "1x4x2": short})[1].line
    longer = _rows([6.0, 5.0], [9.0, 6.0])
    assert (
        "logged step 2, which 2x2x2 (configured) did not"
        in _verdict({"2x2x2": _rows([6.0], [9.0]), "1x4x2": longer})[1].line
    )
    nan = _rows([float("nan")], [9.0])
    assert _verdict({"2x2x2": _rows([6.0], [9.0]), "1x4x2": nan})[1].code == 1
    no_loss = _rows([6.0], [9.0])
    del no_loss[0]["loss"]
    assert "1x4x2 (micro 1) logged no loss" in _verdict({"2x2x2": _rows([6.0], [9.0]), "1x4x2": no_loss})[1].line


def test_final_weights_past_tolerance_fail_naming_the_tensor():
    runs = {"2x2x2": _rows([6.0], [9.0]), "2x4x1": _rows([6.0], [9.0])}
    line = _verdict(runs, [WeightsDiff("2x4x1", 5e-2, "model.norm.weight")])[1].line
    assert line == (
        "VERDICT: FAIL in the final weights: 2x4x1 (one rank) vs 2x2x2 (configured): model.norm.weight "
        "differs by 5.0e-02 (relative L2) > tolerance 1e-03"
    )
    unreadable = WeightsDiff("2x4x1", float("inf"), "", "the saved tensors differ")
    assert "tensors differ" in _verdict(runs, [unreadable])[1].line


def test_rl_rollouts_that_differ_after_step_1_end_the_comparison():
    def rl_rows(rewards):
        return _rows(
            [0.01] * len(rewards),
            [1.0] * len(rewards),
            policy_loss=[0.01] * len(rewards),
            reward_mean=rewards,
            response_length=[4.0] * len(rewards),
        )

    runs = {"8x1x1": rl_rows([0.5, 0.6, 0.7]), "1x8x1": rl_rows([0.5, 0.65, 0.7])}
    steps, v = _verdict(runs, rl=True)
    assert [s.status for s in steps] == ["ok", "rollouts differ", "not compared"]
    assert v.code == 1 and "FAIL at step 2: the rollouts differ (reward_mean of 1x8x1" in v.line
    assert "--precision fp64 tells the two apart" in v.line
    runs = {"8x1x1": rl_rows([0.5]), "1x8x1": rl_rows([0.55])}  # step 1: the engines had the same weights
    assert [s.status for s in _verdict(runs, rl=True)[0]] == ["FAIL"]


def test_default_tolerances_follow_the_precision():
    assert compare.tolerances_for("fp64") == Tolerances(1e-10, 1e-10, 1e-8, 1e-12)
    assert compare.tolerances_for("bf16").first == 3e-3
    assert compare.tolerances_for("fp32", later=1e-4) == Tolerances(1e-5, 1e-4, 1e-3, 1e-5)


def test_the_audit_modules_import_nothing_heavy():
    code = (
        "import sys, rlhf.cli.audit, rlhf.audit.lint, rlhf.audit.compare, rlhf.audit.factorizations, "
        "rlhf.audit.trainers, rlhf.audit.runner; "
        "print([m for m in ('ray', 'vllm', 'deepspeed') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
