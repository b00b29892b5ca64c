"""Checking a user's DeepSpeed JSON (``strategy.deepspeed_config``) against the run, before training.

The run's own settings always win when the JSON is merged (``rlhf.distributed.engine.build_ds_config``): batch
sizes and precision are what the accumulation contract is computed from. A JSON that says something else is
not silently overridden: it is reported, naming the field, because the user believed it would apply. The
precision checks exist because such mismatches fail silently in practice: bf16 training with
``communication_data_type: fp32`` drove a 7B model's loss and gradients to zero within ten steps.
"""

from __future__ import annotations

import json
from typing import Any, List, Optional

from rlhf.config.schema import ConfigError, RunConfig

# The spellings DeepSpeed's DtypeEnum accepts for each precision. It has none for fp64: in an fp64 run any
# `communication_data_type` or `data_types.grad_accum_dtype` contradicts the run (float64 gradients, summed in their
# `.grad` and all-reduced in float64; rlhf.distributed.engine), and DeepSpeed would refuse an fp64 spelling itself.
DTYPE_NAMES = {
    "fp32": {"fp32", "float32", "float", "torch.float32"},
    "bf16": {"bf16", "bfloat16", "torch.bfloat16"},
    "fp16": {"fp16", "float16", "half", "torch.float16"},
    "fp64": set(),
}
_NO_FP64_NAME = {"fp64": " (DeepSpeed has no fp64 value for it; the run keeps float64 without it)"}


def read_user_config(path: str) -> Optional[dict]:
    """The JSON at ``strategy.deepspeed_config`` (``None`` for ``""``); unreadable or not an object is an error."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"strategy.deepspeed_config: cannot read {path!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"strategy.deepspeed_config: {path!r} must hold a JSON object")
    return config


def section_enabled(config: dict, section: str) -> bool:
    value = config.get(section, {})
    return isinstance(value, dict) and value.get("enabled") in (True, "true", "auto")


def contradictions(
    user: dict,
    *,
    zero_stage: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    world_size: int,
    max_grad_norm: float,
    precision: Optional[str],
) -> List[str]:
    """Every field of ``user`` that contradicts the run, as ``"<field>: ..."`` messages.

    ``precision`` is the run's resolved precision (``fp32``/``bf16``/``fp64``), or ``None`` while it is still
    ``auto`` (only the precision-independent fields are checked then).
    """
    found: List[str] = []

    def differs(field: str, run_value: Any, run_key: str) -> None:
        if field in user and user[field] != "auto" and user[field] != run_value:
            found.append(f"{field}: {user[field]!r} but the run uses {run_value!r} ({run_key})")

    differs("train_micro_batch_size_per_gpu", micro_batch_size, "train.micro_batch_size")
    differs(
        "gradient_accumulation_steps",
        grad_accum_steps,
        "train.global_batch_size / (train.micro_batch_size x train.num_workers)",
    )
    differs("train_batch_size", micro_batch_size * grad_accum_steps * world_size, "train.global_batch_size")
    differs("gradient_clipping", max(0.0, max_grad_norm), "train.max_grad_norm")
    stage = user.get("zero_optimization", {}).get("stage") if isinstance(user.get("zero_optimization"), dict) else None
    if stage is not None and stage != zero_stage:
        found.append(f"zero_optimization.stage: {stage!r} but the run uses {zero_stage} (strategy.zero_stage)")
    for section, owner in (
        ("optimizer", "AdamW from train.lr / adam_betas / weight_decay"),
        ("scheduler", "the schedule from train.lr_scheduler / warmup_steps"),
    ):
        if section in user:
            found.append(f"{section}: the run builds {owner}; remove this section")
    if section_enabled(user, "fp16") and section_enabled(user, "bf16"):
        found.append("fp16.enabled and bf16.enabled: both on; DeepSpeed trains in one precision")
    if precision is not None:
        for section in ("bf16", "fp16"):
            if section_enabled(user, section) and precision != section:
                found.append(f"{section}.enabled: true but the run trains in {precision} (strategy.precision)")
        comm = user.get("communication_data_type")
        if comm is not None and str(comm).lower() not in DTYPE_NAMES[precision]:
            found.append(
                f"communication_data_type: {comm!r} with {precision} training (strategy.precision); "
                f"remove it to communicate in the training precision{_NO_FP64_NAME.get(precision, '')}"
            )
        found += _grad_accum_contradiction(user, precision, zero_stage)
    return found


def grad_accum_dtype(precision: str, zero_stage: int) -> str:
    """The dtype DeepSpeed sums micro-batch gradients in (``data_types.grad_accum_dtype``) for a run.

    bf16 on ZeRO 1-3: fp32, because summing ``grad_accum_steps`` bf16 gradients rounds away the low bits the exact
    global normalization keeps. bf16 on ZeRO 0: bf16, the only mix DeepSpeed 0.19 implements without ZeRO (its
    optimizer check raises ``NotImplementedError`` for bf16 weights with fp32 accumulation there). fp32: fp32.
    fp64 (ZeRO 0 only): fp64, the weights' own ``.grad``; DeepSpeed has no name for it, so the DeepSpeed JSON leaves
    the field out (``rlhf.distributed.engine.build_ds_config``). What each stage does with it: docs/concepts.md,
    "Precision".
    """
    if precision == "bf16":
        return "fp32" if zero_stage > 0 else "bf16"
    return precision


def _grad_accum_contradiction(user: dict, precision: str, zero_stage: int) -> List[str]:
    """``data_types.grad_accum_dtype`` belongs to the run (:func:`grad_accum_dtype`: fp32 for
    bf16 on ZeRO 1-3, else the model dtype), so a different value would be overridden: report it. (Honouring it
    is not an option either: bf16 weights with fp32 accumulation on ZeRO 0 is a ``NotImplementedError`` in every
    actor, bf16 accumulation on ZeRO 1-3 rounds each micro-batch's sum.)"""
    data_types = user.get("data_types")
    value = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    if value is None:
        return []
    run_value = grad_accum_dtype(precision, zero_stage)
    if str(value).lower() in DTYPE_NAMES[run_value]:
        return []
    return [
        f"data_types.grad_accum_dtype: {value!r} but {precision} training on ZeRO {zero_stage} accumulates "
        f"gradients in {run_value} (strategy.precision, strategy.zero_stage); remove it"
        f"{_NO_FP64_NAME.get(precision, '')}"
    ]


def check_user_config(cfg: RunConfig, precision: Optional[str] = None) -> Optional[dict]:
    """Raise :class:`ConfigError` listing every contradiction between ``strategy.deepspeed_config`` and ``cfg``;
    returns the (checked) user JSON, ``None`` without one."""
    s, t = cfg.strategy, cfg.train
    user = read_user_config(s.deepspeed_config)
    if user is None:
        return None
    if precision is None and s.precision != "auto":
        precision = s.precision
    found = contradictions(
        user,
        zero_stage=s.zero_stage,
        micro_batch_size=t.engine_micro_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        world_size=t.num_workers * s.sequence_parallel_size,  # DeepSpeed counts every rank of a sequence group
        max_grad_norm=t.max_grad_norm,
        precision=precision,
    )
    if found:
        raise ConfigError(
            f"strategy.deepspeed_config ({s.deepspeed_config}) contradicts the run:\n  " + "\n  ".join(found)
        )
    return user
