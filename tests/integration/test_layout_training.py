"""A downloaded preference layout through a real trainer: DPO on UltraFeedback-binarized rows (a prompt string
beside whole conversations, score columns) trains exactly as on the explicit conversational pairs they mean: the
same logged losses, step by step. (The layouts themselves: tests/unit/test_data_layouts.py.)"""

from __future__ import annotations

import json

import pytest
from offline_helpers import _overrides, _rows

from rlhf.config.loader import load_config
from rlhf.config.schema import DPORunConfig
from rlhf.synthetic.arithmetic import make_preference_rows

pytestmark = pytest.mark.usefixtures("ray_session")


def _ultrafeedback(row: dict) -> dict:
    user = [{"role": "user", "content": row["prompt"]}]
    return {
        "prompt": row["prompt"],
        "chosen": user + [{"role": "assistant", "content": row["chosen"]}],
        "rejected": user + [{"role": "assistant", "content": row["rejected"]}],
        "score_chosen": 8.5,
        "score_rejected": 3.0,
    }


def _explicit(row: dict) -> dict:
    return {
        "prompt": [{"role": "user", "content": row["prompt"]}],
        "chosen": [{"role": "assistant", "content": row["chosen"]}],
        "rejected": [{"role": "assistant", "content": row["rejected"]}],
    }


def test_dpo_on_ultrafeedback_rows_trains_as_on_the_explicit_pairs(tiny_model, tmp_path):
    from rlhf.trainers.offline.dpo import train_dpo

    pairs = make_preference_rows(8, seed=11)
    logged = {}
    for name, layout in (("ultrafeedback", _ultrafeedback), ("explicit", _explicit)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(layout(r)) + "\n" for r in pairs), encoding="utf-8")
        out = str(tmp_path / name)
        extra = ("dpo.ref_mode=precompute", "dpo.beta=0.5", "data.max_length=128")
        cfg = load_config(DPORunConfig, overrides=_overrides(tiny_model, str(data), out, 4, 2, 1, 0, 1, extra=extra))
        train_dpo(cfg)
        logged[name] = _rows(out)
    assert len(logged["explicit"]) == 2
    for ultra, explicit in zip(logged["ultrafeedback"], logged["explicit"]):
        for key in ("loss", "grad_norm", "rewards/margin", "rewards/accuracy"):
            assert ultra[key] == pytest.approx(explicit[key], rel=1e-6, abs=1e-9), key
