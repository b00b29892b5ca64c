"""DPO-family training against a frozen reference (Rafailov et al. 2023; variants in rlhf.ops.preference).

Reference log-probs come from the reference model on its own worker group, either once for the whole dataset
before training (``dpo.ref_mode=precompute``, the reference group is then released) or for every step's
global batch (``online``, for datasets too large to score up front). Both give the same numbers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from rlhf.batch import Batch
from rlhf.config.schema import DPORunConfig
from rlhf.data.formats import pair_fields, read_formatted
from rlhf.data.tokenize import Tokenized, collate_pairs, tokenize_pairs
from rlhf.distributed.group import WorkerGroup
from rlhf.models.lora import OnBaseModel
from rlhf.objectives.base import ScoreFn
from rlhf.objectives.dpo import DPOObjective, ReferenceLogps
from rlhf.trainers.context import RunContext
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.offline.loop import OfflineTask, batch_lines, data_summary, read_train_and_eval, run_offline
from rlhf.trainers.run import RunResult
from rlhf.utils.log import get_logger

log = get_logger(__name__)

REF_BATCH_SIZE = 16  # pairs per reference forward when precomputing


class _PairData:
    """Tokenized pairs plus, once computed, their reference log-probs ``(N, 2)``."""

    def __init__(self, examples: list, pad_id: int) -> None:
        self.examples, self.pad_id = examples, pad_id
        self.ref_logps: torch.Tensor | None = None

    def collate(self, rows: Sequence[int]) -> Batch:
        ref = None if self.ref_logps is None else self.ref_logps[torch.tensor(rows, dtype=torch.long)]
        return collate_pairs([self.examples[i] for i in rows], self.pad_id, rows, ref_logps=ref)


def row_fields(cfg: DPORunConfig) -> Dict[str, Any]:
    """What a preference row holds (``rlhf.data.io.read_rows`` arguments; the descriptor's ``row_fields``)."""
    d = cfg.data
    return pair_fields(d.prompt_key, d.chosen_key, d.rejected_key, tools_key=d.tools_key)


def _read(cfg: DPORunConfig, tokenizer, path: str, split: str) -> Tokenized:
    d = cfg.data
    rows, chat = read_formatted(d, path, split, tokenizer, row_fields(cfg), chat_keys=(d.chosen_key,))
    return tokenize_pairs(
        rows,
        tokenizer,
        max_length=d.max_length,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        add_eos=d.add_eos,
        chat=chat,
        tools_key=d.tools_key,
    )


def build_dpo_task(cfg: DPORunConfig, tokenizer) -> tuple:
    p = cfg.dpo
    train, held_out_examples = read_train_and_eval(cfg, tokenizer, _read)
    data = _PairData(train.examples, tokenizer.pad_token_id)
    held_out = _PairData(held_out_examples, tokenizer.pad_token_id)
    objective = DPOObjective(loss_type=p.loss_type, beta=p.beta, label_smoothing=p.label_smoothing, nll_coef=p.nll_coef)
    task = OfflineTask(
        objective=objective,
        num_examples=len(train.examples),
        collate=data.collate,
        eval_num_examples=len(held_out.examples),
        eval_collate=held_out.collate,
        console_keys=("loss", "rewards/accuracy", "rewards/margin", "grad_norm", "lr"),
        attach=lambda task_, ctx, policy, reference: attach_reference(task_, ctx, policy, reference, [data, held_out]),
    )
    return task, train.skipped_rows


def read_data(cfg: DPORunConfig, tokenizer) -> str:
    """``--dry-run``: the data read and tokenized as a run reads it (the descriptor's ``read_data``)."""
    return data_summary(cfg, tokenizer, build_dpo_task)


def attach_reference(
    task: OfflineTask, ctx: RunContext, policy: WorkerGroup, reference: Optional[WorkerGroup], datasets: List[_PairData]
) -> None:
    """Score the reference: its group of the plan (``model.ref_path``, else the initial policy), or without one
    (LoRA) the policy's frozen base, the policy's workers with the adapters off. Every pair's log-probs are
    precomputed now (train and held-out data; the reference group is released after), or each step's global batch
    is scored."""
    cfg: DPORunConfig = ctx.cfg
    fn: ScoreFn  # on the base: OnBaseModel(ReferenceLogps()); on a group of its own: ReferenceLogps()
    if reference is None:
        scorer, fn = policy, OnBaseModel(ReferenceLogps())
    else:
        scorer, fn = reference, ReferenceLogps()
    if cfg.dpo.ref_mode == "online":
        task.prepare = lambda batch: batch.replace(ref_logps=scorer.score_batch(batch, fn))
        return
    for data in datasets:
        data.ref_logps = precompute_reference(scorer, data, fn)
    pairs = sum(len(d.examples) for d in datasets)
    if scorer is policy:
        log.info(f"[dpo] reference log-probs precomputed for {pairs} pairs on the policy's frozen base (LoRA)")
        return
    scorer.shutdown()
    ctx.groups.remove(scorer)
    log.info(f"[dpo] reference log-probs precomputed for {pairs} pairs; reference workers released")


def precompute_reference(ref: WorkerGroup, data: _PairData, fn: ScoreFn) -> torch.Tensor:
    """``(N, 2)`` summed reference log-probs of every pair: on a frozen group ``REF_BATCH_SIZE`` pairs per forward,
    on the trained one (LoRA's base) its micro-batch size, under ``train.max_tokens_per_micro_batch`` as many as
    the budget holds."""
    n = len(data.examples)
    window = REF_BATCH_SIZE * ref.size * 8  # collated a window at a time: a padded copy of the whole set is not kept
    assert ref.engine_spec is not None, "the reference group was built before it scores"
    rows = None if ref.engine_spec.max_tokens_per_micro_batch or ref.trainable else REF_BATCH_SIZE
    parts = [
        ref.score_batch(data.collate(list(range(i, min(i + window, n)))), fn, rows_per_forward=rows)
        for i in range(0, n, window)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, 2)


def train_dpo(cfg: DPORunConfig) -> RunResult:
    return run_offline(cfg, DPO, build_dpo_task)


def dpo_batch_lines(cfg: DPORunConfig, lines: List[str]) -> List[str]:
    """``--dry-run``'s batch lines of DPO (``TrainerKind.batch_lines``): an offline trainer's, with its reference
    group's ranks and mode when it starts one."""
    if DPO.reference_group(cfg):
        d = cfg.dpo
        lines = lines + [
            f"  reference: {d.ref_num_workers} ranks, dpo.ref_mode={d.ref_mode}"
            + (" (scores every pair once, then released)" if d.ref_mode == "precompute" else "")
        ]
    return batch_lines(cfg, lines)


#: The DPO family's descriptor (rlhf.trainers.descriptor), listed in rlhf.trainers.kinds.
DPO = TrainerKind(
    name="dpo",
    run_name="dpo",
    config_cls=DPORunConfig,
    train=train_dpo,
    cli_module="rlhf.cli.train_dpo",
    row_fields=row_fields,
    read_data=read_data,
    batch_lines=dpo_batch_lines,
    sections=("dpo",),
    preset_prefixes=("dpo",),
    has_reference=lambda cfg: True,
    reference_ranks=lambda cfg: cfg.dpo.ref_num_workers,
)
