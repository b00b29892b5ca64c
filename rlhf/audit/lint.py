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

import re
from typing import Dict, List, Optional, Sequence, Tuple

from rlhf.config.deepspeed_check import DTYPE_NAMES, contradictions, section_enabled
from rlhf.config.schema import RunConfig
from rlhf.trainers.findings import ERROR, WARNING, Finding
from rlhf.trainers.kinds import kind_of

# Why a contradicting DeepSpeed field matters, appended to deepspeed_check's message.
_WHY = {
    "communication_data_type": "bf16 training with fp32 communication drove a 7B run's loss and gradients to zero "
    "within ten steps"
}

_KEY = re.compile(r"^([a-z_]+(?:\.[a-z_0-9]+)+)")


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
    found += kind_of(cfg).lint_batches(cfg, train_rows)  # the trainer's own: epochs, RL's rollout batches
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
            world_size=t.num_workers * s.sequence_parallel_size,  # DeepSpeed counts every rank of a sequence group
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
