"""Shared by the resume test files: run overrides (21 rows / global batch 4: the stop falls mid-epoch), rows
without wall-clock keys, and the stop-then-resume sequence with its checkpoint checks."""

from __future__ import annotations

import glob
import json
import os

import torch

from rlhf.config.loader import load_config
from rlhf.trainers.checkpoint import Checkpoints

# Wall-clock measurements differ between any two runs; everything else must be identical.
TIMING_KEYS = ("step_time_s",)


def _overrides(model, data, out, *extra):
    # 21 rows / global batch 4 -> 5 steps per epoch (one row dropped per epoch), 2 epochs -> 10 steps.
    return [
        f"model.path={model}",
        f"data.train_path={data}",
        f"train.output_dir={out}",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "train.num_workers=2",
        "strategy.zero_stage=2",
        "train.max_epochs=2",
        "train.lr=1e-3",
        "train.warmup_steps=2",
        "train.seed=3",
        "data.max_length=64",
        "logging.tensorboard=false",
        *extra,
    ]


def _rows(out, name="metrics.jsonl"):
    with open(os.path.join(out, name)) as f:
        return [
            {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS and not k.startswith("perf/")}
            for line in f
        ]


def _weights(final_dir):
    from safetensors.torch import load_file

    out = {}
    for path in glob.glob(os.path.join(final_dir, "*.safetensors")):
        out.update(load_file(path))
    return out


def _assert_identical(a_dir, b_dir, files=("metrics.jsonl",)):
    for name in files:
        assert _rows(a_dir, name) == _rows(b_dir, name), name
    a, b = _weights(os.path.join(a_dir, "final")), _weights(os.path.join(b_dir, "final"))
    assert a and set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def _stop_and_resume(cls, preset, train, base_overrides, out, stop_after):
    stopped = train(
        load_config(
            cls,
            preset,
            [
                *base_overrides(out),
                f"train.stop_after_steps={stop_after}",
                "train.save_every=3",
                "train.keep_checkpoints=1",
            ],
        )
    )
    assert stopped.stopped_at == stop_after and stopped.final_dir is None
    assert not os.path.exists(os.path.join(out, "final"))
    # keep_checkpoints=1: the periodic step-3 and step-6 checkpoints are gone, the stop's step-7 one stays
    assert [step for step, _ in Checkpoints(out, keep=1).complete()] == [stop_after]
    assert len(_rows(out)) == stop_after
    resumed = train(
        load_config(
            cls, preset, [*base_overrides(out), "train.resume=true", "train.save_every=3", "train.keep_checkpoints=1"]
        )
    )
    assert resumed.final_dir and resumed.stopped_at is None
    return resumed
