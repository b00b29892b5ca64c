"""``colocate.trainer_sleep`` (rlhf.distributed.sleep): a sleeping trainer rank's weights, gradients, optimizer states
and held frozen models wait in host memory, every device storage of them emptied; woken (explicitly, or by the next
method that needs them) it trains and scores exactly as a rank that never slept. Per optimizer the project builds on
one rank: fp32 ZeRO 0 (torch's AdamW), fp32 ZeRO 1 (DeepSpeedZeroOptimizer), bf16 ZeRO 1 (BF16_Optimizer with the
flat gradients of rlhf.distributed.flat_grads), and built as asked a real ZeRO 2 (its gradient buckets and partitions:
several ranks' default) and ZeRO 3 (partitions, a frozen ZeRO-3 engine for the held model). The engines run in a
subprocess with its own one-rank gloo group. A LoRA policy (its frozen base beside the adapters, Adam's states for the
adapters alone) sleeps and wakes the same way, its reference scored on that base with the adapters off.

``colocate.offload_frozen`` / ``dpo.ref_offload`` on the same rank (``TrainerWorker.sleep_held``): the held reference
alone waits in host memory while the rank trains, and wakes to the same bits when it next scores."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import tiny_rl_config
from shared_helpers import random_sft_step, subprocess_fixture

from rlhf.distributed.sleep import HostCopies, device_storages, state_tensors

STEPS, ROWS, MICRO = 2, 4, 2
# (precision, stage asked, built as asked, LoRA): a one-rank group builds ZeRO 1 for 2 and 3 (effective_zero_stage);
# a real ZeRO 2 (the default of several ranks: gradient buckets and partitions) and a real ZeRO 3 with the mapping off
CASES = [
    ("fp32", 0, False, False),
    ("fp32", 2, False, False),
    ("bf16", 2, False, False),
    ("fp32", 2, True, False),
    ("fp32", 3, True, False),
    ("bf16", 2, True, True),
]
MODES = ("awake", "rank", "held")
# the held model's kinds: a plain frozen module (held beside ZeRO 0-2 alike), a frozen ZeRO-3 engine, beside LoRA
HELD_CASES = [("fp32", 0, False, False), ("fp32", 3, True, False), ("bf16", 2, True, True)]


def _logits_sum(model: torch.nn.Module, batch) -> torch.Tensor:
    """A score function: each row's logits summed, float64 (every weight of the model shows in it)."""
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double().sum((1, 2))


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _run(model_path: str, precision: str, stage: int, lora: bool, mode: str) -> dict:
    """Train ``STEPS`` steps on one rank that holds a reference, then score; ``mode``: ``awake`` throughout,
    ``rank`` sleeping whole between the steps (colocate.trainer_sleep), ``held`` with its reference asleep while it
    trains (colocate.offload_frozen), woken by each score on it."""
    from rlhf.batch import Batch
    from rlhf.distributed.engine import EngineSpec, OptimSpec, iter_full_state
    from rlhf.distributed.worker import TrainerWorker
    from rlhf.models.loading import ModelSpec
    from rlhf.models.lora import LoraSpec, OnBaseModel

    spec = EngineSpec(zero_stage=stage, precision=precision, micro_batch_size=MICRO, grad_accum_steps=ROWS // MICRO)
    worker = TrainerWorker(f"{precision} zero {stage}", 0, 1)
    adapters = LoraSpec(r=4) if lora else None
    policy = ModelSpec(path=model_path, precision=precision, lora=adapters)
    worker.build(policy, spec, OptimSpec(lr=1e-3, total_steps=STEPS))
    frozen = EngineSpec(zero_stage=stage, precision=precision, micro_batch_size=MICRO, grad_accum_steps=1)
    worker.hold("reference", ModelSpec(path=model_path, precision=precision), frozen)
    gen, trace, out = torch.Generator().manual_seed(0), [], {}
    fixed = torch.arange(16).reshape(2, 8) + 4  # a batch the held reference scores between steps (gen untouched)
    probe = Batch(input_ids=fixed, attention_mask=torch.ones_like(fixed), loss_mask=torch.ones_like(fixed))
    held = [getattr(p, "ds_tensor", p) for p in worker.held["reference"].parameters()]
    trained = [getattr(p, "ds_tensor", p) for p in worker.model.parameters()]
    out["held_bytes"] = sum(t.numel() * t.element_size() for t in held)
    for step in range(STEPS):
        if mode == "held":
            # scoring on it wakes it (after step 1): the state the next offload moves is the woken one
            out.setdefault("probes", []).append(worker.score([probe], _logits_sum, on="reference")[0])
            out.setdefault("offloaded", []).append(worker.sleep_held(["reference"]))
            out.setdefault("again", []).append(worker.sleep_held(["reference"]))  # asleep already: nothing
            out.setdefault("held_left", []).append(_storage_bytes(held))
            if step == 1:  # the whole rank asleep and woken: the held model stays asleep until it scores
                worker.sleep()
                worker.wake()
        if mode == "rank" and step:  # after step 1, when Adam's states exist
            slept = worker.sleep()
            if step == 1:  # what the sleep left on the "device" (here the CPU), read through references of our own
                optimizer = worker.engine.optimizer
                inner = getattr(optimizer, "optimizer", optimizer)
                states = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
                out["slept"] = slept
                out["left"] = _storage_bytes(trained) + _storage_bytes(held) + _storage_bytes(states)
                out["states"] = len(states)
                out["again"] = worker.sleep()  # already asleep: nothing more to move
                worker.wake()  # explicitly here; then by train_step, and last by score
                out["woken"] = _storage_bytes(trained) + _storage_bytes(held) + _storage_bytes(states)
                out["trained_bytes"] = sum(t.numel() * t.element_size() for t in trained)
                out["trainable_bytes"] = sum(
                    t.numel() * t.element_size() for t, p in zip(trained, worker.model.parameters()) if p.requires_grad
                )
                worker.sleep()
        result, _ = random_sft_step(worker, gen, ROWS, MICRO)
        trace.append((result.grad_norm, result.sums["loss_sum"]))
        if mode == "held":  # trained with the reference asleep, which the step did not wake
            out.setdefault("held_left_trained", []).append(_storage_bytes(held))
            out.setdefault("trained_left", []).append(_storage_bytes(trained))
    ids = torch.randint(4, 500, (2, 8), generator=gen)
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
    if mode == "rank":
        worker.sleep()  # score wakes it
    out["held_scores"] = worker.score([batch], _logits_sum, on="reference")[0]
    out["scores"] = worker.score([batch], _logits_sum)[0]
    if lora:  # the reference on the policy's own frozen base, as a LoRA run without another model.ref_path scores it
        out["base_scores"] = worker.score([batch], OnBaseModel(_logits_sum))[0]
    out["trace"] = trace
    out["weights"] = {n: t.clone() for n, t in iter_full_state(worker.model, worker.zero_stage)}
    out["optimizer"] = type(worker.engine.optimizer).__name__
    out["stage"] = worker.zero_stage
    return out


def _train(model_path: str, out_path: str, port: int) -> None:
    """In the subprocess: each case in each mode (:func:`_run`)."""
    import rlhf.distributed.engine as engine_module
    from rlhf.distributed.worker import TrainerWorker

    TrainerWorker("probe", 0, 1).init_process_group("127.0.0.1", port, "gloo", timeout_s=60)
    mapped = engine_module.effective_zero_stage
    results = {}
    for precision, stage, real, lora in CASES:
        # a real one-rank ZeRO 3 (the mapping switched off for it): partitions and a frozen ZeRO-3 engine
        engine_module.effective_zero_stage = (lambda s, *_: s) if real else mapped
        for mode in MODES if (precision, stage, real, lora) in HELD_CASES else MODES[:2]:
            results[precision, stage, real, lora, mode] = _run(model_path, precision, stage, lora, mode)
    torch.save(results, out_path)


trained = subprocess_fixture(__file__)


@pytest.mark.parametrize(
    "precision,stage,real,lora", CASES, ids=[f"{p}-zero{s}{'-real' * r}{'-lora' * a}" for p, s, r, a in CASES]
)
def test_a_sleeping_rank_empties_its_storages_and_wakes_to_the_same_bits(trained, precision, stage, real, lora):
    awake, slept = trained[precision, stage, real, lora, "awake"], trained[precision, stage, real, lora, "rank"]
    built = stage if real else min(stage, 1)
    assert slept["optimizer"] == awake["optimizer"] and slept["stage"] == awake["stage"] == built
    # asleep: the trained weights, the held model's and the optimizer's states hold no byte on the device
    assert slept["states"] >= 2 and slept["left"] == 0 and slept["again"] == 0
    # what moved: at least the weights, Adam's two moments of the trainable ones (as large as their float32 masters:
    # with LoRA the adapters alone) and the held weights
    assert (slept["trainable_bytes"] < slept["trained_bytes"]) == lora  # LoRA: a frozen base beside the adapters
    assert slept["slept"] >= slept["trained_bytes"] + 2 * slept["trainable_bytes"] + slept["held_bytes"]
    assert slept["woken"] >= slept["trained_bytes"] + slept["held_bytes"]
    # woken: the same steps, weights and scores to the bit
    assert slept["trace"] == awake["trace"]
    assert slept["weights"].keys() == awake["weights"].keys()
    for name, weight in awake["weights"].items():
        assert torch.equal(slept["weights"][name], weight), name
    assert torch.equal(slept["scores"], awake["scores"]) and torch.equal(slept["held_scores"], awake["held_scores"])
    if lora:  # the adapters trained away from the base, and the base woke as it was
        assert torch.equal(slept["base_scores"], awake["base_scores"])
        assert not torch.equal(awake["base_scores"], awake["scores"])
        assert torch.equal(awake["base_scores"], awake["held_scores"])  # the held reference is that same base


@pytest.mark.parametrize(
    "precision,stage,real,lora",
    HELD_CASES,
    ids=[f"{p}-zero{s}{'-real' * r}{'-lora' * a}" for p, s, r, a in HELD_CASES],
)
def test_an_offloaded_held_model_stays_asleep_while_the_rank_trains_and_scores_the_same(
    trained, precision, stage, real, lora
):
    """``colocate.offload_frozen`` on a rank that holds its reference: asleep, the held model has no byte on the
    device through the training step, a whole-rank sleep and wake, and an optimizer step; scoring on it wakes it to
    the same bits, and the trained model, never asleep, trains the same steps to the same weights."""
    awake, held = trained[precision, stage, real, lora, "awake"], trained[precision, stage, real, lora, "held"]
    # each offload moved at least the held weights, and again nothing
    assert all(moved >= held["held_bytes"] > 0 for moved in held["offloaded"]) and held["again"] == [0] * STEPS
    assert held["held_left"] == held["held_left_trained"] == [0] * STEPS
    assert all(left > 0 for left in held["trained_left"])  # the trained model stayed on its device
    assert held["trace"] == awake["trace"]
    for name, weight in awake["weights"].items():
        assert torch.equal(held["weights"][name], weight), name
    assert torch.equal(held["scores"], awake["scores"]) and torch.equal(held["held_scores"], awake["held_scores"])
    # the frozen reference scores the same fixed rows after each wake as before its first offload
    first, *woken = held["probes"]
    assert len(woken) == STEPS - 1 and all(torch.equal(p, first) for p in woken)


def test_storages_are_found_through_views_dicts_and_bound_methods_once_each():
    flat = torch.arange(12.0)
    views = [flat[:4], flat[4:]]  # one storage

    class Helper:  # outside _WALKED: not walked by itself
        def __init__(self):
            self.kept = torch.ones(3)

        def method(self):
            return self.kept

    layer = torch.nn.Linear(2, 2)
    layer.weight.grad = torch.zeros(2, 2)
    roots = [{"views": views, layer.weight: {"exp_avg": torch.zeros(5)}}, layer, Helper()]
    found = device_storages(state_tensors(roots), torch.device("cpu"))
    # flat's storage once, the weight, its grad, the bias, exp_avg; the helper's tensor is not reached
    assert sorted(s.nbytes() for s in found) == sorted([48, 16, 16, 8, 20])
    # a bound method leads to its object, walked only if of a package in _WALKED
    assert len(device_storages(state_tensors([Helper().method]), torch.device("cpu"))) == 0
    numpy_backed = torch.from_numpy(__import__("numpy").zeros(4))  # not resizable: left in place
    assert device_storages([numpy_backed], torch.device("cpu")) == []


def test_host_copies_restore_every_view_with_its_bytes():
    flat = torch.randn(10, dtype=torch.float64)
    view, before = flat[3:7], flat.clone()
    copies = HostCopies.offload(device_storages([view], torch.device("cpu")))
    assert copies.nbytes == 80 and flat.untyped_storage().nbytes() == 0
    copies.restore()
    assert torch.equal(flat, before) and torch.equal(view, before[3:7]) and view.data_ptr() == flat.data_ptr() + 24


@pytest.mark.parametrize(
    "asked,hybrid,gpus,colocated,want",
    [
        ("auto", True, 1.0, (), ("policy",)),  # the hybrid engine's GPU default
        ("auto", True, 1.0, ("policy_reference",), ("policy", "reference")),
        ("auto", True, 0.0, (), ()),  # CPU: nothing to hand over unless asked for
        ("on", True, 0.0, ("policy_teacher",), ("policy", "teacher")),  # the CPU twin, as the tests run it
        ("off", True, 1.0, (), ()),
        ("auto", False, 1.0, ("policy_reference",), ()),  # no engine on the policy's devices
    ],
)
def test_which_roles_sleep(asked, hybrid, gpus, colocated, want):
    from rlhf.config.rl_schema import ColocateConfig
    from rlhf.distributed.resource_plan import sleeping_roles

    colocate = ColocateConfig(trainer_sleep=asked, hybrid_engine=hybrid, **{key: True for key in colocated})
    assert sleeping_roles(colocate, gpus) == want


def test_trainer_sleep_on_needs_the_hybrid_engine_naming_the_key(tiny_model, rl_prompts):
    from rlhf.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"colocate.trainer_sleep must be auto or off without colocate.hybrid_engine"):
        tiny_rl_config(tiny_model, rl_prompts, "colocate.trainer_sleep=on")
    with pytest.raises(ConfigError, match="colocate.trainer_sleep must be one of auto, on, off"):
        tiny_rl_config(tiny_model, rl_prompts, "colocate.trainer_sleep=yes")


def test_the_dry_run_says_who_sleeps(tiny_model, rl_prompts):
    from rlhf.distributed.resource_plan import Devices, rl_plan
    from rlhf.trainers.online.checks import describe

    hybrid = ("colocate.hybrid_engine=true", "rollout.num_engines=2", "train.num_workers=2", "algo.kl_coef=0.01")
    for extra, want in (
        (("colocate.trainer_sleep=on", "colocate.policy_reference=true"),
         "trainer sleep: policy, reference in host memory while the engines generate (colocate.trainer_sleep=on)"),
        (("colocate.trainer_sleep=auto",), "trainer sleep: off (colocate.trainer_sleep=auto)"),  # auto on CPUs
        ((), "trainer sleep: off (colocate.trainer_sleep=off)"),  # the default
    ):  # fmt: skip
        cfg = tiny_rl_config(tiny_model, rl_prompts, *hybrid, *extra)
        lines = describe(cfg, rl_plan(cfg, 0.0, reference=True), Devices(0.0, "fp32", "gloo"))
        assert f"  {want}" in lines, lines


TEACHER_AND_RM = ("algo.teacher.path=/teacher", "algo.teacher.mode=loss", "reward.model_path=/rm")


@pytest.mark.parametrize(
    "asked,gpus,extra,want",
    [
        ("auto", 1.0, ("colocate.reference_in_policy=true",), ("reference",)),  # held: shares the policy's device
        ("auto", 1.0, ("colocate.policy_reference=true",), ("reference",)),  # on the policy's bundles
        ("auto", 1.0, (), ()),  # a reference group on devices of its own: nothing to free for a trained model
        ("auto", 0.0, ("colocate.reference_in_policy=true",), ()),  # CPU: only when asked for
        ("on", 0.0, (), ("reference",)),  # the CPU twin, as the tests run it
        ("on", 0.0, TEACHER_AND_RM, ("reference", "teacher", "reward_model")),
        ("auto", 1.0, (*TEACHER_AND_RM, "colocate.teacher_in_policy=true"), ("teacher",)),
        ("on", 0.0, ("algo.kl_coef=0", *TEACHER_AND_RM), ("teacher", "reward_model")),
        ("on", 0.0, ("model.lora.r=4", "reward.model_path=/rm"), ("reward_model",)),  # LoRA's reference: its base
        ("off", 1.0, ("colocate.reference_in_policy=true", *TEACHER_AND_RM), ()),
    ],
)
def test_which_frozen_models_offload(tiny_model, rl_prompts, asked, gpus, extra, want):
    from rlhf.distributed.resource_plan import offloaded_roles

    cfg = tiny_rl_config(tiny_model, rl_prompts, f"colocate.offload_frozen={asked}", *extra)
    assert offloaded_roles(cfg, gpus) == want


def test_frozen_offload_on_needs_a_frozen_model_naming_the_key(tiny_model, rl_prompts):
    from rlhf.config.schema import ConfigError

    for extra in (("algo.kl_coef=0",), ("model.lora.r=4",)):  # no KL term; LoRA's reference is the trained base
        with pytest.raises(ConfigError, match=r"^colocate.offload_frozen is on, but the run has no frozen model"):
            tiny_rl_config(tiny_model, rl_prompts, "colocate.offload_frozen=on", *extra)
    with pytest.raises(ConfigError, match="colocate.offload_frozen must be one of auto, on, off"):
        tiny_rl_config(tiny_model, rl_prompts, "colocate.offload_frozen=true")
    # auto with nothing to offload is no error: it resolves to none
    assert tiny_rl_config(tiny_model, rl_prompts, "colocate.offload_frozen=auto", "algo.kl_coef=0").frozen_models == ()


def test_the_dry_run_says_what_is_offloaded(tiny_model, rl_prompts):
    from rlhf.distributed.resource_plan import Devices, rl_plan
    from rlhf.trainers.online.checks import describe

    for extra, want in (
        (("colocate.offload_frozen=on", "reward.model_path=/rm"),
         "frozen offload: reference, reward_model in host memory between their passes (colocate.offload_frozen=on)"),
        (("colocate.offload_frozen=auto", "colocate.reference_in_policy=true"),
         "frozen offload: off (colocate.offload_frozen=auto)"),  # auto on CPUs
        ((), "frozen offload: off (colocate.offload_frozen=off)"),  # the default
    ):  # fmt: skip
        cfg = tiny_rl_config(tiny_model, rl_prompts, *extra)
        lines = describe(cfg, rl_plan(cfg, 0.0, reference=True), Devices(0.0, "fp32", "gloo"))
        assert f"  {want}" in lines, lines
