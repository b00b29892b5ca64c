"""fp64, the audit precision (``strategy.precision=fp64``, ZeRO 0, CPU): what the config accepts and refuses, the
DeepSpeed config it builds, and the dtypes scoring and weight sync keep. No actors: the factorisation runs (worker
groups training in lockstep, fp64 against fp32) are in ``tests/integration/test_fp64_run.py``.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.config.deepspeed_check import grad_accum_dtype
from rlhf.config.schema import FP64_REFUSED_STAGES, ConfigError, StrategyConfig
from rlhf.distributed.engine import EngineSpec, build_ds_config


# ------------------------------------------------------------------------------------------------ config (fast)
def test_fp64_is_accepted_on_zero_0():
    assert StrategyConfig(precision="fp64", zero_stage=0).precision == "fp64"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp64_is_refused_on_zero_1_to_3_naming_the_stage_and_why(stage):
    with pytest.raises(
        ConfigError,
        match=rf"^strategy\.precision is fp64, which runs on ZeRO 0 only "
        rf"\(strategy\.zero_stage=0\), got strategy\.zero_stage={stage}: ",
    ) as err:
        StrategyConfig(precision="fp64", zero_stage=stage)
    assert str(err.value).endswith(FP64_REFUSED_STAGES[stage]) and "float32" in str(err.value)


def test_fp64_with_the_default_stage_is_refused_when_the_config_is_loaded():
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig

    with pytest.raises(ConfigError, match=r"strategy\.zero_stage=2: DeepSpeed's ZeRO 1/2 optimizer"):
        load_config(SFTRunConfig, overrides=["model.path=m", "data.train_path=d.jsonl", "strategy.precision=fp64"])
    with pytest.raises(ConfigError, match=r"^strategy\.precision is fp64, which cannot offload the optimizer"):
        StrategyConfig(precision="fp64", zero_stage=0, offload_optimizer=True)
    with pytest.raises(ConfigError, match=r"^model\.attn_implementation is eager, which strategy\.precision=fp64"):
        load_config(
            SFTRunConfig,
            overrides=[
                "model.path=m",
                "data.train_path=d.jsonl",
                "strategy.precision=fp64",
                "strategy.zero_stage=0",
                "model.attn_implementation=eager",
            ],
        )


def test_fp64_deepspeed_config_leaves_the_accumulation_dtype_to_the_weights():
    spec = EngineSpec(
        zero_stage=0,
        precision="fp64",
        micro_batch_size=1,
        grad_accum_steps=2,
        user_config={"data_types": {"grad_accum_dtype": "fp32"}},
    )
    cfg = build_ds_config(spec, world_size=2, max_grad_norm=1.0)
    assert cfg["bf16"] == {"enabled": False} and cfg["fp16"] == {"enabled": False}
    assert "grad_accum_dtype" not in cfg["data_types"] and "communication_data_type" not in cfg
    assert grad_accum_dtype("fp64", 0) == "fp64"
    with pytest.raises(ValueError, match="ZeRO 0 only"):
        build_ds_config(EngineSpec(zero_stage=2, precision="fp64", micro_batch_size=1, grad_accum_steps=1), 1, 1.0)


def test_fp64_user_json_dtype_fields_are_refused():
    from rlhf.config.deepspeed_check import contradictions

    run = dict(zero_stage=0, micro_batch_size=1, grad_accum_steps=2, world_size=2, max_grad_norm=1.0, precision="fp64")
    for user, field in (
        ({"communication_data_type": "fp32"}, "communication_data_type"),
        ({"communication_data_type": "fp64"}, "communication_data_type"),
        ({"data_types": {"grad_accum_dtype": "float64"}}, "data_types.grad_accum_dtype"),
        ({"bf16": {"enabled": True}}, "bf16.enabled"),
    ):
        assert [f.split(":")[0] for f in contradictions(user, **run)] == [field], user
    assert contradictions({"zero_optimization": {"stage": 0}, "bf16": {"enabled": False}}, **run) == []


def test_score_functions_keep_float64_and_upcast_half_precision():
    from rlhf.ops.logprobs import at_least_float32

    x = torch.ones(2, dtype=torch.float32)
    assert at_least_float32(x) is x and at_least_float32(x.double()).dtype == torch.float64
    assert at_least_float32(x.bfloat16()).dtype == torch.float32


def test_weight_sync_sends_a_float64_policy_as_float32():
    from rlhf.rollout.weights.senders import _engine_dtypes

    named = [
        ("w", torch.randn(3, dtype=torch.float64)),
        ("b", torch.ones(2, dtype=torch.bfloat16)),
        ("n", torch.arange(2)),
    ]
    sent = dict(_engine_dtypes(iter(named)))
    assert [sent[k].dtype for k in ("w", "b", "n")] == [torch.float32, torch.bfloat16, torch.int64]
    assert torch.equal(sent["w"], named[0][1].float())
