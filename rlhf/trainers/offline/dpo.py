"""DPO-family training against a frozen reference (Rafailov et al. 2023; variants in rlhf.ops.preference): pairs,
or with ``dpo.loss_type=kto`` unpaired rows (rlhf.trainers.offline.kto); reference-free with ``simpo``, ``cpo`` or
``orpo`` (no reference group is started).

Reference log-probs come from the reference model, either once for the whole dataset before training
(``dpo.ref_mode=precompute``) or for every step's global batch (``online``, for datasets too large to score up
front); see rlhf.trainers.offline.reference. Precomputed, the reference the run starts from (no other
``model.ref_path``) is the policy's starting weights, which the policy's own ranks score before the first step;
any other reference, and every online one, runs on a frozen worker group of its own.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from rlhf.config.schema import DPORunConfig
from rlhf.data.formats import pair_fields, read_formatted
from rlhf.data.tokenize import Tokenized, collate_pairs, tokenize_pairs
from rlhf.objectives.dpo import DPOObjective
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.offline.kto import build_kto_task, kto_row_fields
from rlhf.trainers.offline.loop import OfflineTask, batch_lines, data_summary, read_train_and_eval, run_offline
from rlhf.trainers.offline.reference import ReferenceScored, attach_reference
from rlhf.trainers.run import RunResult
from rlhf.utils.log import get_logger

log = get_logger(__name__)


def row_fields(cfg: DPORunConfig) -> Dict[str, Any]:
    """What a preference row holds (``rlhf.data.io.read_rows`` arguments; the descriptor's ``row_fields``): a pair,
    or for an unpaired loss (KTO) a prompt, a completion and a label."""
    d = cfg.data
    if cfg.dpo.unpaired:
        return kto_row_fields(cfg)
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
    log.info(f"[dpo] {p.describe_loss()}")
    if p.unpaired:
        return build_kto_task(cfg, tokenizer)
    train, held_out_examples = read_train_and_eval(cfg, tokenizer, _read)
    data = ReferenceScored(train.examples, tokenizer.pad_token_id, collate_pairs)
    held_out = ReferenceScored(held_out_examples, tokenizer.pad_token_id, collate_pairs)
    objective = DPOObjective(
        loss_type=p.loss_type,
        beta=p.trained_beta,
        label_smoothing=p.label_smoothing,
        nll_coef=p.trained_nll_coef,
        margin=p.trained_margin,
    )
    # a reference-free loss (SimPO, CPO, ORPO) scores nothing before training: no reference group, no base pass
    attach = None if p.reference_free else _attach(data, held_out)
    task = OfflineTask(
        objective=objective,
        num_examples=len(train.examples),
        collate=data.collate,
        eval_num_examples=len(held_out.examples),
        eval_collate=held_out.collate,
        console_keys=("loss", "rewards/accuracy", "rewards/margin", "grad_norm", "lr"),
        attach=attach,
    )
    return task, train.skipped_rows


def _attach(data: ReferenceScored, held_out: ReferenceScored) -> Callable[..., None]:
    """The task's ``attach`` hook: the reference's log-probs of the train and held-out pairs."""
    return lambda task, ctx, policy, reference: attach_reference(task, ctx, policy, reference, [data, held_out])


def read_data(cfg: DPORunConfig, tokenizer) -> str:
    """``--dry-run``: the data read and tokenized as a run reads it (the descriptor's ``read_data``)."""
    return data_summary(cfg, tokenizer, build_dpo_task)


def train_dpo(cfg: DPORunConfig) -> RunResult:
    return run_offline(cfg, DPO, build_dpo_task)


def dpo_batch_lines(cfg: DPORunConfig, lines: List[str]) -> List[str]:
    """``--dry-run``'s batch lines of DPO (``TrainerKind.batch_lines``): an offline trainer's, with its loss and
    settings, and its reference group's ranks and mode when it starts one."""
    lines = lines + [f"  {cfg.dpo.describe_loss()}"]
    d = cfg.dpo
    if DPO.reference_group(cfg):
        lines = lines + [
            f"  reference: {d.ref_num_workers} ranks, dpo.ref_mode={d.ref_mode}"
            + (" (scores every pair once, then released)" if d.ref_mode == "precompute" else "")
        ]
    elif DPO.reference_held(cfg):
        lines = lines + [
            f"  reference: {cfg.model.ref_path or cfg.model.path}, a frozen copy in each policy rank's own process "
            f"(dpo.ref_num_workers=0), dpo.ref_mode={d.ref_mode}"
            + (": scores every pair once, then dropped" if d.ref_mode == "precompute" else "")
            + ("; in host memory between its passes (dpo.ref_offload)" if d.ref_offload else "")
        ]
    elif DPO.reference_on_policy(cfg) and not DPO.reference_on_base(cfg):
        lines = lines + [
            f"  reference: the starting policy, dpo.ref_mode={d.ref_mode}: the policy's ranks score every pair once "
            f"before the first step (no reference workers; dpo.ref_num_workers unused)"
        ]
    if cfg.dpo.unpaired:
        lines = lines + [
            f"  dpo.loss_type={cfg.dpo.loss_type}: unpaired rows ({cfg.data.prompt_key}, {cfg.data.completion_key}, "
            f"{cfg.data.label_key}); each step the policy first scores the global batch's mismatched sequences "
            f"for the KL reference point z_0 (a forward without gradient)"
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
    has_reference=lambda cfg: not cfg.dpo.reference_free,
    reference_ranks=lambda cfg: cfg.dpo.ref_num_workers,
    # TRL's precompute_ref_log_probs without a ref_model: the model scores before it trains, no second copy
    reference_is_initial_policy=lambda cfg: cfg.dpo.ref_mode == "precompute" and cfg.model.reference_is_initial,
    reference_held_by_policy=lambda cfg: cfg.dpo.ref_num_workers == 0,
)
