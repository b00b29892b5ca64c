"""``WorkerGroup.train_batch`` / ``score_batch`` own the sharding (docs/custom_loops.md): how a global batch is cut
into ranks and micro-batches, where the normalizer is counted, what comes back.

The group's actors are replaced by an in-process stand-in for its two primitives (``train_step``, ``score``;
``group_helpers.LocalGroup``) that runs the real objective / score function on the real tiny model, so the cutting,
counting and merging code under test is the real one. That Ray workers train the same way is the integration tests'
business (test_workers, test_precision, test_fp64_run, test_examples).
"""

from __future__ import annotations

import math

import pytest
import torch
from group_helpers import LocalGroup
from transformers import AutoModelForCausalLM

from rlhf.batch import Batch
from rlhf.distributed.engine import EngineSpec
from rlhf.objectives.actor_critic import TokenLogps
from rlhf.objectives.base import Totals
from rlhf.objectives.sft import SFTObjective


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def _batch(model, rows: int = 8, seed: int = 0) -> Batch:
    """Right-padded rows of lengths 3..10 with 1..6 target tokens each."""
    gen = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for i in range(rows):
        prompt, response = 2 + i % 4, 1 + (3 * i) % 6
        seqs.append(torch.randint(4, model.config.vocab_size, (prompt + response,), generator=gen).tolist())
        masks.append([0] * prompt + [1] * response)
    width = max(map(len, seqs))
    pad = lambda xs: [x + [0] * (width - len(x)) for x in xs]  # noqa: E731
    return Batch(
        input_ids=torch.tensor(pad(seqs)),
        attention_mask=torch.tensor(pad([[1] * len(s) for s in seqs])),
        loss_mask=torch.tensor(pad(masks)),
        sample_index=torch.arange(rows),
    )


def test_train_batch_cuts_contiguous_rank_shards_and_counts_the_whole_batch(model):
    batch = _batch(model)
    group = LocalGroup(model, EngineSpec.for_global_batch(8, micro_batch_size=2, num_workers=2), ranks=2)
    assert group.engine_spec.grad_accum_steps == 2 and group.global_batch_size == 8
    objective = SFTObjective()
    result = group.train_batch(batch, objective, schedule_step=5)
    per_rank, normalizer, schedule_step = group.given
    rows = [[mb.sample_index.tolist() for mb in rank] for rank in per_rank]
    assert rows == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] and schedule_step == 5
    for rank in per_rank:  # each micro-batch trimmed to its own longest row, in its own memory
        for mb in rank:
            assert mb.input_ids.shape[1] == int(mb.attention_mask.sum(-1).max())
            assert mb.input_ids.is_contiguous() and mb.input_ids.untyped_storage().nbytes() == mb.input_ids.nbytes
    assert normalizer == objective.count(batch) == result.normalizer  # the whole global batch, once
    with torch.no_grad():
        whole = objective.finalize(objective.loss(model, batch)[1], objective.count(batch))
    assert result.metrics["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert (result.grad_norm, result.lr, result.num_samples) == (1.5, 0.1, 8)
    assert Totals(result.sums, result.normalizer).finalize(objective) == result.metrics


def test_every_split_of_one_batch_logs_the_same_metrics(model):
    batch, objective = _batch(model, seed=1), SFTObjective()
    logged = []
    for micro, ranks in ((8, 1), (4, 1), (1, 2), (2, 4), (1, 8)):
        group = LocalGroup(model, EngineSpec.for_global_batch(8, micro, ranks), ranks)
        logged.append(group.train_batch(batch, objective).metrics["loss"])
    assert max(logged) - min(logged) < 1e-6 * abs(logged[0])
    # a per-micro-batch mean of means would differ: the token counts per micro-batch are uneven
    pieces = [batch.slice(i, i + 1).trim() for i in range(8)]
    with torch.no_grad():
        means = [objective.finalize(objective.loss(model, p)[1], objective.count(p))["loss"] for p in pieces]
    assert abs(sum(means) / len(means) - logged[0]) > 1e-3


def test_train_batch_refuses_a_batch_of_the_wrong_size_naming_the_shape(model):
    group = LocalGroup(model, EngineSpec.for_global_batch(8, 2, 2), ranks=2)
    with pytest.raises(
        ValueError,
        match=r"policy: train_batch got 6 rows; one optimizer step takes micro_batch_size "
        r"2 x grad_accum_steps 2 x 2 ranks = 8",
    ):
        group.train_batch(_batch(model, rows=6), SFTObjective())
    group.trainable = False
    with pytest.raises(ValueError, match="needs a trainable group"):
        group.train_batch(_batch(model), SFTObjective())


def test_ranks_that_disagree_on_the_grad_norm_are_an_error_but_a_shared_nan_is_reported(model):
    spec = EngineSpec.for_global_batch(8, 2, 2)
    with pytest.raises(RuntimeError, match="ranks report different grad norms"):
        group = LocalGroup(model, spec, 2, report=lambda rank, _: (1.0 + 1e-7 * rank, 0.1))
        group.train_batch(_batch(model), SFTObjective())
    group = LocalGroup(model, spec, 2, report=lambda rank, _: (math.nan, 0.1))
    result = group.train_batch(_batch(model), SFTObjective())
    assert math.isnan(result.grad_norm)  # the health guard must see it


def test_for_global_batch_names_the_numbers_that_do_not_divide():
    with pytest.raises(ValueError, match=r"global batch 10 is not a multiple of micro_batch_size 2 x 3 workers = 6"):
        EngineSpec.for_global_batch(10, 2, 3)
    assert EngineSpec.for_global_batch(12, 2, 3, zero_stage=2).grad_accum_steps == 2


def test_score_batch_pads_per_token_results_back_to_the_batch_and_concatenates_per_row_ones(model):
    batch = _batch(model, rows=7, seed=2)  # 7 rows in chunks of 3: a short last chunk
    group = LocalGroup(model, EngineSpec.for_global_batch(6, 3, 2), ranks=2)
    logps = group.score_batch(batch, TokenLogps())
    with torch.no_grad():
        whole = TokenLogps()(model, batch)
    assert logps.shape == batch.input_ids.shape and logps.dtype == torch.float32
    mask = batch.attention_mask.bool()
    assert torch.allclose(logps[mask], whole[mask], atol=1e-5)
    widths = []
    for start in range(0, 7, 3):  # chunks of the build's micro-batch size (3); columns past a chunk's width are 0
        rows = slice(start, start + 3)
        widths.append(int(batch.attention_mask[rows].sum(-1).max()))
        assert (logps[rows, widths[-1] :] == 0).all()
    assert min(widths) < batch.input_ids.shape[1]  # some chunk really was narrower than the batch
    sums = group.score_batch(batch, lambda m, b: b.loss_mask.sum(-1).double(), rows_per_forward=2)
    assert sums.dtype == torch.float64 and sums.tolist() == batch.loss_mask.sum(-1).tolist()
    halves = group.score_batch(batch, lambda m, b: b.loss_mask.sum(-1).to(torch.bfloat16))
    assert halves.dtype == torch.float32  # at least float32
    with pytest.raises(ValueError, match="empty batch"):
        group.score_batch(batch.slice(0, 0), TokenLogps())


def test_evaluate_batch_adds_sums_and_counts_of_every_chunk(model):
    batch, objective = _batch(model, rows=7, seed=3), SFTObjective()

    class Evaluating(LocalGroup):
        def evaluate(self, batches, objective):
            totals = Totals()
            with torch.no_grad():
                for b in batches:
                    totals.add(objective.loss(self.model, b)[1], 0)
            return totals.sums

    totals = Evaluating(model, EngineSpec.for_global_batch(4, 2, 2), ranks=2).evaluate_batch(batch, objective)
    with torch.no_grad():
        whole = objective.finalize(objective.loss(model, batch)[1], objective.count(batch))
    assert totals.normalizer == objective.count(batch)
    assert totals.finalize(objective)["loss"] == pytest.approx(whole["loss"], rel=1e-6)
