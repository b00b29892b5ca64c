"""The known hazards of a run config, each named by its key: pure, no run, no cluster.

What is checked (docs/audit.md has the why of each), as ``level: hazard -> the key a finding names``:

* error: fp16 training, refused by the config itself -> ``strategy.precision=fp16``
* error: a global batch that micro-batch x ranks do not divide -> ``train.global_batch_size``
* error: fewer rows (RL: prompts) than one step needs -> ``train.global_batch_size=N`` /
  ``rollout.prompts_per_step=N``
* error: ``train.max_steps`` beyond ``train.max_epochs`` x steps per epoch -> ``train.max_steps=N``
* error: a DeepSpeed JSON that contradicts the run (batch sizes, clipping, stage, optimizer, precision, a
  ``communication_data_type`` other than the training precision, ``grad_accum_dtype``; the checks of
  :mod:`rlhf.config.deepspeed_check`) -> ``strategy.deepspeed_config``
* error: fp16 in the JSON with a static loss scale (``loss_scale: 1`` is none: underflow to zero; any other:
  overflow unchecked) -> ``strategy.deepspeed_config``
* error: ``torch_autocast`` in the JSON in another dtype than the run's (a bf16 forward and bf16 gradient
  all-reduce inside an fp32 run) -> ``strategy.deepspeed_config``
* error: RL with a critic whose ranks x micro-batch do not divide the global batch -> ``critic.num_workers=N``
* warning: rows left over each epoch (drop_last after the reshuffle) -> ``train.global_batch_size=N`` /
  ``rollout.prompts_per_step=N``
* warning: RL rollout batch not a multiple of the global batch -> ``train.global_batch_size=N``
* warning: RL token sums without the length constant under gradient clipping (the clip binds at almost every
  step) -> ``algo.loss_agg_mode=seq-mean-token-sum``
* warning: a sequence-level policy loss (GSPO) with a clip range of a token-level one (10x its paper's or wider:
  the length-normalized ratio almost never leaves it, so the loss runs unclipped) -> ``algo.clip_low`` /
  ``algo.clip_high``
* warning: dropout left on -> ``model.disable_dropout=false``
* warning: bf16 on ZeRO 0 with accumulation (bf16 gradient sums) -> ``strategy.zero_stage=0``

With ``strategy.precision=auto`` the precision-dependent checks are made for both resolutions (bf16 on GPU
workers, fp32 on CPU ones) and a finding says which one it applies to: one of the GPU run is an error (an audit on
a CPU box checks the GPU run it prepares), one of the CPU run only a warning.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from rlhf.config.deepspeed_check import DTYPE_NAMES, contradictions, section_enabled
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import RunConfig, TrainConfig
from rlhf.data.plan import EpochPlan
from rlhf.trainers.kinds import kind_of

ERROR, WARNING = "error", "warning"

# Why a contradicting DeepSpeed field matters, appended to deepspeed_check's message.
_WHY = {
    "communication_data_type": "bf16 training with fp32 communication drove a 7B run's loss and gradients to zero "
    "within ten steps"
}

_KEY = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+)")


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


def from_config_error(message: str) -> Optional[Finding]:
    """A :class:`~rlhf.config.schema.ConfigError` that refuses a known hazard, as a finding; ``None`` for any other
    configuration error (a missing or unknown key, a bad value: the command's usage errors).

    The config's validation already refuses fp16 (``strategy.precision``) and a global batch that micro-batches and
    ranks do not divide (``train.global_batch_size``); its message names the key and is kept as it is.
    """
    fp16 = "strategy.precision is fp16, which is "
    if message.startswith(fp16):
        return Finding(ERROR, "strategy.precision=fp16", message[len(fp16) :])
    match = _KEY.match(message)
    if match and match.group(1) == "train.global_batch_size":
        return Finding(ERROR, match.group(1), message[len(match.group(1)) :].lstrip(" :"))
    return None


def lint(cfg: RunConfig, user_ds_config: Optional[dict] = None, train_rows: Optional[int] = None) -> List[Finding]:
    """Every hazard of a validated run config (SFT, reward model, DPO or RL), errors first.

    Args:
        cfg: The run config.
        user_ds_config: The JSON at ``strategy.deepspeed_config`` (``rlhf.config.deepspeed_check.read_user_config``),
            ``None`` without one.
        train_rows: Rows of ``data.train_path`` (RL: prompts), ``None`` when not counted; the data checks need it.
            Rows the trainer drops later (nothing to train on within ``data.max_length``, prompts over
            ``rollout.max_prompt_length``) are still counted.
    """
    found: List[Finding] = []
    if user_ds_config is not None:
        found += deepspeed_findings(cfg, user_ds_config)
    if kind_of(cfg).online and isinstance(cfg, RLRunConfig):  # online: always an RLRunConfig (narrows the type)
        found += _rl_batches(cfg, train_rows)
    elif train_rows is not None:
        found += _epochs(cfg.train.global_batch_size, "train.global_batch_size", "rows", train_rows, cfg.train)
    found += _run_settings(cfg)
    return sorted(found, key=lambda f: f.level != ERROR)


# --------------------------------------------------------------------------------------------- DeepSpeed JSON


def _precisions(precision: str) -> List[Tuple[str, str, str]]:
    """``(precision, note, level)`` for each precision the run may train in. With ``auto``, a contradiction of the
    GPU run (bf16) is an error: that is the run the audit prepares; one of the CPU run (fp32) only, a warning."""
    if precision == "auto":
        return [
            ("bf16", "with strategy.precision=auto on GPU workers (bf16)", ERROR),
            ("fp32", "with strategy.precision=auto on CPU workers (fp32)", WARNING),
        ]
    return [(precision, "", ERROR)]


def deepspeed_findings(cfg: RunConfig, user: dict) -> List[Finding]:
    """The JSON's contradictions (:func:`rlhf.config.deepspeed_check.contradictions`, for each precision the run may
    resolve to), fp16 without dynamic loss scaling, and ``torch_autocast`` in another precision."""
    s, t = cfg.strategy, cfg.train
    by_message: Dict[str, List[Tuple[str, str]]] = {}
    choices = _precisions(s.precision)
    for precision, note, level in choices:
        found = contradictions(
            user,
            zero_stage=s.zero_stage,
            micro_batch_size=t.engine_micro_batch_size,
            grad_accum_steps=t.grad_accum_steps,
            world_size=t.num_workers,
            max_grad_norm=t.max_grad_norm,
            precision=precision,
        ) + _autocast(user, precision)
        for message in found:
            by_message.setdefault(message, []).append((note, level))
    findings = []
    for message, where in by_message.items():
        field = message.split(":", 1)[0]
        why = f" ({_WHY[field]})" if field in _WHY else ""
        some = len(where) < len(choices)  # holds for one resolution of `auto` only
        level = where[0][1] if some else ERROR
        when = f" [{where[0][0]}]" if some else ""
        findings.append(Finding(level, "strategy.deepspeed_config", f"{message}{why}{when}"))
    return findings + _fp16_loss_scale(user)


def _fp16_loss_scale(user: dict) -> List[Finding]:
    """DeepSpeed's fp16 ``loss_scale``: 0 (the default) is dynamic scaling; any other value is a static scale whose
    overflow check never fires, and 1 is no scaling at all."""
    if not section_enabled(user, "fp16"):
        return []
    scale = user["fp16"].get("loss_scale", 0)
    if scale in (0, "0", None):
        return []
    if scale in (1, 1.0, "1"):
        what = (
            "fp16.loss_scale=1: fp16 without loss scaling; gradients below fp16's smallest subnormal (6e-8) "
            "flush to zero, and an overflow is not detected"
        )
    else:
        what = (
            f"fp16.loss_scale={scale}: a static loss scale, no dynamic scaling; an overflowing step goes into "
            f"the weights as inf/NaN instead of being skipped"
        )
    return [Finding(ERROR, "strategy.deepspeed_config", what + "; remove fp16 and set strategy.precision=bf16 or fp32")]


def _autocast(user: dict, precision: str) -> List[str]:
    """``torch_autocast`` enabled in another dtype than the run trains in: DeepSpeed then runs the forward in that
    dtype and communicates the gradients of autocast modules (``Linear`` ...) in it too."""
    if not section_enabled(user, "torch_autocast"):
        return []
    dtype = user["torch_autocast"].get("dtype")
    if dtype is not None and str(dtype).lower() in DTYPE_NAMES.get(precision, ()):
        return []
    shown = repr(dtype) if dtype is not None else "the device default (fp16 on CUDA, bf16 on CPU)"
    return [
        f"torch_autocast.enabled: true with dtype {shown} but the run trains in {precision} "
        f"(strategy.precision): the forward and the gradient all-reduce of Linear layers run in that dtype; "
        f"remove it and set strategy.precision"
    ]


# --------------------------------------------------------------------------------------------- batches and data


def _epochs(batch: int, key: str, unit: str, rows: int, t: TrainConfig) -> List[Finding]:
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


def _rl_batches(cfg: RLRunConfig, prompts: Optional[int]) -> List[Finding]:
    t, r = cfg.train, cfg.rollout
    found = [] if prompts is None else _epochs(r.prompts_per_step, "rollout.prompts_per_step", "prompts", prompts, t)
    samples, batch = r.samples_per_step, t.global_batch_size
    if samples % batch:
        found.append(
            Finding(
                WARNING,
                f"train.global_batch_size={batch}",
                f"each rollout batch of {samples} samples (rollout.prompts_per_step x "
                f"rollout.n_samples_per_prompt) gives {samples // batch} optimizer steps and leaves "
                f"{samples % batch} samples out of every pass: generated and scored, never trained on",
            )
        )
    if cfg.critic_batch_problem():
        found.append(Finding(ERROR, f"critic.num_workers={cfg.critic.num_workers}", cfg.critic_batch_problem()))
    return found + _rl_algorithm(cfg)


def _rl_algorithm(cfg: RLRunConfig) -> List[Finding]:
    """Settings the config accepts whose effect is not what their names suggest (the registry entries' facts)."""
    a, found = cfg.algo, []
    if a.aggregation == "seq-mean-token-sum" and cfg.train.max_grad_norm > 0:
        found.append(
            Finding(
                WARNING,
                "algo.loss_agg_mode=seq-mean-token-sum",
                f"sums each response's ~{cfg.max_response_tokens} token losses, so the gradient norm is "
                f"~{cfg.max_response_tokens}x the per-token scale and train.max_grad_norm="
                f"{cfg.train.max_grad_norm:g} clips almost every step (a clipped step no longer follows "
                f"its gradient's size); seq-mean-token-sum-norm is the same objective over the "
                f"generation budget, Dr. GRPO's",
            )
        )
    entry, (low, high) = a.policy_loss_entry, a.clip
    if entry.sequence_level and max(low / entry.clip_low, high / entry.clip_high) >= 10:
        found.append(
            Finding(
                WARNING,
                "algo.clip_low" if low / entry.clip_low >= 10 else "algo.clip_high",
                f"{low:g} / {high:g} with policy loss {a.policy_loss}: its ratio is a per-token geometric "
                f"mean over the sequence, which almost never leaves [1 - {low:g}, 1 + {high:g}], so it "
                f"runs unclipped; its paper clips at {entry.clip_low:g} / {entry.clip_high:g} (unset "
                f"algo.clip_low and algo.clip_high to train with it)",
            )
        )
    return found


# --------------------------------------------------------------------------------------------- run settings


def _run_settings(cfg: RunConfig) -> List[Finding]:
    found = []
    if not cfg.model.disable_dropout:
        found.append(
            Finding(
                WARNING,
                "model.disable_dropout=false",
                "dropout draws its masks per micro-batch, so two factorisations train differently "
                "whenever the model has dropout > 0 (the audit's runs show whether it does)",
            )
        )
    s, t = cfg.strategy, cfg.train
    if s.zero_stage == 0 and t.grad_accum_steps > 1 and s.precision in ("bf16", "auto"):
        when = " (strategy.precision=auto: bf16 on GPU workers)" if s.precision == "auto" else ""
        found.append(
            Finding(
                WARNING,
                "strategy.zero_stage=0",
                f"bf16 training{when} on ZeRO 0 sums the {t.grad_accum_steps} micro-batch gradients of "
                f"a step in bf16 (DeepSpeed has no fp32 accumulation without ZeRO); prefer "
                f"strategy.zero_stage=1",
            )
        )
    return found


def exit_code(findings: Sequence[Finding]) -> int:
    """1 when any finding is an error, else 0."""
    return 1 if any(f.level == ERROR for f in findings) else 0
