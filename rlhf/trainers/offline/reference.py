"""The frozen reference of the DPO family (pairs and KTO's unpaired rows): its log-probs precomputed for the whole
dataset before training (``dpo.ref_mode=precompute``) or scored for every step's global batch (``online``). Both
give the same numbers.

Who scores it: a reference group of its own (another ``model.ref_path``, or online; released once it has
precomputed), or with ``dpo.ref_num_workers=0`` a frozen copy each policy rank holds in its own process (dropped once
it has precomputed), else the policy's own ranks, before the first step. The policy's starting weights are the reference
then, loaded from the same files in the same precision, scored in eval mode (no dropout) before any optimizer step
or checkpoint restore, as TRL's ``precompute_ref_log_probs`` scores the model itself when it has no ``ref_model``:
the run holds its policy's devices alone and loads no second copy of the weights. With LoRA the policy's frozen
base, the adapters off, is the reference at every step, so it scores online too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from rlhf.batch import Batch
from rlhf.config.schema import DPORunConfig
from rlhf.distributed.group import WorkerGroup
from rlhf.distributed.sleep import moved_text
from rlhf.models.lora import OnBaseModel
from rlhf.objectives.base import ScoreFn
from rlhf.objectives.dpo import ReferenceLogps
from rlhf.trainers.context import RunContext
from rlhf.trainers.offline.loop import OfflineTask
from rlhf.utils.log import get_logger

log = get_logger(__name__)

REF_BATCH_SIZE = 16  # rows per reference forward when precomputing

# (examples, pad id, dataset row indices, reference log-probs or None) -> Batch
Collate = Callable[[list, int, Sequence[int], Optional[torch.Tensor]], Batch]


class ReferenceScored:
    """Tokenized rows in the pair layout (pairs, or unpaired rows with their mismatched sequences) plus, once
    computed, their reference log-probs ``(N, 2)``."""

    def __init__(self, examples: list, pad_id: int, collate: Collate) -> None:
        self.examples, self.pad_id, self._collate = examples, pad_id, collate
        self.ref_logps: torch.Tensor | None = None

    def collate(self, rows: Sequence[int]) -> Batch:
        ref = None if self.ref_logps is None else self.ref_logps[torch.tensor(rows, dtype=torch.long)]
        return self._collate([self.examples[i] for i in rows], self.pad_id, rows, ref)


def attach_reference(
    task: OfflineTask,
    ctx: RunContext,
    policy: WorkerGroup,
    reference: Optional[WorkerGroup],
    datasets: List[ReferenceScored],
    unit: str = "pairs",
) -> None:
    """Score the reference: its group of the plan, or without one the policy's workers (the module docstring): the
    copy they hold; with LoRA its frozen base, the adapters off; else, precomputing, its starting weights. Every
    row's log-probs are precomputed now (train and held-out data; a reference group is released after, a held copy
    dropped), or each step's global batch is scored (``task.prepare``). ``unit``: what a row is, for the log
    (``pairs``; KTO's ``rows``)."""
    cfg: DPORunConfig = ctx.cfg
    online = cfg.dpo.ref_mode == "online"
    fn: ScoreFn  # OnBaseModel(ReferenceLogps()) on LoRA's base, else ReferenceLogps() on the model as it is
    held = "reference" if reference is None and "reference" in policy.held else None  # TrainerKind.reference_held
    if reference is not None:
        scorer, fn, where = reference, ReferenceLogps(), "on the reference workers (released now)"
    elif held:
        scorer, fn, where = policy, ReferenceLogps(), "on the copy the policy's ranks hold (dropped now)"
    elif cfg.model.reference_is_base:
        scorer, fn, where = policy, OnBaseModel(ReferenceLogps()), "on the policy's frozen base (LoRA)"
    else:
        # the plan starts no group only for a reference the policy starts from: scored before it trains, or never
        assert not online and cfg.model.reference_is_initial, "an online or other reference needs a group of its own"
        scorer, fn, where = policy, ReferenceLogps(), "by the policy's ranks before its first step"
    if online:
        task.prepare = OnlineReference(scorer, fn, held, offload=cfg.dpo.ref_offload)
        return
    for data in datasets:
        data.ref_logps = precompute_reference(scorer, data, fn, on=held)
    rows = sum(len(d.examples) for d in datasets)
    # the precompute's forward passes, not the first step's: a step's perf/* metrics are its own work
    speed = scorer.perf_metrics().get(f"perf/{held or scorer.role}/forward_tokens_per_s")
    log.info(
        f"[dpo] reference log-probs precomputed for {rows} {unit} {where}"
        + (f" ({speed:,.0f} tokens/s)" if speed else "")
    )
    if scorer is reference:
        scorer.shutdown()
        ctx.groups.remove(scorer)
    elif held:
        scorer.release(held)


@dataclass
class OnlineReference:
    """``dpo.ref_mode=online``: each step's global batch (``task.prepare``) with its reference log-probs, scored on
    ``scorer``'s own model or on the copy its ranks hold as ``held``. ``offload`` (``dpo.ref_offload``, a held copy
    only): the copy then waits in host memory while the policy trains, until it next scores."""

    scorer: WorkerGroup
    fn: ScoreFn
    held: Optional[str]
    offload: bool = False
    told: bool = False  # the first offload says what it moved

    def __post_init__(self) -> None:
        assert self.held or not self.offload, "dpo.ref_offload is validated to need a held copy"

    def __call__(self, batch: Batch) -> Batch:
        scored = batch.replace(ref_logps=self.scorer.score_batch(batch, self.fn, on=self.held))
        if self.offload and self.held:
            moved = self.scorer.sleep_held([self.held])
            if not self.told and any(moved):
                self.told = True
                where = "in host memory while the policy trains"
                log.info(f"[dpo] reference offload: {moved_text(moved)} (ranks x the most a rank moved) {where}")
        return scored


def precompute_reference(
    ref: WorkerGroup, data: ReferenceScored, fn: ScoreFn, on: Optional[str] = None
) -> torch.Tensor:
    """``(N, 2)`` summed reference log-probs of every row: on a frozen group ``REF_BATCH_SIZE`` rows per forward,
    on the trained one (LoRA's base, the starting policy, the copy it holds: ``on``) its micro-batch size
    (the rows it is sized to hold), under ``train.max_tokens_per_micro_batch`` as many as the budget holds."""
    n = len(data.examples)
    window = REF_BATCH_SIZE * ref.size * 8  # collated a window at a time: a padded copy of the whole set is not kept
    assert ref.engine_spec is not None, "the reference group was built before it scores"
    rows = None if ref.engine_spec.max_tokens_per_micro_batch or ref.trainable else REF_BATCH_SIZE
    parts = [
        ref.score_batch(data.collate(list(range(i, min(i + window, n)))), fn, rows, on) for i in range(0, n, window)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, 2)
