"""What an RL step reports: its logged row (:func:`step_row`), the console line's keys and table, the stages'
wall time, a trained role's sums over the optimizer steps of a step, and the sample statistics a step and a held-out
evaluation share. Failed samples (:mod:`rlhf.ops.failures`) are counted, never averaged in."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Dict, List, Optional

import torch

from rlhf.batch import Batch
from rlhf.data.plan import StepPlan
from rlhf.distributed.group import StepResult
from rlhf.objectives.base import Totals
from rlhf.ops.dapo import correct_samples
from rlhf.ops.failures import counted
from rlhf.ops.mismatch import logp_mismatch, logp_mismatch_max
from rlhf.rollout.prompts import PromptSet

CONSOLE_KEYS = (
    "reward_mean",
    "accuracy",
    "kl",
    "distill/teacher_kl",  # on-policy distillation: the policy's reverse KL from its teacher
    "policy_loss",
    "value_loss",
    "entropy",
    "clip_frac",
    "response_length",
    "episode/turns",
    "logp_mismatch",
    "samples_per_s",
)
EVAL_CONSOLE_KEYS = ("reward_mean", "accuracy", "response_length", "episode/turns", "num_samples")
TABLE_COLUMNS = (
    ("step", "step"),
    ("reward_mean", "reward"),
    ("reward_std", "reward_std"),
    ("accuracy", "accuracy"),
    ("kl", "kl"),
    ("entropy", "entropy"),
    ("policy_loss", "pg_loss"),
    ("value_loss", "v_loss"),
    ("clip_frac", "clip_frac"),
    ("response_length", "resp_len"),
    ("logp_mismatch", "mismatch"),
    ("samples_per_s", "samples/s"),
    ("eta", "eta"),
)


class StageTimer:
    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        started = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started


def step_row(
    prompts: PromptSet,
    step: StepPlan,
    scores,
    per_source,
    batch: Batch,
    train_stats: dict,
    sync: dict,
    timer: StageTimer,
    failed: Optional[torch.Tensor] = None,
    sync_mismatch: Optional[float] = None,
) -> dict:
    """The step's logged row (``prompts``: the training set, whose skipped and truncated prompts it counts).
    ``sync_mismatch``: the probe's gap after this step's push (``k >= 1``, :meth:`RLTrainer.probe_sync`); ``None``
    (``k = 0``): the step's own samples' gap, ``logp_mismatch``, which is the same quantity there (trainer and
    engines held the same weights, those of the previous step's push)."""
    total_s = sum(timer.seconds.values())
    real = scores[counted(failed, len(scores))]  # placeholders are not rewards (rlhf.ops.failures)
    mismatch = logp_mismatch(batch)
    row = {
        "step": step.step,
        "epoch": step.epoch,
        **sample_stats(scores, per_source, batch, failed),
        "reward_std": float(real.std()) if len(real) > 1 else (0.0 if len(real) else None),  # None: all failed
        **train_stats,
        "logp_mismatch": mismatch,
        "logp_mismatch_max": logp_mismatch_max(batch),
        "sync_mismatch": mismatch if sync_mismatch is None else sync_mismatch,
        "num_samples": len(batch),
        **{f"time/{k}": round(v, 4) for k, v in timer.seconds.items()},
        "sync_mb": sync.get("bytes", 0.0) / 2**20,  # the merged model, or the adapter alone (model.lora.sync)
        "sync_mb_per_s": sync.get("bytes", 0.0) / 2**20 / max(sync.get("seconds", 0.0), 1e-9),
        "samples_per_s": len(batch) / max(total_s, 1e-9),
        "prompts_skipped": prompts.skipped,
        "prompts_truncated": prompts.truncated,
    }
    return {k: v for k, v in row.items() if v is not None}


class UpdateTotals:
    """One trained role's sums over the optimizer steps of an RL step, finalized once (:meth:`RLTrainer.update`)."""

    def __init__(self) -> None:
        self.totals = Totals()
        self.grad_norms: List[Optional[float]] = []
        self.lr: Optional[float] = None
        self.cut: Dict[str, int] = {}  # under a token budget: micro-batches and fillers, summed over the steps

    def add(self, result: StepResult) -> None:
        self.totals.add(result.sums, result.normalizer)
        self.grad_norms.append(result.grad_norm)
        self.lr = result.lr
        for key, value in result.cut_metrics().items():
            self.cut[key] = self.cut.get(key, 0) + value

    def metrics(self, objective, prefix: str) -> dict:
        if not self.grad_norms:
            return {}
        return {
            **self.totals.finalize(objective),
            prefix + "grad_norm": _largest(self.grad_norms),
            prefix + "lr": self.lr,
            **{prefix + key: value for key, value in self.cut.items()},
        }


def _largest(norms: List[Optional[float]]) -> Optional[float]:
    """The largest norm; a NaN or inf one if any (``max`` would drop a NaN); ``None`` when none was measured."""
    measured = [n for n in norms if n is not None]
    bad = [n for n in measured if not math.isfinite(n)]
    return bad[0] if bad else max(measured, default=None)


def sample_stats(
    scores: torch.Tensor, per_source: Dict[str, torch.Tensor], batch: Batch, failed: Optional[torch.Tensor] = None
) -> dict:
    """What a training step and a held-out evaluation both report about their samples: mean reward, each source's
    mean, accuracy (when verifiable) over the samples that did not fail (a failed one's reward is a placeholder:
    counted in ``failed/samples``, in no mean; no reward metric when every sample failed), and the mean response
    length in tokens over all of them."""
    assert batch.loss_mask is not None, "a rollout batch carries its loss mask"
    real = counted(failed, len(scores))
    stats: Dict[str, float] = {"failed/samples": int((~real).sum())} if failed is not None else {}
    if bool(real.any()):
        kept = {k: v[real] for k, v in per_source.items()}
        stats.update(
            {
                "reward_mean": float(scores[real].mean()),
                **{f"reward/{k}": float(v.float().mean()) for k, v in kept.items()},
                **_accuracy(kept),
            }
        )
    return {**stats, "response_length": float(batch.loss_mask.sum(-1).float().mean())}


def _accuracy(per_source: Dict[str, torch.Tensor]) -> dict:
    """``{"accuracy": ...}`` when some reward source is 0/1-valued (verifiable): a sample counts as correct when
    every such source says so (:func:`rlhf.ops.dapo.correct_samples`). ``{}`` otherwise (no made-up accuracy for a
    learned reward)."""
    correct = correct_samples(per_source)
    return {} if correct is None else {"accuracy": float(correct.float().mean())}
