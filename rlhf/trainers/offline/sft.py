"""Supervised fine-tuning on ``{"prompt", "response"}`` (or ``"completion"``) rows or conversations
(``{"messages": [...]}``), loss on response / assistant tokens only; or on ``{"text"}`` rows, loss on every token
(layouts: :mod:`rlhf.data.layouts`)."""

from __future__ import annotations

from typing import Any, Dict

from rlhf.config.schema import SFTRunConfig
from rlhf.data.formats import read_formatted, sft_fields
from rlhf.data.tokenize import Tokenized, collate_sft, tokenize_sft
from rlhf.objectives.sft import SFTObjective
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.offline.loop import OfflineTask, batch_lines, data_summary, read_train_and_eval, run_offline
from rlhf.trainers.run import RunResult


def row_fields(cfg: SFTRunConfig) -> Dict[str, Any]:
    """What an SFT row holds (``rlhf.data.io.read_rows`` arguments; the descriptor's ``row_fields``)."""
    d = cfg.data
    return sft_fields(d.prompt_key, d.response_key, d.messages_key, d.text_key, d.tools_key)


def _read(cfg: SFTRunConfig, tokenizer, path: str, split: str) -> Tokenized:
    d = cfg.data
    rows, chat = read_formatted(
        d,
        path,
        split,
        tokenizer,
        row_fields(cfg),
        chat_keys=(d.messages_key, d.prompt_key),
    )
    return tokenize_sft(
        rows,
        tokenizer,
        max_length=d.max_length,
        prompt_key=d.prompt_key,
        response_key=d.response_key,
        add_eos=d.add_eos,
        messages_key=d.messages_key,
        chat=chat,
        assistant_turns=d.assistant_turns,
        text_key=d.text_key,
        tools_key=d.tools_key,
    )


def _collate(examples: list, pad_id: int):
    return lambda rows: collate_sft([examples[i] for i in rows], pad_id, rows)


def build_sft_task(cfg: SFTRunConfig, tokenizer) -> tuple:
    train, held_out = read_train_and_eval(cfg, tokenizer, _read)
    pad = tokenizer.pad_token_id
    task = OfflineTask(
        objective=SFTObjective(),
        num_examples=len(train.examples),
        collate=_collate(train.examples, pad),
        eval_num_examples=len(held_out),
        eval_collate=_collate(held_out, pad),
        console_keys=("loss", "grad_norm", "lr", "num_tokens"),
    )
    return task, train.skipped_rows


def read_data(cfg: SFTRunConfig, tokenizer) -> str:
    """``--dry-run``: the data read and tokenized as a run reads it (the descriptor's ``read_data``)."""
    return data_summary(cfg, tokenizer, build_sft_task)


def train_sft(cfg: SFTRunConfig) -> RunResult:
    return run_offline(cfg, SFT, build_sft_task)


#: SFT's descriptor (rlhf.trainers.descriptor), listed in rlhf.trainers.kinds.
SFT = TrainerKind(
    name="sft",
    run_name="sft",
    config_cls=SFTRunConfig,
    train=train_sft,
    cli_module="rlhf.cli.train_sft",
    row_fields=row_fields,
    read_data=read_data,
    batch_lines=batch_lines,
    preset_prefixes=("sft",),
)
