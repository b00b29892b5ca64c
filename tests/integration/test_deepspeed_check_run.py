"""A user's DeepSpeed JSON whose precision fields contradict ``strategy.precision=auto`` once the CLI has resolved it
against the cluster it starts. The checks that need no cluster are in ``tests/unit/test_deepspeed_check.py``."""

from __future__ import annotations

import json
import subprocess
import sys


def _train_sft_cli(tmp_path, tiny_model, sft_data, *overrides, timeout=180):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf.cli.train_sft",
            f"model.path={tiny_model}",
            f"data.train_path={sft_data}",
            f"train.output_dir={tmp_path / 'out'}",
            "logging.tensorboard=false",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# starts a local Ray cluster (in the CLI's process) to resolve precision=auto
def test_cli_checks_precision_fields_once_auto_is_resolved(tmp_path, tiny_model, sft_data):
    """``strategy.precision=auto`` is resolved against the cluster the CLI starts (fp32: CPU workers); the JSON's
    precision fields are then checked against fp32 and the run exits 2 before any actor starts."""
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {"bf16": {"enabled": True}, "communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "bf16"}}
        )
    )
    result = _train_sft_cli(tmp_path, tiny_model, sft_data, f"strategy.deepspeed_config={ds}", "ray.num_cpus=1")
    assert result.returncode == 2, result.stderr[-2000:]
    for field in (
        "bf16.enabled: true but the run trains in fp32 (strategy.precision)",
        "communication_data_type: 'bf16' with fp32 training (strategy.precision)",
        "data_types.grad_accum_dtype: 'bf16' but fp32 training on ZeRO 2",
    ):
        assert field in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no step ran: the groups are made after the check
