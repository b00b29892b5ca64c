"""Cutting a global batch by rows or by a token budget (rlhf/distributed/micro_batches.py) and the group using it:
every row in exactly one counted micro-batch, budgets kept, ranks in lockstep, metrics equal to the whole batch."""

from __future__ import annotations

import random

import pytest
import torch
from group_helpers import LocalGroup
from transformers import AutoModelForCausalLM

from rlhf.batch import Batch
from rlhf.distributed.engine import EngineSpec
from rlhf.distributed.group import row_lengths
from rlhf.distributed.micro_batches import consecutive_by_tokens, cut_by_rows, cut_by_tokens, micro_batch_tokens
from rlhf.objectives.actor_critic import TokenLogps
from rlhf.objectives.base import Totals
from rlhf.objectives.sft import SFTObjective


def _long_tailed(n, seed, pairs=False):
    rng = random.Random(seed)
    length = lambda: min(200, max(2, int(rng.lognormvariate(3.0, 0.9))))  # noqa: E731
    return [(length(), length()) if pairs else (length(),) for _ in range(n)]


def test_the_cost_of_a_micro_batch_is_what_its_forward_holds():
    rows = [(5,), (3,), (9,)]
    assert micro_batch_tokens(rows, packing=True) == 17
    assert micro_batch_tokens(rows, packing=False) == 3 * 9
    assert micro_batch_tokens([(4, 7), (2, 2)], packing=False) == 4 * 7  # a pair is two sequences
    assert micro_batch_tokens([(4, 7), (2, 2)], packing=True) == 15


def test_cut_by_rows_is_the_contiguous_cut():
    cut = cut_by_rows(8, ranks=2, micro_batch_size=2)
    assert cut.micro_batches == (((0, 1), (2, 3)), ((4, 5), (6, 7))) and cut.fillers == 0
    with pytest.raises(ValueError, match="do not cut"):
        cut_by_rows(8, ranks=3, micro_batch_size=2)


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("ranks,budget", [(1, 400), (2, 400), (2, 1000), (4, 450)])
def test_cut_by_tokens_keeps_every_row_once_within_the_budget_and_the_ranks_in_lockstep(packing, pairs, ranks, budget):
    for seed in range(5):
        lengths = _long_tailed(24, seed, pairs)
        cut = cut_by_tokens(lengths, ranks, budget, packing)
        counted = [
            rows for shard, flags in zip(cut.micro_batches, cut.counted) for rows, keep in zip(shard, flags) if keep
        ]
        assert sorted(r for rows in counted for r in rows) == list(range(len(lengths)))
        assert all(micro_batch_tokens([lengths[r] for r in rows], packing) <= budget for rows in counted)
        assert len({len(shard) for shard in cut.micro_batches}) == 1  # every rank runs as many micro-batches
        per_rank_rows = [
            sum(len(rows) for rows, keep in zip(shard, flags) if keep)
            for shard, flags in zip(cut.micro_batches, cut.counted)
        ]
        assert per_rank_rows == [len(lengths) // ranks] * ranks
        for shard, flags in zip(cut.micro_batches, cut.counted):
            own = [r for rows, keep in zip(shard, flags) if keep for r in rows]
            for rows, keep in zip(shard, flags):
                if not keep:  # a filler: one row, the rank's own shortest
                    assert len(rows) == 1 and sum(lengths[rows[0]]) == min(sum(lengths[r]) for r in own)
            assert list(flags) == sorted(flags, reverse=True)  # fillers last
        assert cut_by_tokens(lengths, ranks, budget, packing) == cut  # deterministic


def test_ranks_get_balanced_tokens():
    lengths = [(n,) for n in (100, 90, 80, 10, 10, 10, 5, 5)]
    cut = cut_by_tokens(lengths, ranks=2, max_tokens=200, packing=True)
    totals = [
        sum(lengths[r][0] for rows, keep in zip(shard, flags) if keep for r in rows)
        for shard, flags in zip(cut.micro_batches, cut.counted)
    ]
    # longest first to the lighter rank, four rows each: 100+10+10+10 and 90+80+5+5 (the best split: whichever
    # rank holds two of 100, 90, 80 has at least 170)
    assert totals == [130, 180]
    contiguous = [sum(n for (n,) in lengths[:4]), sum(n for (n,) in lengths[4:])]
    assert contiguous == [280, 30]  # what the row cut would have given


def test_a_row_over_the_budget_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"row 2 holds 60 tokens, more than train.max_tokens_per_micro_batch=50"):
        cut_by_tokens([(10,), (20,), (30, 30)], ranks=1, max_tokens=50, packing=True)
    with pytest.raises(ValueError, match="do not divide over 2 ranks"):
        cut_by_tokens([(10,)] * 3, ranks=2, max_tokens=50, packing=True)


def test_consecutive_chunks_keep_the_order_and_the_budget():
    lengths = [(n,) for n in (30, 30, 50, 120, 10, 10, 10)]
    chunks = consecutive_by_tokens(lengths, max_tokens=100, packing=False)
    assert [list(c) for c in chunks] == [[0, 1], [2], [3], [4, 5, 6]]  # 120 alone exceeds it: a chunk of its own
    assert [list(c) for c in consecutive_by_tokens(lengths, 100, packing=True)] == [[0, 1], [2], [3], [4, 5, 6]]
    assert [list(c) for c in consecutive_by_tokens(lengths, 1000, packing=True)] == [list(range(7))]


# ------------------------------------------------------------------------------------------------ the group
@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def _batch(model, lengths, seed=0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(4, model.config.vocab_size, (n,), generator=gen)
        mask[i, :n] = 1
    loss_mask = mask.clone()
    loss_mask[:, 0] = 0
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, sample_index=torch.arange(len(lengths)) + 100)


LENGTHS = [40, 3, 7, 25, 2, 9, 31, 4]


def test_train_batch_under_a_budget_gives_the_whole_batch_metrics_and_counts_no_filler(model):
    batch = _batch(model, LENGTHS)
    objective = SFTObjective()
    with torch.no_grad():
        whole = objective.finalize(objective.loss(model, batch)[1], objective.count(batch))
    group = LocalGroup(model, EngineSpec.for_token_budget(8, max_tokens=48, num_workers=2), ranks=2)
    result = group.train_batch(batch, objective)
    per_rank, normalizer, _ = group.given
    assert len(per_rank[0]) == len(per_rank[1]) and group.counted is not None  # lockstep, with fillers
    assert normalizer == objective.count(batch) == result.normalizer
    assert result.metrics["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert result.metrics["num_tokens"] == whole["num_tokens"]
    for rank, flags in zip(per_rank, group.counted):
        for mb, keep in zip(rank, flags):
            if keep:  # each real micro-batch within the budget (padded: rows x longest) and trimmed
                assert mb.input_ids.numel() <= 48 and mb.input_ids.shape[1] == int(mb.attention_mask.sum(-1).max())
    # the row over the budget is named by its sample
    tight = LocalGroup(model, EngineSpec.for_token_budget(8, max_tokens=30, num_workers=2), ranks=2)
    with pytest.raises(ValueError, match=r"policy: row 0 \(sample 100\) holds 40 tokens"):
        tight.train_batch(batch, objective)


def test_score_batch_under_a_budget_chunks_by_tokens_in_order(model):
    batch = _batch(model, LENGTHS, seed=1)
    by_rows = LocalGroup(model, EngineSpec.for_global_batch(8, micro_batch_size=1, num_workers=1), ranks=1)
    by_tokens = LocalGroup(model, EngineSpec.for_token_budget(8, max_tokens=64, num_workers=1, packing=True), ranks=1)
    real = batch.attention_mask.bool()  # padding columns hold meaningless values, as documented
    torch.testing.assert_close(
        by_tokens.score_batch(batch, TokenLogps())[real],
        by_rows.score_batch(batch, TokenLogps())[real],
        rtol=1e-5,
        atol=1e-5,
    )
    assert [len(c) for c in by_tokens._chunks(batch, None, "score")] == [3, 3, 2]  # 40+3+7 | 25+2+9 | 31+4


def test_evaluate_batch_under_a_budget_counts_every_row_once(model):
    batch = _batch(model, LENGTHS, seed=2)
    group = LocalGroup(model, EngineSpec.for_token_budget(8, max_tokens=50, num_workers=2), ranks=2)
    objective = SFTObjective()
    totals = group.evaluate_batch(batch, objective)
    with torch.no_grad():
        whole = Totals(sums=objective.loss(model, batch)[1], normalizer=objective.count(batch))
    assert totals.normalizer == whole.normalizer
    assert totals.finalize(objective)["loss"] == pytest.approx(whole.finalize(objective)["loss"], rel=1e-6)


def test_row_lengths_reads_the_mask_of_single_rows_and_pairs(model):
    single = _batch(model, [3, 5])
    assert row_lengths(single) == [(3,), (5,)]
    pairs = Batch(
        input_ids=torch.stack([single.input_ids, single.input_ids.flip(0)], 1),
        attention_mask=torch.stack([single.attention_mask, single.attention_mask.flip(0)], 1),
    )
    assert row_lengths(pairs) == [(3, 5), (5, 3)]


# ------------------------------------------------------------------------------------------------ before any actor
def test_a_data_row_no_micro_batch_can_hold_is_refused_with_its_position(tmp_path):
    from shared_helpers import write_jsonl

    from rlhf.config.loader import load_config
    from rlhf.config.schema import DPORunConfig
    from rlhf.data.io import DataError
    from rlhf.models.tiny import build_tokenizer
    from rlhf.trainers.offline.dpo import _read
    from rlhf.trainers.offline.loop import read_train_and_eval

    rows = [
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
        {"prompt": "2+2=", "chosen": "4 " + "9 " * 20, "rejected": "5"},  # the long one: row 2
        {"prompt": "3+3=", "chosen": "6", "rejected": "7"},
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    tokenizer = build_tokenizer()

    def read(*overrides):
        cfg = load_config(DPORunConfig, None, ["model.path=unused", f"data.train_path={path}", *overrides])
        return read_train_and_eval(cfg, tokenizer, _read)

    train, _ = read("train.max_tokens_per_micro_batch=100", "train.packing=true")
    packed = sum(len(e.chosen.input_ids) + len(e.rejected.input_ids) for e in train.examples[1:2])
    padded = 2 * max(len(e.chosen.input_ids) for e in train.examples[1:2])
    with pytest.raises(
        DataError,
        match=rf"data.train_path={path}: row 2 \(counting from 1\) holds {packed} tokens "
        rf"\(the sum of its sequences' lengths, packed\), more than "
        rf"train.max_tokens_per_micro_batch={packed - 1}",
    ):
        read(f"train.max_tokens_per_micro_batch={packed - 1}", "train.packing=true")
    with pytest.raises(
        DataError,
        match=rf"row 2 \(counting from 1\) holds {padded} tokens \(its sequences x the "
        rf"longest, padded\)",
    ):
        read(f"train.max_tokens_per_micro_batch={padded - 1}")
    read(f"train.max_tokens_per_micro_batch={padded}")  # exactly the longest row fits
