"""The training health guard: stop a run whose numbers show it is broken, before it wastes the cluster.

Checked after every step, on the driver, from the logged metrics:

* a non-finite value (NaN / inf) of a watched metric (loss, grad norm, ...);
* the loss, or the grad norm, exactly zero for ``zero_loss_steps`` steps in a row (the signature of a precision
  setting that underflows every gradient, a loss mask that selects nothing, or a saturated, dead model);
* the grad norm above ``spike_factor`` times its running median over the last ``spike_window`` steps;
* RL (the metrics a trainer names in ``Steps.ceilings`` / ``Steps.flat_key``): the KL to the reference above
  ``health.max_kl``, the trainer / engine log-prob gap above ``health.max_logp_mismatch``, and every sample of a
  step scoring the same (``reward_std`` exactly 0) for ``health.flat_reward_steps`` steps in a row.

``health.action=stop`` raises :class:`TrainingHealthError` naming the step, the metric and the value. The guard
runs before the step's checkpoint is written, so the newest checkpoint is the last good state. With
``health.action=skip`` the same error carries the step to the runner, which rewinds to that checkpoint and passes
over the step (``rlhf.trainers.run.Run``).

The guard's state (running median, zero streaks) is a function of the logged rows alone: a resumed or rewound
run rebuilds it from ``metrics.jsonl`` (:meth:`HealthGuard.observe`), so it decides as the uninterrupted run would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Deque, Mapping, Optional, Sequence, Tuple

# A ceiling's metric -> its health.* key, and what a value above it means.
CEILINGS = {
    "kl": (
        "max_kl",
        "the policy has drifted far from its reference (a reward it games, a learning rate too high?)",
    ),
    "logp_mismatch": (
        "max_logp_mismatch",
        "the trainer's log-probs of the sampled tokens are far from the engine's: weights that did not reach the "
        "engines, a precision gap, or samples too far behind the policy (rollout.max_staleness)",
    ),
}


class TrainingHealthError(RuntimeError):
    """A run stopped by the health guard; the message names the step, metric and value; ``step`` is the step."""

    def __init__(self, message: str, step: Optional[int] = None) -> None:
        super().__init__(message)
        self.step = step


class HealthGuard:
    """Args:
    watch: metrics that must stay finite.
    zero_loss_key: the loss whose exact zeros are counted, together with those of ``spike_key`` (``None``:
        neither is checked, e.g. RL, where a batch of all-tied reward groups legitimately gives a zero policy
        loss and gradient).
    zero_loss_steps: consecutive exact zeros (of either) that trip the guard (0: off).
    spike_key: the metric checked for spikes (a grad norm).
    spike_factor: trip when ``value > spike_factor * median`` (0: off).
    spike_window: steps in the running median; the check starts once the window holds ``min_history``.
    ceilings: metric -> the largest value allowed, named by its ``health.*`` key in messages (:data:`CEILINGS`).
    flat_key: the metric whose exact zeros mean "every sample scored the same" (``reward_std``; ``None``: off).
    flat_steps: consecutive such steps that trip the guard (0: off).
    """

    def __init__(
        self,
        watch: Sequence[str],
        zero_loss_key: Optional[str] = "loss",
        zero_loss_steps: int = 3,
        spike_key: str = "grad_norm",
        spike_factor: float = 10.0,
        spike_window: int = 20,
        min_history: int = 5,
        ceilings: Optional[Mapping[str, float]] = None,
        flat_key: Optional[str] = None,
        flat_steps: int = 0,
    ) -> None:
        self.watch, self.zero_loss_key, self.zero_loss_steps = tuple(watch), zero_loss_key, zero_loss_steps
        self.ceilings = {k: v for k, v in (ceilings or {}).items() if v}
        self.flat_key, self.flat_steps, self._flat = flat_key, flat_steps, 0
        self.spike_key, self.spike_factor, self.min_history = spike_key, spike_factor, min_history
        self._history: Deque[float] = deque(maxlen=spike_window)
        self._zeros = {key: 0 for key in (zero_loss_key, spike_key) if key is not None}

    def observe(self, rows: Sequence[dict]) -> None:
        """Take in the rows of steps already done (a resumed or rewound run) without judging them."""
        for row in rows:
            self.problem(row)

    def problem(self, row: dict) -> Optional[str]:
        """What is wrong with this step's metrics, or ``None``; updates the running statistics. A skipped step
        (``"skipped"`` in the row) trained nothing: it is neither judged nor counted."""
        if row.get("skipped"):
            return None
        step = row.get("step")
        for key in self.watch:
            value = row.get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                return f"step {step}: {key} = {value} (not finite)"
        if self.zero_loss_key is not None and self.zero_loss_steps:
            for key in self._zeros:
                self._zeros[key] = self._zeros[key] + 1 if row.get(key) == 0.0 else 0
                if self._zeros[key] >= self.zero_loss_steps:
                    return (
                        f"step {step}: {key} = 0.0 exactly for {self._zeros[key]} steps in a row (a precision "
                        f"setting, a loss mask or a saturated model that stops every gradient?)"
                    )
        for key, ceiling in self.ceilings.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and value > ceiling:
                config_key, meaning = CEILINGS[key]
                return f"step {step}: {key} = {value:.4g} is above health.{config_key}={ceiling:g}: {meaning}"
        if self.flat_key is not None and self.flat_steps:
            self._flat = self._flat + 1 if row.get(self.flat_key) == 0.0 else 0
            if self._flat >= self.flat_steps:
                return (
                    f"step {step}: {self.flat_key} = 0.0 for {self._flat} steps in a row (health.flat_reward_steps="
                    f"{self.flat_steps}): every sample scored the same, no learning signal is left (a collapsed "
                    f"policy, a saturated or broken reward?)"
                )
        value = row.get(self.spike_key)
        # a step whose gradient is exactly 0 trained on no signal (an RL step whose groups all tied): it says nothing
        # of the usual scale, and counted it would drag the median of a sparse-reward run down until an ordinary
        # step looked like a spike
        if self.spike_factor and isinstance(value, (int, float)) and value != 0:
            if len(self._history) >= self.min_history:
                median = statistics.median(self._history)
                if median > 0 and value > self.spike_factor * median:
                    return (
                        f"step {step}: {self.spike_key} = {value:.4g} is {value / median:.3g}x the running "
                        f"median {median:.4g} of the last {len(self._history)} steps (limit "
                        f"{self.spike_factor:g}x)"
                    )
            self._history.append(float(value))
        return None


def guard_from_config(
    health,
    watch: Sequence[str],
    zero_loss_key: Optional[str],
    spike_key: str = "grad_norm",
    ceilings: Tuple[str, ...] = (),
    flat_key: Optional[str] = None,
):
    """The run's guard from its ``health`` config section, or ``None`` when ``health.action=off``. ``ceilings``:
    the metrics of :data:`CEILINGS` the trainer logs (each checked against its ``health.*`` key)."""
    if health.action == "off":
        return None
    return HealthGuard(
        watch,
        zero_loss_key=zero_loss_key,
        zero_loss_steps=health.zero_loss_steps,
        spike_key=spike_key,
        spike_factor=health.spike_factor,
        spike_window=health.spike_window,
        ceilings={key: getattr(health, CEILINGS[key][0]) for key in ceilings},
        flat_key=flat_key,
        flat_steps=health.flat_reward_steps,
    )


def check_health(guard: Optional[HealthGuard], action: str, row: dict, say=print) -> None:
    """Apply ``guard`` to a logged row: raise (``stop``, ``skip``: the runner rewinds) or print (``warn``)."""
    if guard is None:
        return
    problem = guard.problem(row)
    if problem is None:
        return
    if action == "stop":
        raise TrainingHealthError(
            f"health guard: {problem}; stopped (health.action=stop), the newest checkpoint is the last good state",
            step=row.get("step"),
        )
    if action == "skip":
        raise TrainingHealthError(f"health guard: {problem}", step=row.get("step"))
    say(f"[health] warning: {problem}")
