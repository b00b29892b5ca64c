"""Exact resume of DPO with held-out evaluation: stopped at step 7 (mid-epoch) and resumed, it ends with the
uninterrupted run's metrics.jsonl, eval.jsonl and bit-identical weights. The reference is the starting policy,
precomputed by the policy's own ranks: the resumed run scores it again before its checkpoint is restored, so it
gets the same log-probs. (SFT and faults: test_resume.py.)"""

from __future__ import annotations

import pytest
from resume_helpers import _assert_identical, _overrides, _stop_and_resume

from rlhf.config.loader import load_config
from rlhf.config.schema import DPORunConfig

pytestmark = pytest.mark.usefixtures("ray_session")


def test_dpo_resumed_equals_uninterrupted_with_eval(tiny_model, pair_data, tmp_path):
    from rlhf.trainers.offline.dpo import train_dpo

    def base(out):
        return _overrides(
            tiny_model, pair_data, out, f"data.eval_path={pair_data}", "train.eval_every=2", "dpo.ref_mode=precompute"
        )

    train_dpo(load_config(DPORunConfig, None, base(str(tmp_path / "whole"))))
    _stop_and_resume(DPORunConfig, None, train_dpo, base, str(tmp_path / "split"), stop_after=7)
    _assert_identical(str(tmp_path / "whole"), str(tmp_path / "split"), files=("metrics.jsonl", "eval.jsonl"))
