"""A user's DeepSpeed JSON that contradicts the run is reported, naming the field, before training starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf.config.deepspeed_check import contradictions

RUN = dict(zero_stage=2, micro_batch_size=2, grad_accum_steps=4, world_size=2, max_grad_norm=1.0)


def _found(user, precision="bf16"):
    return contradictions(user, precision=precision, **RUN)


def test_a_json_that_agrees_with_the_run_passes():
    user = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "train_batch_size": 16,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "overlap_comm": True},
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "train_batch_size_note": "ignored",
    }
    assert _found(user) == []
    assert _found({"train_batch_size": "auto", "bf16": {"enabled": "auto"}}) == []


@pytest.mark.parametrize(
    "user, field",
    [
        ({"train_batch_size": 32}, "train_batch_size: 32 but the run uses 16"),
        ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu: 4 but the run uses 2"),
        ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps: 1 but the run uses 4"),
        ({"gradient_clipping": 0.5}, "gradient_clipping: 0.5 but the run uses 1.0"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage: 3 but the run uses 2"),
        ({"optimizer": {"type": "Adam"}}, "optimizer: the run builds AdamW"),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler: the run builds the schedule"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled: both on"),
        ({"communication_data_type": "fp32"}, "communication_data_type: 'fp32' with bf16 training"),
        ({"communication_data_type": "fp16"}, "communication_data_type: 'fp16' with bf16 training"),
        (
            {"data_types": {"grad_accum_dtype": "bf16"}},
            "data_types.grad_accum_dtype: 'bf16' but bf16 training on ZeRO 2 accumulates gradients in fp32",
        ),
    ],
)
def test_each_contradiction_names_its_field(user, field):
    found = _found(user)
    assert any(f.startswith(field) for f in found), found


def test_the_runs_own_dtypes_pass_in_any_spelling():
    assert _found({"communication_data_type": "torch.bfloat16", "data_types": {"grad_accum_dtype": "float32"}}) == []
    # bf16 on ZeRO 0 accumulates in bf16: DeepSpeed implements no other mix without ZeRO
    stage0 = dict(RUN, zero_stage=0)
    assert contradictions({"data_types": {"grad_accum_dtype": "bf16"}}, precision="bf16", **stage0) == []
    assert [
        f.split(":")[0]
        for f in contradictions({"data_types": {"grad_accum_dtype": "fp32"}}, precision="bf16", **stage0)
    ] == ["data_types.grad_accum_dtype"]


def test_precision_fields_wait_for_auto_to_resolve():
    user = {"bf16": {"enabled": True}, "communication_data_type": "fp32"}
    assert _found(user, precision=None) == []
    assert [f.split(":")[0] for f in _found(user, precision="fp32")] == ["bf16.enabled"]
    assert [f.split(":")[0] for f in _found(user, precision="bf16")] == ["communication_data_type"]


def test_cli_exits_2_naming_the_fields_before_any_actor(tmp_path, tiny_model, sft_data):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 99, "fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf.cli.train_sft",
            f"model.path={tiny_model}",
            f"data.train_path={sft_data}",
            f"train.output_dir={tmp_path / 'out'}",
            f"strategy.deepspeed_config={ds}",
            "ray.address=ray://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "strategy.deepspeed_config" in result.stderr and "train_batch_size: 99" in result.stderr
    assert "fp16.enabled and bf16.enabled: both on" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "final").exists()
