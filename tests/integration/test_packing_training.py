"""Packing and token-budget micro-batches on real Ray ranks and DeepSpeed ZeRO-3 engines (CPU, gloo).

One 2-rank ZeRO-3 group, built for packing (its varlen attention also runs padded forwards), trains the same global
batch from the same weights under three cuts: one row per micro-batch padded (the reference), a token budget
padded, and a token budget packed. Under the budget the ranks hold different numbers of real micro-batches, so one
rank runs a zero-weight filler to stay in lockstep with the other's ZeRO-3 collectives. All three must log the same
loss and grad norm and end with the same weights. The trainers' own runs (SFT, RM, DPO, RL through the CLI code
path) are in the factorisation tests of test_offline_training, test_rm_training, test_dpo_training and
test_rl_algorithms.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from offline_helpers import _assert_same_weights

from rlhf.batch import Batch
from rlhf.distributed.cluster import actor_env
from rlhf.distributed.engine import EngineSpec, OptimSpec
from rlhf.distributed.group import GroupResources, WorkerGroup, row_lengths
from rlhf.distributed.micro_batches import cut_by_tokens
from rlhf.models.loading import CAUSAL_LM, ModelSpec
from rlhf.objectives.sft import SFTObjective

pytestmark = pytest.mark.usefixtures("ray_session")

# rank 0 gets 30 + 2 + 2 (two micro-batches of <= 30 tokens), rank 1 gets 10 + 10 + 10 (one): see the cut below
LENGTHS = [30, 10, 10, 10, 2, 2]
BUDGET = 30


def _batch(vocab: int) -> Batch:
    gen = torch.Generator().manual_seed(11)
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.randint(4, vocab, (n,), generator=gen)
        mask[i, :n] = 1
    loss_mask = mask.clone()
    loss_mask[:, 0] = 0
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, sample_index=torch.arange(len(LENGTHS)))


@pytest.fixture(scope="module")
def zero3_group(tiny_model):
    group = WorkerGroup("policy", GroupResources(num_workers=2, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")
    spec = EngineSpec.for_token_budget(len(LENGTHS), BUDGET, num_workers=2, zero_stage=3)
    group.build(
        ModelSpec(path=tiny_model, kind=CAUSAL_LM, packing=True),
        spec,
        OptimSpec(lr=1e-3, total_steps=4, scheduler="constant", betas=(0.9, 0.99)),
    )
    yield group
    group.shutdown()


def test_zero3_ranks_with_different_micro_batch_counts_train_like_the_row_cut(zero3_group, tmp_path):
    group = zero3_group
    batch = _batch(512)
    budget_spec = group.engine_spec
    for packing in (False, True):  # the scenario: ranks that need 2 and 1 micro-batches, one filler
        cut = cut_by_tokens(row_lengths(batch), 2, BUDGET, packing)
        assert [sum(c) for c in cut.counted] == [2, 1] and cut.fillers == 1
    start = str(tmp_path / "start")
    group.save_checkpoint(start)
    variants = {  # name: (cut by the group's spec, objective)
        "rows-padded": (dataclasses.replace(budget_spec, max_tokens_per_micro_batch=0), SFTObjective(packing=False)),
        "budget-padded": (dataclasses.replace(budget_spec, packing=False), SFTObjective(packing=False)),
        "budget-packed": (dataclasses.replace(budget_spec, packing=True), SFTObjective(packing=True)),
    }
    results, dirs = {}, []
    try:
        for name, (spec, objective) in variants.items():
            group.load_checkpoint(start)
            group.engine_spec = spec  # the driver-side cut; the engines were built for the budget (1 row x 3 max)
            steps = [group.train_batch(batch, objective, schedule_step=i) for i in range(2)]
            results[name] = [(s.metrics["loss"], s.grad_norm, s.normalizer) for s in steps]
            by_tokens = bool(spec.max_tokens_per_micro_batch)
            assert all(s.cut_metrics() == ({"micro_batches": 2, "fillers": 1} if by_tokens else {}) for s in steps)
            dirs.append(str(tmp_path / name))
            group.save_pretrained(dirs[-1])
    finally:
        group.engine_spec = budget_spec
    reference = results.pop("rows-padded")
    for name, got in results.items():
        for (loss, norm, count), (ref_loss, ref_norm, ref_count) in zip(got, reference):
            assert count == ref_count
            assert loss == pytest.approx(ref_loss, rel=1e-6), name
            assert norm == pytest.approx(ref_norm, rel=1e-5), name
    _assert_same_weights(dirs)
    assert reference[1][0] < reference[0][0]  # it trained


def test_zero3_partitions_every_matrix_and_keeps_every_vector_whole(zero3_group):
    """Each rank's ZeRO-3 parameters: the 1-D ones (norms, biases) stay whole (DeepSpeed's ``ds_persist``: no gather at
    each use), every matrix is partitioned, however small (the tiny model's would all fit DeepSpeed's default)."""
    # a lambda goes to the ranks by value; per parameter (persistent, rank of its full shape)
    kinds = lambda engine, batch: torch.tensor(  # noqa: E731
        [[[float(p.ds_persist), len(p.ds_shape)] for p in engine.module.parameters()]]
    )
    batch = _batch(512)
    per_rank = zero3_group.score([batch.select([0]), batch.select([1])], kinds)
    assert len(per_rank) == 2
    for kinds_of_rank in per_rank:
        persistent, ndim = kinds_of_rank[0].unbind(-1)
        assert (ndim == 1).any() and (ndim == 2).any()
        assert torch.equal(persistent.bool(), ndim == 1)
