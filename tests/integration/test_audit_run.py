"""``python -m rlhf.cli.audit`` for real on the tiny model (Ray actors): a correct SFT config (exit 0 and a table) and
one that only a run can show to be broken (dropout left on in a model that has it). The unit tests of the audit
(factorisations, lint, verdicts) are in ``tests/unit/test_audit.py``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from shared_helpers import run_main

AUDIT = "rlhf.cli.audit"


def _audit(argv, tmp_path, capsys, monkeypatch):
    rc, out, err = run_main(AUDIT, argv, tmp_path, capsys, monkeypatch)
    assert "Traceback" not in out + err
    return rc, out, err


# --------------------------------------------------------------------------------------------- real audits


def _run_config(tmp_path, model, data, extra="") -> str:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"defaults: [sft_tiny]\nmodel:\n  path: {model}\ndata:\n  train_path: {data}\n"
        f"train:\n  global_batch_size: 8\n  micro_batch_size: 2\n  num_workers: 2\n"
        f"  output_dir: {tmp_path / 'outputs' / 'sft'}\n{extra}"
    )
    return str(path)


@pytest.mark.usefixtures("ray_session")
def test_a_correct_sft_config_keeps_the_contract(tiny_model, sft_data, tmp_path, capsys, monkeypatch):
    (tmp_path / "outputs").mkdir()  # the runs go next to train.output_dir (storage the cluster writes)
    rc, out, err = _audit(
        ["--config", _run_config(tmp_path, tiny_model, sft_data), "--steps", "2"], tmp_path, capsys, monkeypatch
    )
    assert rc == 0, out + err
    assert (
        "runs: 3 factorisations of the global batch 8 (micro x accumulation x ranks), 2 step(s) each: 2x2x2 (the "
        "configured split), 1x4x2 (micro 1), 2x4x1 (one rank)" in out
    )
    header = next(line for line in out.splitlines() if line.startswith("step"))
    assert header.split() == [
        "step",
        "lr",
        "loss",
        "2x2x2",
        "loss",
        "1x4x2",
        "loss",
        "2x4x1",
        "loss",
        "rel",
        "grad_norm",
        "rel",
        "worst",
        "other",
        "(rel)",
        "tol",
        "verdict",
    ]
    rows = [line.split() for line in out.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [r[0] for r in rows] == ["1", "2"] and all(r[-1] == "ok" for r in rows)
    assert "final weights: worst relative L2 difference" in out
    assert out.rstrip().splitlines()[-1].startswith("VERDICT: contract kept: 3 factorisations agree on 2 step(s)")
    assert not [p for p in os.listdir(tmp_path / "outputs") if p.startswith("rlhf-audit-")]  # runs removed
    assert not os.path.exists(tmp_path / "outputs" / "sft")  # the user's own output directory is never touched


@pytest.mark.usefixtures("ray_session")
def test_dropout_left_on_is_found_by_the_runs(tiny_model, sft_data, tmp_path, capsys, monkeypatch):
    """Nothing in the config is refused (dropout may be wanted, and the config cannot know whether the model has
    any): the lint warns, and the runs show that the factorisations train differently from step 1. Two runs show
    it (``--factorizations``: the configured split and micro 1 on its one rank, not a third run)."""
    model = str(tmp_path / "with_dropout")
    shutil.copytree(tiny_model, model)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["attention_dropout"] = 0.1
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    argv = [
        "--config",
        _run_config(tmp_path, model, sft_data),
        "--steps",
        "1",
        "--factorizations",
        "1x4x1",
        "model.disable_dropout=false",
        "train.num_workers=1",
        "train.global_batch_size=4",
    ]
    rc, out, err = _audit(argv, tmp_path, capsys, monkeypatch)
    assert rc == 1, out + err
    assert "warning  model.disable_dropout=false" in out and "2x2x1 (the configured split)" in out
    assert "runs: 2 factorisations of the global batch 4" in out
    assert out.rstrip().splitlines()[-1].startswith("VERDICT: FAIL at step 1: ")
