"""The DeepSpeed config the engine builds (pure dict logic)."""

from __future__ import annotations

from rlhf.distributed.engine import EngineSpec, build_ds_config, float64_sum_of_squares, parameter_groups


def test_run_batch_sizes_and_precision_override_a_user_file():
    user = {
        "train_batch_size": 999,
        "gradient_accumulation_steps": 7,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "overlap_comm": True},
        "steps_per_print": 5,
    }
    spec = EngineSpec(zero_stage=3, precision="fp32", micro_batch_size=2, grad_accum_steps=4, user_config=user)
    cfg = build_ds_config(spec, world_size=2, max_grad_norm=1.0)
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["zero_optimization"]["overlap_comm"] is True
    assert cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is False
    assert cfg["steps_per_print"] == 5  # user settings that do not touch the contract are kept
    assert user["zero_optimization"]["stage"] == 1  # the user's dict is not mutated


def test_bf16_accumulates_gradients_in_fp32_and_clipping_zero_disables():
    spec = EngineSpec(zero_stage=2, precision="bf16", micro_batch_size=1, grad_accum_steps=8)
    cfg = build_ds_config(spec, world_size=1, max_grad_norm=0.0)
    assert cfg["bf16"]["enabled"] is True and cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert cfg["gradient_clipping"] == 0.0


def test_offload_only_for_trainable_groups():
    spec = EngineSpec(zero_stage=3, precision="fp32", micro_batch_size=1, grad_accum_steps=1, offload_optimizer=True)
    assert build_ds_config(spec, 1, 1.0)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "offload_optimizer" not in build_ds_config(spec, 1, 1.0, trainable=False)["zero_optimization"]


def test_no_weight_decay_on_biases_and_norms():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    decay, no_decay = parameter_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])] and decay["weight_decay"] == 0.1
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


def test_weight_decay_follows_the_full_shape_of_zero3_partitioned_weights():
    """ZeRO-3 leaves an empty 1-D placeholder in every parameter and the real shape in ``ds_shape``: a weight matrix
    must still be decayed (test_rl_reference.py shows the effect on a real ZeRO-3 critic)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    decay, no_decay = parameter_groups(model, 0.1)
    assert [p.ds_shape for p in decay["params"]] == [torch.Size([4, 3])]
    assert len(no_decay["params"]) == 3


def test_the_gradient_norm_scratch_gives_the_bits_of_fresh_float64_copies():
    """The reused float64 buffer changes no bit of the norm: same values, same summation order."""
    import torch

    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(shape, generator=gen) * scale
        for shape, scale in [((512, 64), 1e-3), ((64,), 3.0), ((7, 5, 3), 1e4), ((1,), 1e-20)]
    ]
    expected = float(sum(g.double().pow(2).sum() for g in grads))
    first, scratch = float64_sum_of_squares(grads)
    assert first == expected and scratch.dtype == torch.float64 and scratch.numel() == 512 * 64
    scratch.fill_(float("nan"))  # whatever a previous step left in the buffer does not leak into the next sum
    again, reused = float64_sum_of_squares(grads, scratch)
    assert again == expected and reused is scratch
    grown, bigger = float64_sum_of_squares([torch.ones(40000)], scratch)
    assert grown == 40000.0 and bigger.numel() == 40000
    assert float64_sum_of_squares([], scratch) == (0.0, scratch)


def test_zero3_keeps_the_vectors_whole_and_partitions_every_matrix(tiny_model):
    """ZeRO 3's persistence threshold is the model's largest 1-D parameter (its width: norms and biases stay whole on
    every rank), not DeepSpeed's 1e5 elements, under which the tiny model would partition nothing; a user's DeepSpeed
    JSON still decides."""
    import json
    import os

    from rlhf.models.loading import ModelSpec, persistent_numel

    with open(os.path.join(tiny_model, "config.json")) as f:
        width = json.load(f)["hidden_size"]
    assert persistent_numel(ModelSpec(path=tiny_model)) == width
    spec = EngineSpec(zero_stage=3, precision="fp32", micro_batch_size=1, grad_accum_steps=1, persist_numel=width)
    assert build_ds_config(spec, 2, 1.0)["zero_optimization"]["stage3_param_persistence_threshold"] == width
    user = {"zero_optimization": {"stage3_param_persistence_threshold": 10**5}}
    mine = EngineSpec(zero_stage=3, precision="fp32", micro_batch_size=1, grad_accum_steps=1, user_config=user)
    assert build_ds_config(mine, 2, 1.0)["zero_optimization"]["stage3_param_persistence_threshold"] == 10**5
