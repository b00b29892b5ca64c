"""KTO in the DPO family (``train_dpo`` with ``dpo.loss_type=kto``; Ethayarajh et al. 2024): unpaired rows of a
prompt, one completion and a desirable / undesirable label (TRL's unpaired layout, text or conversational).

Per step: the reference log-probs of every row's own and mismatched sequence (precomputed or online, as DPO's),
then the policy's log-probs of the mismatched sequences of the whole global batch give the KL reference point
``z_0`` (:mod:`rlhf.objectives.kto`), then the update on the rows' own sequences.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from rlhf.batch import Batch
from rlhf.config.schema import DPORunConfig
from rlhf.data.formats import read_formatted, unpaired_fields
from rlhf.data.tokenize import Tokenized, collate_unpaired, tokenize_unpaired
from rlhf.distributed.group import WorkerGroup
from rlhf.objectives.kto import KTOObjective, MismatchedLogps, with_kl_baseline
from rlhf.trainers.context import RunContext
from rlhf.trainers.offline.loop import OfflineTask, read_train_and_eval
from rlhf.trainers.offline.reference import ReferenceScored, attach_reference
from rlhf.utils.log import get_logger

log = get_logger(__name__)

#: The weighted label balance the paper advises, lambda_D n_D / (lambda_U n_U) (Ethayarajh et al. 2024, sec. 4.2).
ADVISED_BALANCE = (1.0, 4.0 / 3.0)


def kto_row_fields(cfg: DPORunConfig) -> Dict[str, Any]:
    """What an unpaired row holds (``rlhf.data.io.read_rows`` arguments)."""
    d = cfg.data
    return unpaired_fields(d.prompt_key, d.completion_key, d.label_key, tools_key=d.tools_key)


def _read(cfg: DPORunConfig, tokenizer, path: str, split: str) -> Tokenized:
    d = cfg.data
    rows, chat = read_formatted(d, path, split, tokenizer, kto_row_fields(cfg), chat_keys=(d.completion_key,))
    return tokenize_unpaired(
        rows,
        tokenizer,
        max_length=d.max_length,
        prompt_key=d.prompt_key,
        completion_key=d.completion_key,
        label_key=d.label_key,
        add_eos=d.add_eos,
        chat=chat,
        tools_key=d.tools_key,
    )


def label_balance(cfg: DPORunConfig, examples: list) -> str:
    """A line on the data's weighted label balance ``lambda_D n_D / (lambda_U n_U)`` against the paper's advice."""
    p = cfg.dpo
    good = sum(e.desirable for e in examples)
    bad = len(examples) - good
    line = f"[kto] {good} desirable, {bad} undesirable rows"
    if not bad or not good:
        return line + ": one label only; the loss still trains, but KTO learns from the contrast of both"
    ratio = p.desirable_weight * good / (p.undesirable_weight * bad)
    low, high = ADVISED_BALANCE
    advice = (
        ""
        if low <= ratio <= high
        else f" (outside the paper's advised [{low}, {high:.3f}]: set dpo.desirable_weight or dpo.undesirable_weight)"
    )
    return line + f"; dpo.desirable_weight x {good} / (dpo.undesirable_weight x {bad}) = {ratio:.3f}{advice}"


def build_kto_task(cfg: DPORunConfig, tokenizer) -> tuple:
    p = cfg.dpo
    train, held_out_examples = read_train_and_eval(cfg, tokenizer, _read)
    log.info(label_balance(cfg, train.examples))
    data = ReferenceScored(train.examples, tokenizer.pad_token_id, collate_unpaired)
    held_out = ReferenceScored(held_out_examples, tokenizer.pad_token_id, collate_unpaired)
    objective = KTOObjective(
        loss_type=p.loss_type,
        beta=p.trained_beta,
        desirable_weight=p.desirable_weight,
        undesirable_weight=p.undesirable_weight,
    )

    def attach(task: OfflineTask, ctx: RunContext, policy: WorkerGroup, reference: Optional[WorkerGroup]) -> None:
        attach_reference(task, ctx, policy, reference, [data, held_out], unit="rows")
        task.prepare = _with_kl_baseline(task.prepare, policy)

    task = OfflineTask(
        objective=objective,
        num_examples=len(train.examples),
        collate=data.collate,
        eval_num_examples=len(held_out.examples),
        eval_collate=held_out.collate,
        console_keys=("loss", "kl", "rewards/margin", "grad_norm", "lr"),
        attach=attach,
    )
    return task, train.skipped_rows


def _with_kl_baseline(reference_prepare, policy: WorkerGroup):
    """The step's preparation: the reference log-probs when scored online, then ``z_0`` from the policy's log-probs
    of the whole batch's mismatched sequences (no gradient; the weights the step starts from)."""

    def prepare(batch: Batch) -> Batch:
        if reference_prepare is not None:
            batch = reference_prepare(batch)
        return with_kl_baseline(batch, policy.score_batch(batch, MismatchedLogps()))

    return prepare
