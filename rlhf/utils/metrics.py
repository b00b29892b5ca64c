"""Per-step metrics: ``metrics.jsonl`` (one JSON object per optimizer step), TensorBoard events and W&B
(:mod:`rlhf.utils.wandb_sink`) through :class:`RunWriters`; reading the files back; the console's per-step lines,
table and progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, TextIO, Tuple

from rlhf.atomic import write_text_atomic
from rlhf.config.loader import config_to_dict
from rlhf.config.schema import RunConfig
from rlhf.utils.log import get_logger
from rlhf.utils.wandb_sink import WandbSink

if TYPE_CHECKING:  # imported where used: only a run with logging.tensorboard=true pays for it
    from torch.utils.tensorboard import SummaryWriter

log = get_logger(__name__)

# What the writers put in a run's output_dir (rlhf/trainers/output_dir.py counts them as the run's artifacts).
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsWriter:
    """One JSON line per step into ``output_dir/filename``, and the numbers to TensorBoard and W&B (``wandb``, a
    :class:`~rlhf.utils.wandb_sink.WandbSink` shared by the run's writers) under ``tb_prefix``.

    ``resume_after``: ``None`` starts the file afresh; a step number continues a resumed (or rewound) run: rows of
    later steps are cut from the file, and TensorBoard drops its events from that step on (``purge_step``), so the
    re-run steps are not shown twice. W&B keeps the first record of a step (its steps only move forward).
    """

    def __init__(
        self,
        output_dir: str,
        filename: str = METRICS_FILE,
        tensorboard: bool = True,
        resume_after: Optional[int] = None,
        tb_prefix: str = "",
        wandb: Optional[WandbSink] = None,
    ) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir, self.path = output_dir, os.path.join(output_dir, filename)
        self._tensorboard, self._wandb, self._prefix = tensorboard, wandb, tb_prefix
        self._file: Optional[TextIO] = None
        self._tb: Optional[SummaryWriter] = None
        self._open(resume_after)

    def _open(self, resume_after: Optional[int]) -> None:
        if resume_after is not None:
            truncate_jsonl(self.path, resume_after)
        self._file = open(self.path, "w" if resume_after is None else "a", encoding="utf-8")
        if self._tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_after is None else resume_after + 1
            self._tb = SummaryWriter(os.path.join(self.output_dir, TENSORBOARD_DIR), purge_step=purge)

    def rewind(self, step: int) -> None:
        """Continue after ``step``: forget what was logged for later steps."""
        self._close_files()
        self._open(step)

    def log(self, row: Dict[str, Any], step: Optional[int] = None) -> None:
        assert self._file is not None, "__init__ opened it (and rewind reopens it)"
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        self._file.flush()  # a crash keeps every finished step
        step = int(row.get("step", 0) if step is None else step)
        scalars = {self._prefix + k: v for k, v in row.items() if k != "step" and is_finite_number(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step)

    def close(self) -> None:
        self._close_files()

    def _close_files(self) -> None:
        assert self._file is not None, "__init__ opened it"
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def truncate_jsonl(path: str, last_step: int) -> int:
    """Keep the rows of a metrics file with ``step <= last_step``; returns the number kept. A missing file is left
    missing. Written to a temporary file and renamed: a crash leaves the old file or the new one."""
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    write_text_atomic(path, kept)
    return len(kept)


SKIPPED_NOTE = "skipped (train.skip_steps or the health guard)"


def skipped_row(step: int, epoch: int) -> dict:
    """The row logged for a step passed over (``train.skip_steps`` or a health-guard skip): nothing trained."""
    return {"step": step, "epoch": epoch, "skipped": 1}


class MetricsFileError(ValueError):
    """A metrics file that cannot be read; the message names the file and line."""


def read_metrics(path: str) -> List[dict]:
    """The rows of a ``metrics.jsonl`` / ``eval.jsonl``; every row must be a JSON object with a ``step``."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MetricsFileError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or "step" not in row:
                raise MetricsFileError(f"{path}:{number}: a metrics row must be an object with a 'step'")
            rows.append(row)
    return rows


class RunWriters:
    """A run's ``metrics.jsonl`` writer and, with held-out data, its ``eval.jsonl`` writer, sharing one W&B run.

    ``resume_after``: the step a resumed run continues after (``None``: a fresh run); see :class:`MetricsWriter`.
    """

    def __init__(self, cfg: RunConfig, resume_after: Optional[int], with_eval: bool) -> None:
        lg, out = cfg.logging, cfg.train.output_dir
        self.wandb: Optional[WandbSink] = None
        if lg.wandb:
            self.wandb = WandbSink(out, lg.wandb_project, lg.wandb_mode, lg.wandb_run_name, config_to_dict(cfg))
        self.metrics = MetricsWriter(out, tensorboard=lg.tensorboard, resume_after=resume_after, wandb=self.wandb)
        self.eval = (
            MetricsWriter(
                out,
                EVAL_FILE,
                tensorboard=lg.tensorboard,
                resume_after=resume_after,
                tb_prefix="eval/",
                wandb=self.wandb,
            )
            if with_eval
            else None
        )

    def rewind(self, step: int) -> None:
        """Go back to just after ``step`` (a health-guard rewind to a checkpoint)."""
        for writer in (self.metrics, self.eval):
            if writer is not None:
                writer.rewind(step)

    def close(self) -> None:
        for writer in (self.metrics, self.eval):
            if writer is not None:
                writer.close()
        if self.wandb is not None:
            self.wandb.close()


def is_finite_number(value: Any) -> bool:
    """A real number worth plotting: int or float, not bool, not NaN/inf."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plural(n: int, noun: str) -> str:
    """``"1 engine"``, ``"2 engines"``: a count and its noun, for console and ``--dry-run`` lines."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_row(row: Dict[str, Any], keys: tuple = ()) -> str:
    """A compact one-line rendering for the console."""
    parts = []
    for key in keys or tuple(row):
        if key not in row:
            continue
        value = row[key]
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


class Progress:
    """Steps done out of the run's total with elapsed time and ETA (from this invocation's mean step time).

    ``bar``: draw a tqdm progress bar on stderr (per-step lines are then logged inside tqdm's
    ``external_write_mode``, as ``tqdm.write`` writes, so the bar stays at the bottom); ``None`` draws it when
    stderr is a terminal.
    """

    def __init__(self, total: int, done: int = 0, bar: Optional[bool] = None, desc: str = "") -> None:
        self.total, self.start_done, self._started = total, done, time.perf_counter()
        self.done = done
        if bar is None:
            bar = sys.stderr.isatty()
        self._bar = None
        if bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, desc=desc, dynamic_ncols=True, unit="step")

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self.done)
        self.done = step

    def eta(self) -> str:
        """``"elapsed 1m02s, eta 3m10s"`` (no ETA before the first step of this invocation)."""
        elapsed = time.perf_counter() - self._started
        left = self.remaining()
        return f"elapsed {_clock(elapsed)}" + (f", eta {left}" if left != "-" else "")

    def remaining(self) -> str:
        """Time left at this invocation's mean step time, e.g. ``"3m10s"``; ``"-"`` before the first step."""
        steps = self.done - self.start_done
        if not steps:
            return "-"
        return _clock((self.total - self.done) * (time.perf_counter() - self._started) / steps)

    def print(self, line: str) -> None:
        """Log ``line`` (a console line, :mod:`rlhf.utils.log`) above the bar."""
        if self._bar is None:
            log.info(line)
            return
        # tqdm.write's own steps, the line going through the logger (a capture gets it too): clear the bars,
        # write, redraw them
        with self._bar.external_write_mode():
            log.info(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class ConsoleTable:
    """Per-step rows in aligned columns, the header printed first and again every ``header_every`` rows.

    Args:
        columns: ``(metric key, heading)`` pairs; a metric missing from a row prints as ``-``.
    """

    def __init__(self, columns: Sequence[Tuple[str, str]], width: int = 10, header_every: int = 20) -> None:
        self.columns, self.width, self.header_every = tuple(columns), width, header_every
        self._rows = 0

    def render(self, row: Dict[str, Any]) -> str:
        lines = []
        if self._rows % self.header_every == 0:
            lines.append(" ".join(f"{heading:>{self.width}}" for _, heading in self.columns))
        self._rows += 1
        lines.append(" ".join(f"{_cell(row.get(key)):>{self.width}}" for key, _ in self.columns))
        return "\n".join(lines)


def progress_bar_setting(value: str) -> Optional[bool]:
    """``logging.progress_bar`` -> the ``bar`` argument of :class:`Progress`."""
    return {"auto": None, "on": True, "off": False}[value]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)
