"""Sequence parallelism's own logic without Ray: the heads rule, how a rank's share of the rows is laid out, the
token budget of a sequence group, the ranks the plans start, the refusals by key and the audit's splits. The
sharded forward itself runs on real ranks in tests/integration/test_sequence_parallel.py."""

from __future__ import annotations

import pytest
import torch

from rlhf.audit.factorizations import factorizations, parse_factorizations
from rlhf.config import ConfigError, load_config
from rlhf.config.schema import DPORunConfig, SFTRunConfig
from rlhf.distributed.engine import EngineSpec
from rlhf.distributed.micro_batches import cut_by_tokens
from rlhf.models.sequence_parallel import SequenceGroup, check_heads, shard_inputs

REQUIRED = ["model.path=/models/tiny", "data.train_path=/data/train.jsonl"]


@pytest.mark.parametrize(
    "heads, kv, size, ok",
    [(4, 2, 2, True), (4, 2, 4, True), (4, 1, 4, True), (8, 2, 4, True), (4, 2, 3, False), (4, 4, 8, False)],
)
def test_heads_must_divide_and_kv_heads_divide_or_replicate(heads, kv, size, ok):
    why = check_heads(heads, kv, size)
    assert (why is None) == ok
    if why is not None:
        assert f"do not divide by {size}" in why


def test_kv_heads_that_neither_divide_nor_are_divided_are_named():
    assert check_heads(12, 6, 4) == "the model's 6 key/value heads neither divide by 4 nor divide it"


def _rows():
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    return ids, mask


@pytest.mark.parametrize("rank", [0, 1])
def test_a_padded_shard_is_a_slice_of_the_rows_padded_to_a_multiple_with_global_positions(rank):
    ids, mask = _rows()
    inputs = shard_inputs(SequenceGroup(size=2, rank=rank, group=None, core="sdpa"), ids, mask, packed=False)
    padded = torch.nn.functional.pad(ids, (0, 1))  # 5 columns -> 6, 3 per rank
    take = slice(3 * rank, 3 * rank + 3)
    assert torch.equal(inputs.model_inputs["input_ids"], padded[:, take])
    assert inputs.model_inputs["position_ids"].tolist() == [list(range(6))[take]] * 2
    # the last position of rank 0 predicts rank 1's first token
    assert torch.equal(inputs.next_ids, padded.roll(-1, dims=1)[:, take])
    assert (inputs.shard.width, inputs.shard.length, inputs.packed) == (5, 3, None)
    assert "cu_seq_lens_q" not in inputs.model_inputs


def test_a_packed_shard_pads_the_packed_sequence_with_one_more_row():
    ids, mask = _rows()  # 8 real tokens -> 3 ranks of 3 positions: one padding position, its own row
    inputs = shard_inputs(SequenceGroup(size=3, rank=2, group=None, core="rlhf_varlen"), ids, mask, packed=True)
    assert inputs.model_inputs["input_ids"].tolist() == [[11, 12, 0]]
    assert inputs.model_inputs["position_ids"].tolist() == [[1, 2, 0]]
    assert inputs.model_inputs["cu_seq_lens_q"].tolist() == [0, 5, 8, 9]
    assert inputs.model_inputs["max_length_q"] == 5
    assert inputs.next_ids.tolist() == [[12, 0, 5]]  # the stream's last position wraps to a dummy (dropped)
    assert (inputs.shard.width, inputs.shard.length) == (8, 3) and inputs.packed is not None


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_rows_whose_lengths_the_host_knows_are_sharded_as_before_without_a_read(packed):
    """A trainer rank's micro-batch (its row lengths recorded on the host) is laid out without reading the device,
    into the same inputs, and hands transformers a mask that it takes as ready-made (the core attention takes none):
    without one, transformers reads the position ids back, looking for packed rows."""
    from transformers import Qwen2Config
    from transformers.masking_utils import create_causal_mask

    from rlhf.utils.host_reads import HostReads

    ids, mask = _rows()
    group = SequenceGroup(size=3, rank=1, group=None, core="rlhf_varlen" if packed else "sdpa")
    read = shard_inputs(group, ids, mask, packed)
    with HostReads() as reads:
        told = shard_inputs(group, ids, mask, packed, host_lengths=[5, 3])
    assert reads.total == 0
    assert told.model_inputs.keys() == read.model_inputs.keys()
    for key, value in read.model_inputs.items():
        assert torch.equal(told.model_inputs[key], value) if torch.is_tensor(value) else told.model_inputs[key] == value
    assert torch.equal(told.next_ids, read.next_ids) and told.shard == read.shard
    config = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    positions = told.model_inputs["position_ids"]
    mask_args = dict(
        config=config, inputs_embeds=torch.zeros(*positions.shape, 8), past_key_values=None, position_ids=positions
    )
    with HostReads() as reads:
        passed = create_causal_mask(attention_mask=told.model_inputs["attention_mask"], **mask_args)
    assert passed is told.model_inputs["attention_mask"] and reads.total == 0
    with HostReads() as reads:
        create_causal_mask(attention_mask=None, **mask_args)
    assert reads.total == 1  # what the placeholder spares: the look for packed position ids


def test_left_padded_rows_are_refused():
    ids = torch.tensor([[0, 5, 6]])
    with pytest.raises(ValueError, match="right-padded"):
        shard_inputs(SequenceGroup(2, 0, None, "sdpa"), ids, torch.tensor([[0, 1, 1]]), packed=False)


def test_a_sequence_group_holds_its_ranks_budget_and_names_it_when_a_row_exceeds_it():
    lengths = [(70,), (30,), (30,), (10,)]
    cut = cut_by_tokens(lengths, ranks=2, max_tokens=40, packing=True, sequence_parallel=2)  # 80 per group
    assert all(sum(lengths[i][0] for i in mb) <= 80 for shard in cut.micro_batches for mb in shard)
    with pytest.raises(ValueError, match=r"row 0 holds 70 tokens, more than train.max_tokens_per_micro_batch=30 "):
        cut_by_tokens(lengths, ranks=2, max_tokens=30, packing=True, sequence_parallel=2)
    with pytest.raises(ValueError, match="x strategy.sequence_parallel_size=2"):
        cut_by_tokens(lengths, ranks=2, max_tokens=30, packing=True, sequence_parallel=2)


def test_a_group_step_takes_rows_for_its_data_parallel_ranks():
    spec = EngineSpec.for_global_batch(8, 2, 2, sequence_parallel_size=2)  # 2 data-parallel ranks
    assert spec.grad_accum_steps == 2 and spec.global_batch_size(world_size=4) == 8
    with pytest.raises(ValueError, match="sequence_parallel_size must be >= 1"):
        EngineSpec(zero_stage=0, precision="fp32", micro_batch_size=1, grad_accum_steps=1, sequence_parallel_size=0)


def test_every_trainer_role_starts_its_ranks_times_the_size():
    from rlhf.trainers.kinds import kind_of

    cfg = load_config(
        DPORunConfig,
        None,
        [*REQUIRED, "train.num_workers=2", "strategy.sequence_parallel_size=2", "dpo.ref_mode=online"],
    )
    plan = kind_of(cfg).plan(cfg, 0.0)
    assert [(a.role, a.count) for a in plan.actors] == [("policy", 4), ("reference", 2)]


def test_online_rl_roles_are_sharded_and_the_engines_are_not():
    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.trainers.kinds import kind_of

    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            *REQUIRED,
            "reward.functions=[m:f]",
            "strategy.sequence_parallel_size=2",
            "algo.advantage_estimator=gae",
            "critic.num_workers=1",
            "rollout.num_engines=1",
        ],
    )
    counts = {a.role: a.count for a in kind_of(cfg).plan(cfg, 0.0).actors}
    assert counts["policy"] == 2 * cfg.train.num_workers and counts["critic"] == 2 and counts["rollout"] == 1


def test_bad_sizes_are_refused_by_key():
    with pytest.raises(ConfigError, match="strategy.sequence_parallel_size must be >= 1, got 0"):
        load_config(SFTRunConfig, None, [*REQUIRED, "strategy.sequence_parallel_size=0"])


def test_the_hybrid_engine_is_refused_with_sequence_parallelism():
    from rlhf.config.rl_schema import RLRunConfig

    with pytest.raises(ConfigError, match=r"colocate.hybrid_engine needs strategy.sequence_parallel_size=1 \(got 2\)"):
        load_config(
            RLRunConfig,
            "grpo_tiny",
            [
                *REQUIRED,
                "reward.functions=[m:f]",
                "strategy.sequence_parallel_size=2",
                "colocate.hybrid_engine=true",
                "rollout.max_staleness=0",
                "rollout.num_engines=1",
                "train.num_workers=1",
            ],
        )


def test_the_audit_compares_a_sharded_run_with_its_unsharded_split_first():
    splits = factorizations(8, 2, 1, sequence=2)
    assert [(f.label, f.why) for f in splits] == [
        ("2x4x1xsp2", "configured"),
        ("2x4x1", "sp 1"),
        ("1x8x1xsp2", "micro 1"),
    ]
    assert [f.label for f in factorizations(8, 2, 1)] == ["2x4x1", "1x8x1", "4x2x1"]  # unchanged without it


def test_the_audit_parses_a_chosen_sharded_split():
    assert [(f.label, f.sequence) for f in parse_factorizations("2x2x2xsp4,1x8x1", 8)] == [
        ("2x2x2xsp4", 4),
        ("1x8x1", 1),
    ]
    with pytest.raises(ValueError, match="MICROxACCUMxRANKS"):
        parse_factorizations("2x2x2xq4", 8)


@pytest.mark.parametrize("positions, refused", [(131072, False), (32768, True)])
def test_a_64k_response_budget_is_taken_when_the_model_holds_it_and_refused_by_key_when_not(
    tmp_path, positions, refused
):
    """The rollout side of long rows: a 64k-token response limit is no special case; the engines' context (prompt
    + response) is checked against the policy's positions before Ray starts."""
    import json

    from rlhf.config.rl_schema import RLRunConfig
    from rlhf.trainers.online.checks import check_engine_context

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": positions}))
    cfg = load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            f"model.path={tmp_path}",
            "data.train_path=/data/train.jsonl",
            "reward.functions=[m:f]",
            "rollout.max_prompt_length=1024",
            "rollout.max_new_tokens=65536",
            "strategy.sequence_parallel_size=4",
        ],
    )
    assert cfg.engine_context == 1024 + 65536
    if not refused:
        check_engine_context(cfg)
        return
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_length \+ rollout.max_new_tokens \(1024 \+ 65536"):
        check_engine_context(cfg)


def test_a_sliding_window_a_padded_sharded_forward_would_drop_is_refused():
    from rlhf.models.sequence_parallel import window_problem

    assert window_problem("sdpa", None, 8192, {}) is None  # no window
    assert window_problem("sdpa", 4096, 4096, {}) is None  # within it
    assert window_problem("flash_attention_2", 4096, 8192, {}) is None  # flash applies it
    assert window_problem("rlhf_varlen", 4096, 8192, {"cu_seq_lens_q": None}) is None  # packed: rlhf_varlen checks
    assert window_problem("rlhf_varlen", 4096, 8192, {}) == (
        "rlhf_ulysses over rlhf_varlen has no sliding window: a 8192-position row exceeds the model's 4096-token "
        "window (use flash_attention_2, which applies it, or shorter rows)"
    )
