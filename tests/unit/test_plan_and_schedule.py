"""The global-batch plan and the LR schedule: pure arithmetic, checked exhaustively on small sizes."""
from __future__ import annotations

import itertools

import pytest

from rlhf.data.plan import EpochPlan, PlanError
from rlhf.utils.schedule import lr_multiplier


@pytest.mark.parametrize("n,gb,epochs,max_steps", [(21, 4, 2, -1), (16, 4, 3, -1), (37, 8, 2, 5), (9, 3, 4, 100)])
def test_every_step_is_one_full_global_batch_of_one_epoch(n, gb, epochs, max_steps):
    plan = EpochPlan(num_samples=n, global_batch_size=gb, max_epochs=epochs, max_steps=max_steps, seed=5)
    steps = list(plan.steps())
    expected = (n // gb) * epochs if max_steps < 0 else min((n // gb) * epochs, max_steps)
    assert len(steps) == plan.total_steps == expected
    for s in steps:
        assert len(s.indices) == gb and len(set(s.indices)) == gb  # never a partial accumulation window
    for epoch, group in itertools.groupby(steps, key=lambda s: s.epoch):
        rows = [i for s in group for i in s.indices]
        assert len(rows) == len(set(rows)), f"epoch {epoch} repeats a row"  # one epoch = one permutation
        assert len(rows) <= (n // gb) * gb


def test_epochs_reshuffle_and_drop_a_different_remainder():
    plan = EpochPlan(num_samples=21, global_batch_size=4, max_epochs=3, seed=1)
    used = [frozenset(i for s in plan.steps() if s.epoch == e for i in s.indices) for e in (1, 2, 3)]
    assert len(set(used)) > 1  # the dropped remainder is chosen after each epoch's shuffle
    assert plan.permutation(1) != plan.permutation(2)


def test_step_is_a_pure_function_of_seed_and_step():
    plan = EpochPlan(num_samples=50, global_batch_size=6, max_epochs=3, seed=11)
    assert [plan.step(s.step) for s in plan.steps()] == list(plan.steps())  # random access == iteration
    assert list(plan.steps(start=9)) == list(plan.steps())[8:]  # a resume replays exactly the same data
    other = EpochPlan(num_samples=50, global_batch_size=6, max_epochs=3, seed=12)
    assert plan.step(1).indices != other.step(1).indices


@pytest.mark.parametrize("workers,micro", [(1, 8), (1, 1), (2, 2), (2, 1), (4, 2)])
def test_shards_cover_the_global_batch_in_order(workers, micro):
    step = EpochPlan(num_samples=30, global_batch_size=8, max_epochs=1, seed=0).step(2)
    shards = step.shards(workers, micro)
    assert len(shards) == workers and all(len(r) == 8 // (workers * micro) for r in shards)
    assert [i for rank in shards for mb in rank for i in mb] == step.indices
    assert all(len(mb) == micro for rank in shards for mb in rank)


def test_too_little_data_is_an_error_naming_the_key():
    with pytest.raises(PlanError, match="train.global_batch_size=8"):
        EpochPlan(num_samples=7, global_batch_size=8, max_epochs=1)


def test_cosine_schedule_hits_floor_on_last_step_and_never_rises():
    total, warm = 10, 2
    values = [lr_multiplier(s, total_steps=total, warmup_steps=warm, kind="cosine", min_ratio=0.1) for s in range(total)]
    assert values[0] == pytest.approx(1 / 3) and values[1] == pytest.approx(2 / 3) and values[2] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[2:], values[3:]))
    assert lr_multiplier(25, total_steps=total, warmup_steps=warm, kind="cosine", min_ratio=0.1) == pytest.approx(0.1)


def test_linear_and_constant_schedules():
    lin = [lr_multiplier(s, total_steps=5, warmup_steps=0, kind="linear", min_ratio=0.0) for s in range(5)]
    assert lin == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert lr_multiplier(3, total_steps=5, warmup_steps=0, kind="constant", min_ratio=0.0) == 1.0
    # a one-step run trains at the full LR rather than at the floor
    assert lr_multiplier(0, total_steps=1, warmup_steps=0, kind="cosine", min_ratio=0.0) == 1.0
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        lr_multiplier(0, total_steps=5, warmup_steps=0, kind="poly", min_ratio=0.0)
