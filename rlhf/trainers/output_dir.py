"""A run's output directory, and the rule that one run never silently lands on another.

``train.output_dir`` empty (the default): the run gets a new directory, ``outputs/<trainer>-<YYYYmmdd-HHMMSS>``
under the working directory (``-2``, ``-3`` ... when taken), chosen once per invocation and printed.

A directory *holds a run* when it contains something the toolkit writes there (:func:`run_artifacts`: the resolved
``config.yaml``, ``metrics.jsonl`` / ``eval.jsonl``, TensorBoard events, ``checkpoints/``, ``final/``,
``placement.json``, W&B files). A run starting into one is refused before anything is read or started, unless

- ``train.resume=true``: the run there continues from its newest checkpoint (``RunCheckpoints`` checks that it
  belongs to this run). With no checkpoint, an unfinished run starts over from step 1 (its logs are replaced); a
  finished one (``final/``) is refused: resuming it would train it again and replace it;
- ``train.overwrite=true``: every artifact of the old run is deleted first, TensorBoard events, checkpoints and
  ``final/`` included; files the toolkit did not write are left alone. With ``train.resume=true`` too: deleted
  only when there is no checkpoint to continue from (a job script that may or may not be a resubmission).

Two calls per run: :func:`claim_output_dir` once per invocation, before any data is read (a
``train.on_failure=restart`` restart reuses what it chose), and :func:`prepare_output_dir` by each attempt, right
before its first write. An attempt after a restart has ``train.resume=true`` (``rlhf.trainers.run.with_restarts``): it
continues from this invocation's checkpoint or, before the first one, starts over in the directory it owns.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
import time
from typing import List, Optional

from rlhf.config.loader import is_saved_config, save_config
from rlhf.config.schema import ConfigError, RunConfig, RunConfigT
from rlhf.trainers.checkpoint import CHECKPOINT_DIR, Checkpoints
from rlhf.utils.log import get_logger
from rlhf.utils.metrics import EVAL_FILE, METRICS_FILE, TENSORBOARD_DIR

log = get_logger(__name__)
OUTPUTS_ROOT = "outputs"
CONFIG_FILE = "config.yaml"  # save_config, here
FINAL_DIR = "final"  # rlhf.trainers.run.save_final
# Names (fnmatch patterns) the toolkit writes at the top of a run directory, temporary files included.
RUN_ARTIFACTS = (
    CONFIG_FILE,
    f".{CONFIG_FILE}.*.tmp",  # save_config
    METRICS_FILE,
    EVAL_FILE,
    f"{METRICS_FILE}.tmp",
    f"{EVAL_FILE}.tmp",  # rlhf.utils.metrics (.tmp: truncate_jsonl)
    TENSORBOARD_DIR,
    "events.out.tfevents.*",  # MetricsWriter's SummaryWriter
    CHECKPOINT_DIR,  # rlhf.trainers.checkpoint
    FINAL_DIR,
    f".{FINAL_DIR}.tmp-*",  # save_final
    "placement.json",  # rlhf.trainers.online.runner
    "wandb",
    "wandb_run_id",  # rlhf.utils.wandb_sink
)
# Drawn from a run's metrics afterwards (rlhf.cli.report, the demo): deleted with the run, not a run by themselves.
DERIVED_ARTIFACTS = ("report.png", "rl_curves.png")


def new_output_dir(trainer: str, now: Optional[float] = None, root: str = OUTPUTS_ROOT) -> str:
    """``root/<trainer>-<YYYYmmdd-HHMMSS>`` at ``now`` (default: the current time), with ``-2``, ``-3`` ... appended
    while the path exists. Nothing is created."""
    base = os.path.join(root, f"{trainer}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}")
    path, n = base, 1
    while os.path.lexists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def run_artifacts(directory: str, derived: bool = False) -> List[str]:
    """The names in ``directory`` that the toolkit wrote (sorted; ``[]`` for a missing directory). A
    ``config.yaml`` counts only when :func:`~rlhf.config.loader.save_config` wrote it (its header line).

    Args:
        directory: A run's output directory.
        derived: Also list :data:`DERIVED_ARTIFACTS` (plots drawn from the run's metrics).
    """
    if not os.path.isdir(directory):
        return []
    patterns = RUN_ARTIFACTS + (DERIVED_ARTIFACTS if derived else ())
    found = []
    for name in sorted(os.listdir(directory)):
        if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        if name == CONFIG_FILE and not is_saved_config(os.path.join(directory, name)):
            continue  # a user's own config.yaml, not a run's
        found.append(name)
    return found


def clear_run(directory: str) -> List[str]:
    """Delete every artifact of the run in ``directory`` (:func:`run_artifacts`, plots included); other files stay.
    Returns the names deleted."""
    removed = run_artifacts(directory, derived=True)
    for name in removed:
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    return removed


def claim_output_dir(cfg: RunConfigT, name: str) -> RunConfigT:
    """Once per invocation, before any data is read or actor started: the directory the run will write.

    Returns ``cfg`` itself, or a copy with ``train.output_dir`` set to a new directory ``<name>-<date>-<time>``
    when it was empty (``name``: the trainer's ``run_name``). Prints the directory and what happens to a run
    already there.

    Raises:
        ConfigError: ``train.output_dir`` is a file, or holds a run this one may not touch (see the module
            docstring); the message names ``train.resume`` and ``train.overwrite``. Nothing has been written.
    """
    t = cfg.train
    if not t.output_dir:
        path = new_output_dir(name)
        log.info(f"[{name}] output directory: {path} (new: train.output_dir is not set)")
        return dataclasses.replace(cfg, train=dataclasses.replace(t, output_dir=path))
    log.info(f"[{name}] output directory: {t.output_dir}{_ANNOUNCE[_planned(t)]}")
    return cfg


def output_dir_status(cfg: RunConfig, name: str) -> str:
    """What a run of ``cfg`` would do with ``train.output_dir`` (for ``--dry-run``); nothing is printed or written.

    Raises:
        ConfigError: As :func:`claim_output_dir` would.
    """
    t = cfg.train
    if not t.output_dir:
        return f"not set: a new {OUTPUTS_ROOT}/{name}-<date>-<time> is made at run time"
    action = _planned(t)
    return {
        "new": "exists, holds no run" if os.path.isdir(t.output_dir) else "created at run time",
        "resume": "holds a run with a checkpoint: continued (train.resume=true)",
        "overwrite": "holds a run: deleted before this one writes (train.overwrite=true)",
        "start over": "holds an unfinished run without a checkpoint: started over (train.resume=true)",
    }[action]


def prepare_output_dir(cfg: RunConfig, checkpoints) -> None:
    """Right before a run's first write, after ``checkpoints.prepare()``: delete an old run being overwritten (or
    an unfinished one that starts over), create the directory, and write the resolved ``config.yaml``.

    The saved config has ``train.overwrite=false``: the flag was spent on this directory, and a config reloaded
    from it (``--config output_dir/config.yaml``) must not delete another run.

    Args:
        cfg: The run config; ``train.output_dir`` is set (:func:`claim_output_dir`).
        checkpoints: The run's :class:`~rlhf.trainers.checkpoint.RunCheckpoints`, prepared (whether it resumes).

    Raises:
        ConfigError: As :func:`claim_output_dir`, for a run that appeared in the directory since the claim.
    """
    t = cfg.train
    if not t.output_dir:
        raise ValueError("train.output_dir is empty: claim_output_dir(cfg) chooses the directory first")
    found = _artifacts(t.output_dir)
    action = _decide(t, found, resumable=checkpoints.resuming)
    if action in ("overwrite", "start over"):
        listing = _listing(run_artifacts(t.output_dir, derived=True), t.output_dir)
        clear_run(t.output_dir)
        log.info(
            f"[{checkpoints.name}] deleted the previous run in {t.output_dir}: {listing} "
            f"({'train.overwrite' if action == 'overwrite' else 'train.resume, no checkpoint'})"
        )
    os.makedirs(t.output_dir, exist_ok=True)
    spent = dataclasses.replace(cfg, train=dataclasses.replace(t, overwrite=False))
    save_config(spent, os.path.join(t.output_dir, CONFIG_FILE))


def _planned(t) -> str:
    """What a run starting now does with ``t.output_dir`` (:func:`_decide`, before any checkpoint is read)."""
    return _decide(t, _artifacts(t.output_dir), resumable=bool(Checkpoints(t.output_dir, keep=1).complete()))


_ANNOUNCE = {
    "new": "",
    "resume": " (continuing the run there: train.resume=true)",
    "overwrite": " (the run there is deleted before this one writes: train.overwrite=true)",
    "start over": " (the unfinished run there has no checkpoint: it starts over from step 1, train.resume=true)",
}


def _artifacts(directory: str) -> List[str]:
    """:func:`run_artifacts`, refusing a directory the run cannot write without destroying a user's file."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"train.output_dir: {directory!r} is a file, not a directory")
    config = os.path.join(directory, CONFIG_FILE)
    if os.path.exists(config) and not is_saved_config(config):
        raise ConfigError(
            f"train.output_dir: {directory} has a {CONFIG_FILE} that no run wrote, which the run's "
            f"resolved config would replace; choose another train.output_dir"
        )
    return run_artifacts(directory)


def _decide(t, found: List[str], resumable: bool) -> str:
    """What the run does with a directory holding ``found``: ``new``, ``resume``, ``overwrite`` or ``start over``;
    refused with a ConfigError otherwise. ``resumable``: it has a complete checkpoint (and ``train.resume``)."""
    if not found:
        return "new"
    if t.resume and resumable:
        return "resume"
    if t.overwrite:
        return "overwrite"
    finished = FINAL_DIR in found
    if t.resume and not finished:
        return "start over"
    where = f"{t.output_dir} holds a run ({_listing(found, t.output_dir)})"
    if finished and not Checkpoints(t.output_dir, keep=1).complete():
        key = "train.resume" if t.resume else "train.output_dir"
        raise ConfigError(
            f"{key}: {where}, finished and without a checkpoint for train.resume=true to continue "
            f"from; set train.overwrite=true to delete it and train again, or choose another "
            f"train.output_dir (empty: a new directory)"
        )
    raise ConfigError(
        f"train.output_dir: {where}; set train.resume=true to continue it, train.overwrite=true to "
        f"delete it and start again, or choose another train.output_dir (empty: a new directory)"
    )


def _listing(names: List[str], directory: str, most: int = 6) -> str:
    shown = [n + ("/" if os.path.isdir(os.path.join(directory, n)) else "") for n in names[:most]]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")
