"""Pairwise reward-model training on ``{"prompt", "chosen", "rejected"[, "margin"]}`` rows (text or messages).

The model is saved as an ``AutoModelForSequenceClassification`` (one label) and loads back with
:func:`rlhf.models.scoring.load_reward_model` for scoring.
"""

from __future__ import annotations

from typing import Any, Dict

from rlhf.config.schema import RewardModelRunConfig
from rlhf.data.formats import pair_fields, read_formatted
from rlhf.data.tokenize import Tokenized, collate_pairs, tokenize_pairs
from rlhf.models.loading import SCALAR_HEAD
from rlhf.objectives.reward import RewardObjective
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.offline.loop import OfflineTask, batch_lines, data_summary, read_train_and_eval, run_offline
from rlhf.trainers.run import RunResult


def row_fields(cfg: RewardModelRunConfig) -> Dict[str, Any]:
    """What a preference row holds, with its margin under ``rm.use_margin`` (``rlhf.data.io.read_rows`` arguments;
    the descriptor's ``row_fields``)."""
    d, margin = cfg.data, cfg.rm.use_margin
    return pair_fields(
        d.prompt_key,
        d.chosen_key,
        d.rejected_key,
        d.margin_key if margin else "",
        margin_required=margin,
        tools_key=d.tools_key,
    )


def _read(cfg: RewardModelRunConfig, tokenizer, path: str, split: str) -> Tokenized:
    d, margin = cfg.data, cfg.rm.use_margin
    rows, chat = read_formatted(d, path, split, tokenizer, row_fields(cfg), chat_keys=(d.chosen_key,))
    return tokenize_pairs(
        rows,
        tokenizer,
        max_length=d.max_length,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        margin_key=d.margin_key if margin else None,
        add_eos=d.add_eos,
        chat=chat,
        tools_key=d.tools_key,
    )


def _collate(examples: list, pad_id: int):
    return lambda rows: collate_pairs([examples[i] for i in rows], pad_id, rows)


def build_rm_task(cfg: RewardModelRunConfig, tokenizer) -> tuple:
    train, held_out = read_train_and_eval(cfg, tokenizer, _read)
    pad = tokenizer.pad_token_id
    task = OfflineTask(
        objective=RewardObjective(use_margin=cfg.rm.use_margin),
        num_examples=len(train.examples),
        collate=_collate(train.examples, pad),
        eval_num_examples=len(held_out),
        eval_collate=_collate(held_out, pad),
        console_keys=("loss", "accuracy", "grad_norm", "lr"),
    )
    return task, train.skipped_rows


def read_data(cfg: RewardModelRunConfig, tokenizer) -> str:
    """``--dry-run``: the data read and tokenized as a run reads it (the descriptor's ``read_data``)."""
    return data_summary(cfg, tokenizer, build_rm_task)


def train_reward_model(cfg: RewardModelRunConfig) -> RunResult:
    return run_offline(cfg, RM, build_rm_task)


#: The reward model's descriptor (rlhf.trainers.descriptor), listed in rlhf.trainers.kinds.
RM = TrainerKind(
    name="rm",
    run_name="rm",
    config_cls=RewardModelRunConfig,
    train=train_reward_model,
    cli_module="rlhf.cli.train_rm",
    row_fields=row_fields,
    read_data=read_data,
    batch_lines=batch_lines,
    policy_role="reward_model",
    policy_kind=SCALAR_HEAD,
    sections=("rm",),
    preset_prefixes=("rm",),
)
