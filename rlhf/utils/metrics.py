"""Per-step metrics: ``metrics.jsonl`` (one JSON object per optimizer step) and TensorBoard events."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Optional


class MetricsWriter:
    def __init__(self, output_dir: str, filename: str = "metrics.jsonl", tensorboard: bool = True,
                 append: bool = False, tb_prefix: str = "") -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, filename)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")
        self._tb = None
        self._prefix = tb_prefix
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def log(self, row: Dict[str, Any], step: Optional[int] = None) -> None:
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        self._file.flush()  # a crash keeps every finished step
        if self._tb is not None:
            step = row.get("step", 0) if step is None else step
            for key, value in row.items():
                if key != "step" and _is_number(value):
                    self._tb.add_scalar(self._prefix + key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_row(row: Dict[str, Any], keys: tuple = ()) -> str:
    """A compact one-line rendering for the console."""
    parts = []
    for key in keys or tuple(row):
        if key not in row:
            continue
        value = row[key]
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)
