"""Sequence parallelism inside the accumulation contract, on real Ray ranks and DeepSpeed engines (CPU, gloo, fp64).

Four worker groups train the same global batches from the same weights in float64, each cut differently:

* ``whole``: one rank, the global batch as one padded micro-batch (the reference);
* ``sp2``: two ranks sharing every row (sequence parallel 2), two micro-batches of accumulation, padded, with
  activation checkpointing (each layer's forward, all-to-alls included, runs again in the backward) and the LM head
  in token tiles (``model.tiled_head``: the per-position log-probs of a shard from its hidden states);
* ``sp4-packed``: four ranks sharing every row, four micro-batches, packed, the LM head in tiles;
* ``sp2-dp2-budget``: four ranks as two sequence groups of two, cut by a token budget, packed (zero-weight fillers
  keep the groups in lockstep).

Every group takes the same steps: two SFT steps, a DPO step (reference log-probs in the batch), an RL step
whose objective has every sequence-level term the issue names: GSPO's sequence ratio, a seq-mean aggregation,
the entropy bonus and the KL loss (PPO's old log-probs scored by each group itself, compared first), and an
on-policy distillation step (PPO with the k2 reverse KL to another model's log-probs as a loss, token-mean); the
other model is also held by each group's ranks (``colocate.teacher_in_policy``) and scored. Then every
group is rebuilt with a scalar head and takes a reward-model step (scores at each row's last token, which lies on
one rank of a group) and a critic step (per-token values against returns, value clipping around each group's own
scored values). Each step's loss and grad norm, and the causal LM's final weights, must agree with ``whole`` to
float64 rounding.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from precision_helpers import in_parallel
from shared_helpers import uneven_pair_batch, uneven_sft_batch

from rlhf.batch import Batch
from rlhf.distributed.engine import EngineSpec, OptimSpec

pytestmark = pytest.mark.usefixtures("ray_session")

GLOBAL_BATCH = 8
BUDGET = 40  # tokens per rank: a sequence group of 2 holds micro-batches of up to 80
# name: (ranks, sequence_parallel_size, micro-batch rows or 0 for the token budget, packing)
LAYOUTS = {
    "whole": (1, 1, 8, False),
    "sp2": (2, 2, 4, False),
    "sp4-packed": (4, 4, 2, True),
    "sp2-dp2-budget": (4, 2, 0, True),
}
# float64 summation order (micro-batch shapes, the all-to-all's head split, the packed vs padded kernels): the
# differences seen are ~1e-15 relative; the bound
FP64_RTOL = 1e-10


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A tiny model whose 4 query heads and 2 key/value heads split over 2 and 4 ranks (4: replicated KV heads)."""
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("sp") / "tiny4"), seed=3, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
    """A distillation teacher: the same architecture and tokenizer, other weights."""
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("sp") / "teacher"), seed=4, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def batches(model_path, teacher_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.objectives.actor_critic import TokenLogps
    from rlhf.objectives.dpo import ReferenceLogps

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sft = uneven_sft_batch(tokenizer, GLOBAL_BATCH, seed=21)
    pairs = uneven_pair_batch(tokenizer, GLOBAL_BATCH, seed=22)
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    with torch.no_grad():
        pairs = pairs.replace(ref_logps=ReferenceLogps()(reference, pairs))
        ref_logps = TokenLogps()(reference, sft)
        teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float64).eval()
        teacher_logps = TokenLogps()(teacher, sft)
    advantage = torch.randn(GLOBAL_BATCH, 1, generator=torch.Generator().manual_seed(23), dtype=torch.float64)
    rl = Batch(
        input_ids=sft.input_ids,
        attention_mask=sft.attention_mask,
        loss_mask=sft.loss_mask,
        advantages=advantage * sft.attention_mask.double(),  # the objective masks the response itself
        ref_logps=ref_logps,
        teacher_logps=teacher_logps,
    )
    return {"sft": sft, "dpo": pairs, "rl": rl}


def _spec(ranks: int, sp: int, micro: int, packing: bool) -> EngineSpec:
    if not micro:
        return EngineSpec.for_token_budget(
            GLOBAL_BATCH,
            BUDGET,
            ranks // sp,
            zero_stage=0,
            precision="fp64",
            packing=packing,
            sequence_parallel_size=sp,
        )
    return EngineSpec.for_global_batch(
        GLOBAL_BATCH, micro, ranks // sp, zero_stage=0, precision="fp64", packing=packing, sequence_parallel_size=sp
    )


# name: the model's memory options (model.gradient_checkpointing, model.tiled_head)
MEMORY = {"sp2": (True, True), "sp4-packed": (False, True)}


def _build(group, model_path: str, kind: str, name: str) -> None:
    from rlhf.models.loading import ModelSpec

    ranks, sp, micro, packing = LAYOUTS[name]
    checkpointing, tiled = MEMORY.get(name, (False, False))
    group.build(
        # packing: the variable-length attention, which runs padded forwards too (the objective picks)
        ModelSpec(
            path=model_path,
            kind=kind,
            precision="fp64",
            packing=True,
            seed=5,
            gradient_checkpointing=checkpointing,
            tiled_head=tiled,
        ),
        _spec(ranks, sp, micro, packing),
        OptimSpec(lr=1e-3, total_steps=5, scheduler="constant", betas=(0.9, 0.99)),
    )


def _hold_teacher(group, path: str, name: str) -> None:
    """``group``'s ranks load the frozen model at ``path`` beside their own, with the layout's memory options."""
    from rlhf.models.loading import CAUSAL_LM, ModelSpec

    ranks, sp, micro, packing = LAYOUTS[name]
    _, tiled = MEMORY.get(name, (False, False))
    model = ModelSpec(path=path, kind=CAUSAL_LM, precision="fp64", packing=True, seed=5, tiled_head=tiled)
    group.hold("teacher", model, _spec(ranks, sp, micro, packing))


@contextlib.contextmanager
def _started_groups(model_path):
    """name -> (WorkerGroup, packing), built side by side with the causal LM; shut down on exit, so that the CLI
    tests below find the session's CPUs free."""
    from rlhf.distributed.cluster import actor_env
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.models.loading import CAUSAL_LM

    def start(name):
        ranks, _, _, packing = LAYOUTS[name]
        group = WorkerGroup("policy", GroupResources(ranks, cpus_per_worker=0.5, env_vars=actor_env(0)), "gloo")
        _build(group, model_path, CAUSAL_LM, name)
        return group, packing

    started = in_parallel({name: (lambda n=name: start(n)) for name in LAYOUTS})
    try:
        yield started
    finally:
        for group, _ in started.values():
            group.shutdown()


@pytest.fixture(scope="module")
def trained(batches, tmp_path_factory, model_path, teacher_path):
    """Every group's steps in lockstep -> ``{"rows": name -> [step metrics], "old_logps": name -> (B, T),
    "values": name -> (B, T), "dirs": name -> the causal LM's saved weights, "zero": stage -> name -> [step
    results]}``; the groups are gone after. ``zero``: then ``whole`` (one rank) and ``sp2`` (a sequence group of
    two) are rebuilt on ZeRO 2, then 3 (last: a ZeRO-3 engine is never followed by a rebuild), in fp32, and take
    two SFT steps each, for the ZeRO stages' own collectives."""
    with _started_groups(model_path) as groups:
        trained = _train_in_lockstep(groups, batches, tmp_path_factory, model_path, teacher_path)
        pair = {name: groups[name][0] for name in ("whole", "sp2")}
        trained["zero"] = {stage: _zero_steps(pair, model_path, batches, stage) for stage in (2, 3)}
        return trained


def _train_in_lockstep(groups, batches, tmp_path_factory, model_path, teacher_path) -> dict:
    from rlhf.models.loading import SCALAR_HEAD
    from rlhf.objectives.actor_critic import PolicyObjective, TeacherTopK, TokenLogps, TokenValues, ValueObjective
    from rlhf.objectives.dpo import DPOObjective
    from rlhf.objectives.reward import RewardObjective
    from rlhf.objectives.sft import SFTObjective
    from rlhf.ops.policy_loss import PolicyLossConfig

    rows: dict = {name: [] for name in groups}

    def step_all(make_objective, batch):
        at = len(rows["whole"])  # the lockstep's step: every group's LR position
        done = in_parallel(
            {
                name: (lambda g=g, p=p: g.train_batch(batch, make_objective(p), schedule_step=at))
                for name, (g, p) in groups.items()
            }
        )
        for name, result in done.items():
            rows[name].append(result)

    step_all(lambda p: SFTObjective(packing=p), batches["sft"])
    step_all(lambda p: SFTObjective(packing=p), batches["sft"])
    step_all(lambda p: DPOObjective(beta=0.1, packing=p), batches["dpo"])
    old_logps = in_parallel(
        {
            name: (lambda g=g, p=p: g.score_batch(batches["rl"], TokenLogps(packing=p)))
            for name, (g, p) in groups.items()
        }
    )
    # the distillation teacher, held by each group's ranks (colocate.teacher_in_policy): loaded into the policy's
    # processes, sharded over the same sequence groups, and scored there, on the sampled tokens and as GKD's top-k
    in_parallel({name: (lambda g=g, n=name: _hold_teacher(g, teacher_path, n)) for name, (g, _) in groups.items()})
    held = in_parallel(
        {
            name: (lambda g=g, p=p: g.score_batch(batches["rl"], TokenLogps(packing=p), on="teacher"))
            for name, (g, p) in groups.items()
        }
    )
    held_topk = in_parallel(
        {
            name: (lambda g=g, p=p: g.score_batch(batches["rl"], TeacherTopK(4, packing=p), on="teacher"))
            for name, (g, p) in groups.items()
        }
    )
    rl = batches["rl"].replace(old_logps=old_logps["whole"])
    step_all(
        lambda p: PolicyObjective(
            loss_type="gspo",
            clip=PolicyLossConfig(clip_low=3e-4, clip_high=4e-4),
            agg_mode="seq-mean-token-mean",
            entropy_coef=0.01,
            kl_loss_coef=0.05,
            packing=p,
        ),
        rl,
    )
    step_all(lambda p: PolicyObjective(agg_mode="token-mean", distill_coef=0.5, distill_estimator="k2", packing=p), rl)
    root = tmp_path_factory.mktemp("sp-weights")
    dirs = {name: str(root / name) for name in groups}
    in_parallel({name: (lambda g=g, d=dirs[name]: g.save_pretrained(d)) for name, (g, _) in groups.items()})

    in_parallel({name: (lambda g=g, n=name: _build(g, model_path, SCALAR_HEAD, n)) for name, (g, _) in groups.items()})
    step_all(lambda p: RewardObjective(packing=p), batches["dpo"])
    values = in_parallel(
        {
            name: (lambda g=g, p=p: g.score_batch(batches["rl"], TokenValues(packing=p)))
            for name, (g, p) in groups.items()
        }
    )
    returns = torch.randn(rl.input_ids.shape, generator=torch.Generator().manual_seed(24), dtype=torch.float64)
    critic = rl.replace(values=values["whole"], returns=returns * rl.attention_mask)
    step_all(lambda p: ValueObjective(clip=0.05, packing=p), critic)
    return {
        "rows": rows,
        "old_logps": old_logps,
        "values": values,
        "held_logps": held,
        "held_topk": held_topk,
        "dirs": dirs,
    }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "whole"])
def test_every_step_logs_the_loss_and_grad_norm_of_the_unsharded_batch(trained, name):
    whole, sharded = trained["rows"]["whole"], trained["rows"][name]
    assert len(whole) == len(sharded) == 7  # SFT, SFT, DPO, GSPO, distillation; reward model, critic
    assert whole[4].metrics["distill"] > 1e-3  # the teacher is another model
    for step, (ref, got) in enumerate(zip(whole, sharded), start=1):
        assert got.normalizer == ref.normalizer and got.num_samples == ref.num_samples == GLOBAL_BATCH
        assert ref.grad_norm is not None and ref.grad_norm > 1e-3  # a real gradient, not two vanishing ones
        assert set(got.metrics) == set(ref.metrics)
        for key in ref.metrics:  # loss, kl, entropy, clip fractions, scores, values ...
            print(f"[{name} step {step}] {key}: whole {ref.metrics[key]:.17g} sharded {got.metrics[key]:.17g}")
            assert _rel(got.metrics[key], ref.metrics[key]) <= FP64_RTOL or abs(got.metrics[key]) < 1e-14, key
        assert _rel(got.grad_norm, ref.grad_norm) <= FP64_RTOL, (step, got.grad_norm, ref.grad_norm)
    assert whole[1].metrics["loss"] < whole[0].metrics["loss"]  # the SFT steps trained


def test_the_token_budget_layout_ran_several_micro_batches_and_fillers(trained):
    budget = trained["rows"]["sp2-dp2-budget"]
    assert all(step.micro_batches is not None and step.micro_batches >= 2 for step in budget)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "whole"])
@pytest.mark.parametrize("scored", ["old_logps", "values"])
def test_sharded_scoring_gives_the_unsharded_log_probs_and_values(trained, batches, name, scored):
    mask = batches["rl"].attention_mask.bool()
    if scored == "old_logps":
        mask[:, 0] = False  # column 0 predicts nothing
    ref, got = trained[scored]["whole"], trained[scored][name]
    assert ref.dtype == got.dtype == torch.float64 and ref.shape == got.shape
    assert (got[mask] - ref[mask]).abs().max() <= FP64_RTOL * ref[mask].abs().max()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_model_held_by_the_ranks_scores_as_it_does_unsharded(trained, batches, name):
    """``colocate.teacher_in_policy`` (and ``reference_in_policy``, the same code) under sequence parallelism,
    packing, tiles, a token budget: the teacher held in each group's processes gives the log-probs transformers
    computes from it in one process, and GKD's top-k of the unsharded layout."""
    from rlhf.objectives.actor_critic import split_teacher_topk

    mask = batches["rl"].attention_mask.bool()
    mask[:, 0] = False  # column 0 predicts nothing
    want, got = batches["rl"].teacher_logps, trained["held_logps"][name]
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert (got[mask] - want[mask]).abs().max() <= FP64_RTOL * want[mask].abs().max()
    # not the policy's own log-probs: another model's, and the policy's would match its old_logps
    assert (got[mask] - trained["old_logps"][name][mask]).abs().max() > 1e-3
    (top, ids), (whole_top, whole_ids) = (split_teacher_topk(trained["held_topk"][n]) for n in (name, "whole"))
    assert top.shape == (*want.shape, 4) and torch.equal(ids[mask], whole_ids[mask])
    assert (top[mask] - whole_top[mask]).abs().max() <= FP64_RTOL * whole_top[mask].abs().max()
    assert bool((top[mask][:, 0] >= want[mask] - 1e-12).all())  # the likeliest token's, at least the sampled one's


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "whole"])
def test_the_weights_after_every_step_are_the_unsharded_ones(trained, name):
    from safetensors.torch import load_file

    def weights(directory):
        return load_file(os.path.join(directory, "model.safetensors"))

    ref, got = weights(trained["dirs"]["whole"]), weights(trained["dirs"][name])
    assert set(ref) == set(got)
    for key in ref:
        assert ref[key].dtype == torch.float64
        diff = (ref[key] - got[key]).norm() / max(ref[key].norm().item(), 1e-300)
        assert diff <= FP64_RTOL, (key, float(diff))


# ------------------------------------------------------------------------------------------- through the CLI


def _sft_config(tmp_path, model: str, data: str, extra: str = "") -> str:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"defaults: [sft_tiny]\nmodel:\n  path: {model}\ndata:\n  train_path: {data}\n"
        f"train:\n  global_batch_size: 8\n  micro_batch_size: 2\n  num_workers: 1\n  packing: true\n"
        f"  output_dir: {tmp_path / 'outputs' / 'sft'}\nstrategy:\n  sequence_parallel_size: 2\n{extra}"
    )
    return str(path)


def test_the_audit_compares_the_sharded_run_with_the_unsharded_one(model_path, sft_data, tmp_path, capsys, monkeypatch):
    """``rlhf.cli.audit`` of a sequence-parallel SFT config in float64: the configured split (rows shared by 2
    ranks), the same split unsharded, and micro-batch 1 sharded, through the CLI's own runs."""
    from shared_helpers import run_main

    (tmp_path / "outputs").mkdir()
    argv = ["--config", _sft_config(tmp_path, model_path, sft_data), "--steps", "2", "--precision", "fp64"]
    rc, out, err = run_main("rlhf.cli.audit", argv, tmp_path, capsys, monkeypatch)
    assert rc == 0, out + err
    assert "2x4x1xsp2 (the configured split), 2x4x1 (sp 1), 1x8x1xsp2 (micro 1)" in out, out
    assert out.rstrip().splitlines()[-1].startswith("VERDICT: contract kept: 3 factorisations agree on 2 step(s)")


def test_dry_run_tells_the_sequence_groups_and_the_ranks_they_start(
    model_path, sft_data, tmp_path, capsys, monkeypatch
):
    from shared_helpers import run_main

    rc, out, err = run_main(
        "rlhf.cli.train_sft",
        ["--config", _sft_config(tmp_path, model_path, sft_data), "--dry-run"],
        tmp_path,
        capsys,
        monkeypatch,
    )
    assert rc == 0, out + err
    assert "sequence parallel 2: each data-parallel rank is 2 ranks sharing every row" in out
    assert "policy  2 ranks" in out and "policy: 2 bundles" in out  # 1 data-parallel rank x 2
    assert "ZeRO-1 on the one-rank" not in out  # the group has 2 ranks: ZeRO-2 partitions over them


@pytest.mark.parametrize(
    "size, why",
    [
        (3, "the model's 4 attention heads do not divide by 3"),
        (8, "the model's 4 attention heads do not divide by 8"),
    ],
)
def test_a_size_the_heads_do_not_divide_is_refused_by_key_before_ray_starts(
    model_path, sft_data, tmp_path, capsys, monkeypatch, size, why
):
    from shared_helpers import run_main

    import rlhf.trainers.context as context

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was joined before the refusal")

    monkeypatch.setattr(context, "init_ray", no_ray)
    argv = ["--config", _sft_config(tmp_path, model_path, sft_data), f"strategy.sequence_parallel_size={size}"]
    rc, out, err = run_main("rlhf.cli.train_sft", argv, tmp_path, capsys, monkeypatch)
    assert rc == 2, out + err
    assert f"strategy.sequence_parallel_size={size}: {why}" in out + err


def test_grpo_with_gspo_through_vllm_keeps_the_contract_at_sp_2_and_1(
    model_path, rl_prompts, rl_shaping, tmp_path, capsys, monkeypatch
):
    """The online path whole: vLLM rollouts, the weight sync from a sharded policy, old and reference log-probs
    scored sharded, GSPO's sequence ratio under a seq-mean aggregation; the audit's runs (sequence parallel 2 as
    configured, and 1) in float64 must agree at every step and in the final weights. (Sequence parallel 4 takes the
    same GSPO step in the lockstep groups above; through vLLM it adds 80 s and no other code.)"""
    from shared_helpers import run_main

    argv = [
        "--trainer",
        "ppo",
        "--config",
        "grpo_tiny",
        "--steps",
        "2",
        "--precision",
        "fp64",
        "--factorizations",
        "8x2x1",
        f"model.path={model_path}",
        f"data.train_path={rl_prompts}",
        f"reward.functions=[rlhf.synthetic.arithmetic:reward,{rl_shaping}]",
        "strategy.sequence_parallel_size=2",
        "strategy.cpus_per_worker=0.5",  # 2 policy and 2 reference ranks beside the engine, on the session's CPUs
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
        "train.warmup_steps=0",  # step 1 trains too
        "train.lr=1e-4",
        "algo.policy_loss=gspo",
        "algo.loss_agg_mode=seq-mean-token-mean",
    ]
    rc, out, err = run_main("rlhf.cli.audit", argv, tmp_path, capsys, monkeypatch)
    assert rc == 0, out + err
    assert "8x2x1xsp2 (the configured split), 8x2x1 (chosen)" in out, out
    rows = [line.split() for line in out.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [r[1] for r in rows] == ["1.0000e-04", "1.0000e-04"] and all(r[-1] == "ok" for r in rows)
    assert out.rstrip().splitlines()[-1].startswith("VERDICT: contract kept: 2 factorisations agree on 2 step(s)")


# ------------------------------------------------------------------------------------------- ZeRO 2 and 3

FP32_RTOL = 1e-5  # float32 rounding of differently shaped matmuls and reductions; measured below 1e-6


def _zero_steps(pair, model_path, batches, stage: int) -> dict:
    """``pair``'s groups rebuilt on ZeRO ``stage`` (fp32, the unsharded global batch's micro-batch of 4, each
    group's own sequence-parallel size) -> name -> the results of two SFT steps."""
    from rlhf.models.loading import ModelSpec
    from rlhf.objectives.sft import SFTObjective

    def build(group, sp):
        group.build(
            ModelSpec(path=model_path, packing=True, seed=5),
            EngineSpec.for_global_batch(GLOBAL_BATCH, 4, 1, zero_stage=stage, packing=True, sequence_parallel_size=sp),
            OptimSpec(lr=1e-3, total_steps=2, scheduler="constant"),
        )

    in_parallel({name: (lambda g=g: build(g, g.size)) for name, g in pair.items()})
    steps: dict = {name: [] for name in pair}
    for step in range(2):
        done = in_parallel(
            {name: (lambda g=g, at=step: g.train_batch(batches["sft"], SFTObjective(), at)) for name, g in pair.items()}
        )
        for name, result in done.items():
            steps[name].append(result)
    return steps


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_steps_match_under_zero_2_and_3(trained, stage):
    """ZeRO 3 gathers every parameter inside the forward (on all ranks) between the sequence group's all-to-alls;
    ZeRO 2 reduce-scatters the gradients over every rank: both keep the unsharded step's numbers."""
    steps = trained["zero"][stage]
    for ref, got in zip(steps["whole"], steps["sp2"]):
        assert _rel(got.metrics["loss"], ref.metrics["loss"]) <= FP32_RTOL
        assert _rel(got.grad_norm, ref.grad_norm) <= FP32_RTOL
    assert steps["whole"][1].metrics["loss"] < steps["whole"][0].metrics["loss"]
