"""The global-batch plan and the LR schedule: pure arithmetic, checked exhaustively on small sizes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

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


def _transformers_multipliers(kind: str, total: int, warmup: int, min_ratio: float) -> list:
    """transformers' own schedulers (a LambdaLR on an optimizer with lr 1, stepped as a run steps it): the
    multiplier each of the ``total`` executed optimizer steps uses. A linear decay with a floor has no transformers
    function; it is ``floor + (1 - floor) x`` transformers' linear shape (verl's and OpenRLHF's form)."""
    from transformers.optimization import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "constant":
        scheduler = get_constant_schedule_with_warmup(optimizer, warmup)
    elif kind == "linear":
        scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total)
    elif min_ratio:
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, min_lr_rate=min_ratio)
    else:
        scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total)
    values = []
    for _ in range(total):
        values.append(optimizer.param_groups[0]["lr"])  # the LR the next optimizer step uses
        optimizer.step()
        scheduler.step()
    if kind == "linear" and min_ratio:
        values = [v if s < warmup else v * (1.0 - min_ratio) + min_ratio for s, v in enumerate(values)]
    return values


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
@pytest.mark.parametrize(
    "total,warmup", [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 5), (6, 0), (6, 2), (6, 6), (10, 3), (37, 0), (37, 36)]
)
def test_the_schedule_is_transformers_on_every_executed_step(kind, min_ratio, total, warmup):
    ours = [
        lr_multiplier(s, total_steps=total, warmup_steps=warmup, kind=kind, min_ratio=min_ratio) for s in range(total)
    ]
    assert ours == _transformers_multipliers(kind, total, warmup, min_ratio)  # the same arithmetic: equal bits


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("total", [1, 2, 3, 6, 100])
def test_no_executed_step_trains_at_lr_0_without_warmup(kind, total):
    """The decay's horizon is ``total``, one past the last executed step: even with the floor at 0 the last step
    trains (a horizon ending at step ``total - 1`` gave a two-step run ``[1, 0]``)."""
    values = [lr_multiplier(s, total_steps=total, warmup_steps=0, kind=kind, min_ratio=0.0) for s in range(total)]
    assert values[0] == 1.0 and min(values) > 0.0
    assert all(a >= b for a, b in zip(values, values[1:]))  # decays monotonically, never turns back up


def test_the_documented_examples():
    """docs/concepts.md's examples: 6 steps with 2 of warm-up, and a one-RL-step run of 2 optimizer steps."""
    cosine = [lr_multiplier(s, total_steps=6, warmup_steps=2, kind="cosine", min_ratio=0.0) for s in range(6)]
    assert cosine == pytest.approx(
        [0.0, 0.5, 1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 + 0.5 * math.cos(3 * math.pi / 4)], abs=1e-15
    )
    two = [lr_multiplier(s, total_steps=2, warmup_steps=0, kind="cosine", min_ratio=0.0) for s in range(2)]
    assert two == pytest.approx([1.0, 0.5], abs=1e-15)


def test_past_the_horizon_the_schedule_stays_at_its_end_and_unknown_kinds_are_named():
    for kind, end in (("cosine", 0.1), ("linear", 0.1), ("constant", 1.0)):
        assert [lr_multiplier(s, total_steps=10, warmup_steps=2, kind=kind, min_ratio=0.1) for s in (10, 11, 25)] == [
            end
        ] * 3
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        lr_multiplier(0, total_steps=5, warmup_steps=0, kind="poly", min_ratio=0.0)
    with pytest.raises(ValueError, match="total_steps must be >= 1"):
        lr_multiplier(0, total_steps=0, warmup_steps=0, kind="cosine", min_ratio=0.0)
