"""Checkpoints for exact resume, written atomically, the last ``keep`` kept.

Layout under ``output_dir/checkpoints/``::

    step_000012/            a complete checkpoint (only complete ones carry this name)
        driver.json         the driver's state: step, epoch, anything the next step depends on
        policy/state/...    DeepSpeed: every rank's model, optimizer, LR-schedule partitions and RNG state
        critic/state/...    (RL with a critic)
    step_000016.tmp/        being written; never read, removed on the next start

A checkpoint is assembled in ``step_N.tmp`` and renamed to ``step_N`` only after every group and the driver
state are on disk, so a crash mid-write leaves no directory that :meth:`Checkpoints.latest` would pick. The data
position needs no saving: which samples step ``k`` uses is a pure function of (seed, epoch, k)
(:class:`~rlhf.data.plan.EpochPlan`), so a resumed run skips the first ``k`` steps of the same plan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, List, Mapping, Optional, Protocol, Tuple

from rlhf.config.schema import ConfigError
from rlhf.utils.log import get_logger

log = get_logger(__name__)

_NAME = re.compile(r"^step_(\d{6,})$")
DRIVER_FILE = "driver.json"
CHECKPOINT_DIR = "checkpoints"  # under output_dir


class Checkpointable(Protocol):
    """What a checkpoint saves and loads: a :class:`~rlhf.distributed.group.WorkerGroup`, or a test double."""

    def save_checkpoint(self, directory: str) -> None: ...

    def load_checkpoint(self, directory: str) -> None: ...


class Checkpoints:
    def __init__(self, output_dir: str, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root, self.keep = os.path.join(output_dir, CHECKPOINT_DIR), keep

    def complete(self) -> List[Tuple[int, str]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            match = _NAME.match(name)
            path = os.path.join(self.root, name)
            if match and os.path.isfile(os.path.join(path, DRIVER_FILE)):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Optional[Tuple[str, dict]]:
        """The newest complete checkpoint's path and driver state, or ``None``."""
        found = self.complete()
        if not found:
            return None
        path = found[-1][1]
        with open(os.path.join(path, DRIVER_FILE), encoding="utf-8") as f:
            return path, json.load(f)

    def save(self, step: int, groups: Mapping[str, Checkpointable], driver_state: dict) -> str:
        """Write ``groups`` (name -> WorkerGroup) and ``driver_state`` as the checkpoint of ``step``."""
        final = os.path.join(self.root, f"step_{step:06d}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name, group in groups.items():
            group.save_checkpoint(os.path.join(tmp, name))
        with open(os.path.join(tmp, DRIVER_FILE), "w", encoding="utf-8") as f:  # last: it marks completeness
            json.dump({**driver_state, "step": step}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # re-saving a step (e.g. the final one) replaces it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def remove_partial(self) -> None:
        """Delete ``*.tmp`` directories left by a crash."""
        if os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _prune(self) -> None:
        for _, path in self.complete()[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)


def load_groups(path: str, groups: Mapping[str, Checkpointable]) -> None:
    """Restore every group's state from the checkpoint at ``path``."""
    for name, group in groups.items():
        directory = os.path.join(path, name)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint {path} has no state for {name!r}")
        group.load_checkpoint(directory)


class RunCheckpoints:
    """``train.save_every`` / ``keep_checkpoints`` / ``resume`` / ``stop_after_steps`` for one run.

    Args:
        train: the run's ``train`` config.
        identity: config keys (dotted) -> values that a checkpoint must share with the run resuming it: the
            plan (seed, batch, data size, step count) and the layout of the saved state (ranks, ZeRO stage).
        name: log prefix, e.g. ``"sft"``.
    """

    def __init__(self, train, identity: Dict[str, object], name: str) -> None:
        self.train, self.identity, self.name = train, dict(identity), name
        self.store = Checkpoints(train.output_dir, train.keep_checkpoints)
        self.stopped_early = False
        self.started_after = 0  # steps done before this invocation (a resume point)
        self._resume_from: Optional[Tuple[str, int]] = None

    def prepare(self) -> int:
        """Before any actor starts: clean up partial checkpoints and, with ``train.resume``, find the newest
        complete one and check it belongs to this run. Returns the step it was taken at (0: fresh start)."""
        self.store.remove_partial()
        self._resume_from = None
        if not self.train.resume:
            return 0
        found = self.store.latest()
        if found is None:
            log.info(f"[{self.name}] train.resume: no checkpoint under {self.store.root}; starting from step 1")
            return 0
        path, state = found
        saved = state.get("identity", {})
        # both ways: a key only one side has (a setting that exists only when on, e.g. rollout.max_staleness) differs
        differ = [
            f"{k}={saved.get(k)!r} in the checkpoint, {self.identity.get(k)!r} now"
            for k in dict.fromkeys([*self.identity, *saved])
            if saved.get(k) != self.identity.get(k)
        ]
        if differ:
            raise ConfigError(f"train.resume: {path} belongs to another run: " + "; ".join(differ))
        self._resume_from = (path, int(state["step"]))
        return self._resume_from[1]

    @property
    def resuming(self) -> bool:
        """Whether :meth:`prepare` found a checkpoint to continue from (else the run starts at step 1)."""
        return self._resume_from is not None

    def restore(self, groups: Mapping[str, Checkpointable]) -> int:
        """Load the checkpoint :meth:`prepare` found into ``groups``; returns the number of steps already done (0
        for a fresh start). The metric writers cut their files back to that step (``RunWriters``)."""
        if self._resume_from is None:
            return 0
        path, done = self._resume_from
        load_groups(path, groups)
        self.started_after = done
        log.info(f"[{self.name}] resumed from {path} (step {done})")
        return done

    def save_start(self, groups: Mapping[str, Checkpointable]) -> None:
        """Checkpoint the starting state as step 0 unless a checkpoint exists: a health-guard skip before the
        first ``save_every`` checkpoint then has a state to rewind to."""
        if self.store.latest() is None:
            self.store.save(0, groups, {"identity": self.identity})

    def rewind(self, groups: Mapping[str, Checkpointable]) -> int:
        """Load the newest complete checkpoint into the live ``groups``; returns its step."""
        found = self.store.latest()
        if found is None:
            raise FileNotFoundError(f"no checkpoint under {self.store.root} to rewind to")
        path, state = found
        load_groups(path, groups)
        return int(state["step"])

    def save_stopped(self, step: int, groups: Mapping[str, Checkpointable]) -> str:
        """The checkpoint of ``step`` for a run stopped by a signal (``rlhf.trainers.interrupt``): written unless
        :meth:`after_step` wrote it already; returns its path."""
        found = self.store.latest()
        if found is not None and int(found[1]["step"]) == step:
            return found[0]
        path = self.store.save(step, groups, {"identity": self.identity})
        log.info(f"[{self.name}] checkpoint {path}")
        return path

    def after_step(self, step: int, total_steps: int, groups: Mapping[str, Checkpointable]) -> bool:
        """Checkpoint when due; True when the run should stop here (``train.stop_after_steps``)."""
        t = self.train
        stop = bool(t.stop_after_steps) and step - self.started_after >= t.stop_after_steps and step < total_steps
        if stop or (t.save_every and step % t.save_every == 0):
            path = self.store.save(step, groups, {"identity": self.identity})
            log.info(f"[{self.name}] checkpoint {path}")
        if stop:
            self.stopped_early = True
            log.info(
                f"[{self.name}] stopped after step {step} (train.stop_after_steps); continue with train.resume=true"
            )
        return stop
