"""A hazard of a run config, named by its key (:class:`Finding`), and the epoch arithmetic every trainer's batch
findings share (:func:`epoch_findings`): the audit's lint (:mod:`rlhf.audit.lint`) collects them, each trainer's
descriptor contributes those of its own batches (``TrainerKind.lint_batches``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from rlhf.config.schema import RunConfig, TrainConfig
from rlhf.data.plan import EpochPlan

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    """One hazard: ``level`` (error | warning), the config ``key`` it is about (with ``=value`` when that helps),
    and what is wrong."""

    level: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"

    def name(self) -> str:
        """The key, with the DeepSpeed field for a finding about the user's JSON: what a verdict line names."""
        if self.key == "strategy.deepspeed_config":
            return f"{self.key} ({self.message.split(':', 1)[0]})"
        return self.key


def epoch_findings(batch: int, key: str, unit: str, rows: int, t: TrainConfig) -> List[Finding]:
    """Rows against one step's batch: not one step, rows left over each epoch, ``max_steps`` beyond the epochs."""
    if rows < batch:
        return [Finding(ERROR, f"{key}={batch}", f"data.train_path has only {rows} {unit}: not one step fits")]
    plan = EpochPlan(num_samples=rows, global_batch_size=batch, max_epochs=t.max_epochs)  # the trainers' own rule
    per_epoch, total = plan.steps_per_epoch, plan.total_steps
    left = rows - per_epoch * batch
    found = []
    if left:
        found.append(
            Finding(
                WARNING,
                f"{key}={batch}",
                f"data.train_path's {rows} {unit} give {per_epoch} steps per epoch and leave {left} "
                f"{unit} unused per epoch (dropped after each reshuffle, a different {left} each epoch; "
                f"never a partial accumulation window)",
            )
        )
    if t.max_steps != -1 and t.max_steps > total:
        epochs = math.ceil(t.max_steps / per_epoch)
        found.append(
            Finding(
                ERROR,
                f"train.max_steps={t.max_steps}",
                f"the data gives only {t.max_epochs} epoch(s) x {per_epoch} steps = {total} steps "
                f"(a run is min(train.max_steps, train.max_epochs x steps per epoch)); set "
                f"train.max_epochs={epochs} or train.max_steps<={total}",
            )
        )
    return found


def offline_batch_findings(cfg: RunConfig, rows: Optional[int]) -> List[Finding]:
    """An offline trainer's batch findings (``TrainerKind.lint_batches``): the epochs its ``rows`` give at
    ``train.global_batch_size`` (none when the rows are not counted)."""
    if rows is None:
        return []
    return epoch_findings(cfg.train.global_batch_size, "train.global_batch_size", "rows", rows, cfg.train)
