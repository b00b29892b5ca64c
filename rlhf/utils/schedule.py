"""Learning-rate schedules as pure functions of the optimizer step.

The schedules are transformers' (``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup``,
``get_cosine_schedule_with_warmup``; with a floor, ``get_cosine_with_min_lr_schedule_with_warmup``) on every step a
run executes, so a config ported from a transformers / TRL / OpenRLHF run trains with the same LRs. The horizon is
the run's exact number of optimizer steps ``total_steps`` (``min(max_steps, epochs x steps_per_epoch)``): the decay
reaches its floor at step ``total_steps``, one past the last executed step (``total_steps - 1``), so no executed
step after the warm-up trains at LR 0 (a horizon that ended at the last executed step trained it at LR 0: half the
updates of a two-step run). Within a warm-up, step 0 does train at LR 0, as in transformers. Flooring the horizon
differently from the step count makes a cosine turn back up before the run ends (the OpenRLHF PR #1351 bug); here
it cannot, and past the horizon the multiplier stays at the floor.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the base LR used by optimizer step ``step`` (0-based) of a run of ``total_steps`` steps.

    Warm-up (steps ``0 .. warmup_steps - 1``) is transformers': ``step / warmup_steps``, linear from 0, so **step 0
    of a run with warm-up trains at LR 0** (its gradient still enters Adam's moments) and the full LR is reached at
    step ``warmup_steps``. After it, with ``progress = (step - warmup_steps) / (total_steps - warmup_steps)``:

    - ``constant``: 1;
    - ``linear``: ``min_ratio + (1 - min_ratio) * (1 - progress)``;
    - ``cosine``: ``min_ratio + (1 - min_ratio) * (1 + cos(pi * progress)) / 2``.

    ``progress`` reaches 1 (the floor ``min_ratio``) at step ``total_steps``, which is never executed: the last
    executed step trains above the floor. With ``min_ratio = 0`` these are transformers' functions exactly; with a
    floor, the cosine is ``get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate=min_ratio)`` exactly and the
    linear decay takes the same ``floor + (1 - floor) x shape`` form (verl, OpenRLHF). Steps from ``total_steps``
    on (none in a run; LambdaLR computes one after the last step) give the floor (``constant``: 1), where
    transformers' cosine would rise again.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
    if step >= total_steps:  # past the run (never executed): the end of the schedule, never back up
        return 1.0 if kind == "constant" else min_ratio
    if step < warmup_steps:
        return float(step) / float(warmup_steps)
    if kind == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps  # >= 1 here: warmup_steps <= step < total_steps
    if kind == "linear":
        # (total - step) / decay as transformers writes it (not 1 - progress), so the values are its bits
        shape = float(total_steps - step) / float(decay_steps)
    else:
        progress = float(step - warmup_steps) / float(decay_steps)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return shape * (1.0 - min_ratio) + min_ratio
