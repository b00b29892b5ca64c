"""Weights & Biases as a third destination of the per-step metrics (after ``metrics.jsonl`` and TensorBoard).

``logging.wandb_mode=offline`` (the default) needs no network or account: the run is written under
``output_dir/wandb/`` and can be uploaded later with ``wandb sync output_dir/wandb/offline-run-*``. A resumed
run continues the same W&B run (its id is kept in ``output_dir/wandb_run_id``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Dict, Literal, cast


class WandbSink:
    """One W&B run, shared by a run's metric writers (:class:`rlhf.utils.metrics.RunWriters`), which hand it the
    finite scalars of each row (this module imports nothing of ``rlhf``: the writers call it, not the reverse)."""

    def __init__(self, output_dir: str, project: str, mode: str, name: str, config: Dict[str, Any]) -> None:
        import wandb  # only a run with logging.wandb=true pays for importing wandb

        os.makedirs(output_dir, exist_ok=True)
        id_file = os.path.join(output_dir, "wandb_run_id")
        if os.path.isfile(id_file):
            with open(id_file, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_file, "w", encoding="utf-8") as f:
                f.write(run_id)
        # cast: logging.wandb_mode is validated to one of these two at config construction
        self._run = wandb.init(
            project=project,
            name=name or os.path.basename(os.path.normpath(output_dir)),
            dir=output_dir,
            mode=cast(Literal["online", "offline"], mode),
            config=config,
            id=run_id,
            resume="allow",
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, scalars: Dict[str, float], step: int) -> None:
        """``scalars``: the row's finite numbers under their (prefixed) names; W&B keeps the first record of a
        step."""
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
