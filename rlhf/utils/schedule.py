"""Learning-rate schedules as pure functions of the optimizer step.

The horizon is the run's exact number of optimizer steps (``min(max_steps, epochs x steps_per_epoch)``), so a
cosine schedule reaches its floor on the last step and never turns back up (the OpenRLHF PR #1351 bug came
from flooring the horizon differently from the step count).
"""
from __future__ import annotations

import math


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the base LR used by optimizer step ``step`` (0-based).

    Warmup is linear from ``1 / (warmup_steps + 1)`` to 1 over the first ``warmup_steps`` steps. After it, ``constant``
    stays at 1, ``linear`` and ``cosine`` decay to ``min_ratio`` at the last step (``total_steps - 1``).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps - 1
    # A run with a single post-warmup step trains it at the full LR rather than at the floor.
    progress = 0.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "linear":
        shape = 1.0 - progress
    elif kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr schedule {kind!r}; valid: constant, linear, cosine")
    return min_ratio + (1.0 - min_ratio) * shape
