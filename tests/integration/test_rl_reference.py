"""One RL step on real Ray actors against the same step written out by hand in plain PyTorch.

The run: the RL driver's own stages (``RLTrainer.annotate`` -> ``advantages`` -> ``update``) on real worker groups:
policy on 2 ranks with 4 micro-batches of accumulation each, a reference group (2 ranks) for the KL terms, a critic
group (``critic.num_workers=2``) for GAE; one optimizer step per RL step (``train.global_batch_size`` = the rollout
batch). Every case runs twice: with the reference group, and (``held``) with the frozen copy of the reference each
policy rank holds in its own process instead (``colocate.reference_in_policy``), sharded as the group's. Cases:
GRPO with ``seq-mean-token-mean`` and with ``token-mean`` (KL loss term k3 / k2, an entropy bonus), GRPO with
CISPO's loss and with SAPO's, REINFORCE++ with a k2 KL penalty in the reward and discounting, GAE-PPO with its
critic (k1 KL in the reward, ``seq-mean-token-sum``); each in float64 on ZeRO 0 and in fp32 on ZeRO 2 (policy) /
3 (reference, critic). The rollout is fixed instead of sampled by vLLM (an engine start costs ~45 s and adds nothing
to the maths checked here): responses of varied length sampled from the tiny model in this process, and fixed
scores.

The reference: a single process, float64, one unpadded forward per sample, every formula transcribed in
``rl_reference_math.py`` (no ``rlhf`` code): old / reference log-probs, values, the estimator's advantages, the
clipped policy loss with its aggregation and KL loss term, the clipped value loss, backward, the global gradient
norm, DeepSpeed's clipping and one AdamW step. Compared: the logged ``loss``, ``policy_loss``, ``kl``,
``entropy``, ``reward_kl_penalty``, ``value_loss``, ``grad_norm`` and ``critic_grad_norm``, and every updated weight
of the policy and the critic.

Start-up dominates (three groups of two actors each): the actors start once for the file, are built once per
layout, their initial DeepSpeed checkpoints saved, and every case starts by loading them (weights, Adam state and
schedule back at step 0).

Also here: dual clip and TIS on the PPO objective against the same formulas, on and off (no actors).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time

import pytest
import rl_reference_math as ref
import torch

N_PROMPTS, N_SAMPLES = 4, 4  # 16 samples: one optimizer step, 2 ranks x 4 micro-batches of 2
MICRO, RANKS = 2, 2
PROMPTS = ["3+4=", "12+19=", "7+25=", "20+2="]
SCORES = [
    0.1,
    0.9,
    0.4,
    0.4,  # a group with a tie
    1.0,
    1.0,
    1.0,
    1.0,  # all equal: no GRPO signal
    0.0,
    1.0,
    0.0,
    0.0,
    0.3,
    0.7,
    0.2,
    0.95,
]
TEMPERATURE = 0.8
TRAIN = {"lr": 1e-3, "adam_betas": (0.9, 0.95), "adam_eps": 1e-8, "weight_decay": 0.1, "max_grad_norm": 0.3}
CRITIC_LR = 5e-4
VALUE_CLIP = 0.2

CASES = {
    "grpo-seq-mean-token-mean": [
        "algo.advantage_estimator=grpo",
        "algo.loss_agg_mode=seq-mean-token-mean",
        "algo.kl_coef=0.05",
        "algo.kl_mode=loss",
        "algo.kl_estimator=k3",
    ],
    "grpo-token-mean": [
        "algo.advantage_estimator=grpo",
        "algo.loss_agg_mode=token-mean",
        "algo.kl_coef=0.1",
        "algo.kl_mode=loss",
        "algo.kl_estimator=k2",
        "algo.entropy_coef=0.01",
    ],
    "grpo-cispo": [  # CISPO's loss value is a weighted log-prob: the logged policy_loss tells it from PPO's
        "algo.advantage_estimator=grpo",
        "algo.policy_loss=cispo",
        "algo.loss_agg_mode=token-mean",
        "algo.kl_coef=0.05",
        "algo.kl_mode=loss",
        "algo.kl_estimator=k3",
    ],
    "grpo-sapo": [  # SAPO's soft gate, its negative temperature set: the logged policy_loss is -(4 / tau) A / 2
        "algo.advantage_estimator=grpo",
        "algo.policy_loss=sapo",
        "algo.gate_tau_neg=1.5",
        "algo.loss_agg_mode=seq-mean-token-mean",
        "algo.kl_coef=0.05",
        "algo.kl_mode=loss",
        "algo.kl_estimator=k3",
    ],
    "reinforce_pp-kl-in-reward": [
        "algo.advantage_estimator=reinforce_pp",
        "algo.loss_agg_mode=token-mean",
        "algo.kl_coef=0.05",
        "algo.kl_mode=reward",
        "algo.kl_estimator=k2",
        "algo.gamma=0.9",
    ],
    "gae-ppo-critic": [
        "algo.advantage_estimator=gae",
        "algo.loss_agg_mode=seq-mean-token-sum",
        "algo.kl_coef=0.02",
        "algo.kl_mode=reward",
        "algo.kl_estimator=k1",
        "algo.gamma=0.99",
        "algo.lam=0.95",
    ],
}

# Every case runs twice: the reference in a group of its own, and held in the policy's processes.
WHERE = ("group", "held")

# Two builds of the same groups (the actors start once): float64 on ZeRO 0 (strategy.precision=fp64 trains on
# ZeRO 0 only), for the tightest comparison, then fp32 with the sharded stages (ZeRO-3 last: a ZeRO-3 engine is
# never followed by a rebuild), padding-free and in micro-batches of at most 25 tokens (rows of 6-12 tokens, 8 a
# rank: one rank runs 3 micro-batches, the other 4, a lockstep filler keeps ZeRO-3 in step; the test checks it).
LAYOUTS = {
    "fp64-zero0": {"precision": "fp64", "policy": 0, "reference": 0, "critic": 0},
    "fp32-zero2-zero3-packed-tok25": {
        "precision": "fp32",
        "policy": 2,
        "reference": 3,
        "critic": 3,
        "overrides": ("train.packing=true", "train.max_tokens_per_micro_batch=25"),
    },
}

# Tolerances against the float64 reference (each case prints its figures).
# fp64: both sides compute in float64 (with transformers' own float32 steps, the rotary cos/sin and RMSNorm's
# normalisation, identical on both), so they differ by float64 rounding in different orders: <= 5e-16 relative seen
# on every loss and grad norm, <= 3.5e-12 lr on the weights; required: 1e-10 (1e-14 absolute for the losses that are
# ~0: GRPO's per-sequence mean and whitened REINFORCE++ advantages average to 0 at ratio 1), and per weight 1e-10
# of the step plus a gradient error of 1e-13 of the norm through Adam.
# fp32: the run computes in fp32 (forwards over micro-batches padded differently, sums over 2 ranks), ~1e-7
# relative per operation; up to 3.6e-6 seen on a loss, 1.3e-7 on a grad norm; required 1e-5 (1e-7 absolute), which
# still catches any wrong factor, normalizer or token. Weights: each element allowed 1e-4 of the step plus what a
# gradient error of 1e-7 of the norm (fp32 rounding) becomes through Adam's g / (|g| + eps): up to 1.2e-2 lr and
# 0.44 of that allowance seen (on RMSNorm weights, whose gradient is the smallest relative to its rounding).
# rl_reference_math.weight_agreement explains the allowance.
TOL = {
    "fp32": {"rel": 1e-5, "abs": 1e-7, "update_rtol": 1e-4, "grad_rtol": 1e-7},
    "fp64": {"rel": 1e-10, "abs": 1e-14, "update_rtol": 1e-10, "grad_rtol": 1e-13},
}


# ------------------------------------------------------------------------------------------------ fixtures
@dataclasses.dataclass(frozen=True)
class Sampled:
    prompt_ids: tuple
    response_ids: tuple
    response_logps: tuple
    finish_reason: str = "length"


def _load(path, kind="causal"):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    # sdpa, as the workers run on CPU: transformers' eager attention takes its softmax in float32 (not float64),
    # and that rounding depends on the padded width.
    cls = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    return cls.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def paths(tiny_model, tiny_reward_model, tmp_path_factory):
    """Policy = the tiny model; reference = a perturbed copy (so that the KL and its gradient are not 0 at the
    first step); critic = the tiny model with a seeded scalar head."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path_factory.mktemp("rl_reference") / "reference_model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return {"policy": tiny_model, "reference": out, "critic": tiny_reward_model}


@pytest.fixture(scope="module")
def rollout(paths):
    """16 generations (4 prompts x 4 samples) sampled from the policy at ``TEMPERATURE``, lengths 1..7."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["policy"])
    model = _load(paths["policy"])
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(5)
    samples = []
    with torch.no_grad():
        for text in PROMPTS:
            prompt = tuple(tokenizer(text)["input_ids"])
            for _ in range(N_SAMPLES):
                ids, logps = list(prompt), []
                for _ in range(rng.randint(1, 7)):
                    z = model(input_ids=torch.tensor([ids])).logits[0, -1] / TEMPERATURE
                    log_p = z - torch.logsumexp(z, -1)
                    tok = int(torch.multinomial(log_p.exp(), 1, generator=gen))
                    ids.append(tok)
                    logps.append(float(log_p[tok]))
                    if tok == tokenizer.eos_token_id:
                        break
                samples.append(Sampled(prompt, tuple(ids[len(prompt) :]), tuple(logps)))
    groups = [i for i in range(N_PROMPTS) for _ in range(N_SAMPLES)]
    assert len({len(s.response_ids) for s in samples}) >= 4  # lengths differ: the aggregation modes differ
    return {
        "samples": samples,
        "groups": groups,
        "scores": torch.tensor(SCORES, dtype=torch.float32),
        "tokenizer": tokenizer,
    }


def _config(layout, *overrides):
    from rlhf.config.loader import load_config
    from rlhf.config.rl_schema import RLRunConfig

    t = TRAIN
    return load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            "model.path=unused-here",
            "data.train_path=unused-here",
            f"rollout.prompts_per_step={N_PROMPTS}",
            f"rollout.n_samples_per_prompt={N_SAMPLES}",
            f"rollout.temperature={TEMPERATURE}",
            "rollout.max_prompt_length=16",  # the prompts are ~8 tokens: the token budget of 25 holds a row
            f"train.global_batch_size={N_PROMPTS * N_SAMPLES}",
            f"train.micro_batch_size={MICRO}",
            f"train.num_workers={RANKS}",
            f"critic.num_workers={RANKS}",
            f"train.lr={t['lr']}",
            f"train.adam_betas=[{t['adam_betas'][0]}, {t['adam_betas'][1]}]",
            f"train.adam_eps={t['adam_eps']}",
            f"train.weight_decay={t['weight_decay']}",
            f"train.max_grad_norm={t['max_grad_norm']}",
            "train.lr_scheduler=constant",
            "train.warmup_steps=0",
            f"critic.lr={CRITIC_LR}",
            f"critic.value_clip={VALUE_CLIP}",
            f"strategy.precision={LAYOUTS[layout]['precision']}",
            f"strategy.zero_stage={LAYOUTS[layout]['policy']}",
            "logging.tensorboard=false",
            *LAYOUTS[layout].get("overrides", ()),
            *overrides,
        ],
    )


class Groups:
    """Policy, reference and critic, 2 ranks each, started once; :meth:`use` (re)builds them for a layout as
    ``rlhf.trainers.online.roles.start_roles`` builds them (the three in parallel) and saves the trainable ones'
    initial states as DeepSpeed checkpoints, which every case loads first (weights, Adam state and schedule back at
    step 0)."""

    def __init__(self, ctx, paths, directory):
        self.ctx, self.paths, self.directory = ctx, paths, directory
        self.roles = {role: ctx.make_group(role, RANKS) for role in ("policy", "reference", "critic")}
        self.layout = None

    def use(self, layout: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
        from rlhf.trainers.context import optim_spec

        if layout == self.layout:
            return
        started = time.perf_counter()
        spec = LAYOUTS[layout]
        cfg = _config(layout, f"critic.path={self.paths['critic']}")
        t, ctx = cfg.train, self.ctx
        ctx.cfg = cfg  # the layout's batching (packing, token budget) for model_spec / engine_spec

        def model(role, kind):
            return dataclasses.replace(ctx.model_spec(self.paths[role], kind), precision=spec["precision"])

        def engine(role, trainable=True):  # as the runner builds them (RANKS ranks for every role)
            return dataclasses.replace(
                ctx.engine_spec(RANKS, trainable), precision=spec["precision"], zero_stage=spec[role]
            )

        builds = {
            "policy": (model("policy", CAUSAL_LM), engine("policy"), optim_spec(t, 1)),
            "reference": (model("reference", CAUSAL_LM), engine("reference", trainable=False), None),
            "critic": (
                model("critic", SCALAR_HEAD),
                engine("critic"),
                dataclasses.replace(optim_spec(t, 1), lr=cfg.critic.lr),
            ),
        }
        with ThreadPoolExecutor(len(builds)) as pool:
            for done in [pool.submit(self.roles[role].build, *args) for role, args in builds.items()]:
                done.result()
        # the same reference, also held by the policy's ranks (the held cases), as the reference group shards it:
        # on fp32's layout a frozen ZeRO-3 engine beside the policy's ZeRO-2 training engine, in one process
        self.roles["policy"].hold("reference", *builds["reference"][:2])
        for role in ("policy", "critic"):
            self.roles[role].save_checkpoint(self.initial(role, layout))
        self.layout = layout
        print(f"[rl-reference] {layout}: built in {time.perf_counter() - started:.1f} s")

    def initial(self, role: str, layout: str = "") -> str:
        return str(self.directory / (layout or self.layout) / role)

    def __getitem__(self, role: str):
        return self.roles[role]


@pytest.fixture(scope="module")
def actors(ray_session, paths, tmp_path_factory):
    from rlhf.trainers.context import RunContext

    started = time.perf_counter()
    cfg = _config("fp32-zero2-zero3-packed-tok25")
    ctx = RunContext(cfg=cfg, precision="fp32", backend="gloo", gpus_per_worker=0.0)
    groups = Groups(ctx, paths, tmp_path_factory.mktemp("rl_reference_initial"))
    print(f"[rl-reference] 3 groups x {RANKS} ranks started in {time.perf_counter() - started:.1f} s")
    yield groups
    ctx.shutdown()


@pytest.fixture(scope="module")
def initial_models(paths):
    return {
        "policy": _load(paths["policy"]),
        "reference": _load(paths["reference"]),
        "critic": _load(paths["critic"], kind="scalar"),
    }


# ------------------------------------------------------------------------------------------------ the run
def _run_step(cfg, actors, rollout, tmp_path, held: bool = False):
    """The driver's stages on the real groups, from the initial checkpoint; returns (logged stats, weights).
    ``held``: the policy's ranks score the reference they hold, no reference group."""
    from safetensors.torch import load_file

    from rlhf.rl import rollout_batch
    from rlhf.trainers.online.runner import build_objectives
    from rlhf.trainers.online.steps import RLActors, RLTrainer

    a = cfg.algo
    actors["policy"].load_checkpoint(actors.initial("policy"))
    if a.needs_critic:
        actors["critic"].load_checkpoint(actors.initial("critic"))
    roles = RLActors(
        policy=actors["policy"],
        engines=None,
        reference=actors["reference"] if a.kl_coef > 0 and not held else None,  # else the copy the policy holds
        critic=actors["critic"] if a.needs_critic else None,
    )
    policy_objective, value_objective = build_objectives(cfg)
    trainer = RLTrainer(cfg, rollout["tokenizer"], None, None, roles, None, policy_objective, value_objective)
    tokenizer = rollout["tokenizer"]
    batch = rollout_batch(rollout["samples"], tokenizer.pad_token_id)
    batch = trainer.annotate(batch)
    batch, kl_stats = trainer.advantages(batch, rollout["scores"], rollout["groups"])
    stats = {**trainer.update(batch, 1), **kl_stats}
    # the held reference's passes are its own (perf/reference/...), not the policy's scoring passes
    perf = actors["policy"].perf_metrics()
    assert ("perf/reference/forward_tokens_per_s" in perf) is held, perf
    weights = {}
    for role in ("policy", "critic") if a.needs_critic else ("policy",):
        out = tmp_path / role
        actors[role].save_pretrained(str(out))
        weights[role] = load_file(str(out / "model.safetensors"))
    return stats, weights


# ------------------------------------------------------------------------------------------------ the reference
def _reference_step(cfg, models, rollout):
    """The same RL step in float64, by hand (rl_reference_math)."""
    a, t = cfg.algo, cfg.train
    samples = [(s.prompt_ids, s.response_ids) for s in rollout["samples"]]
    scores = [float(s) for s in rollout["scores"]]
    lengths = [len(r) for _, r in samples]
    out = {}
    with torch.no_grad():
        old, _ = ref.logps_and_entropy(models["policy"], samples, TEMPERATURE)
        ref_logps = ref.logps_and_entropy(models["reference"], samples, TEMPERATURE)[0] if a.kl_coef > 0 else None
        old_values = ref.values(models["critic"], samples) if a.needs_critic else None
    in_reward = a.kl_mode == "reward" and a.kl_coef > 0
    penalty = (
        [ref.kl(a.kl_estimator, o, r) for o, r in zip(old, ref_logps)]
        if in_reward
        else [torch.zeros(n, dtype=torch.float64) for n in lengths]
    )
    if in_reward:
        out["reward_kl_penalty"] = float(a.kl_coef * torch.cat(penalty).sum() / sum(lengths))
    rewards = ref.token_rewards(scores, penalty, a.kl_coef if in_reward else 0.0)
    if a.advantage_estimator == "grpo":
        advantages = ref.group_advantages("grpo", scores, rollout["groups"], lengths)
    elif a.advantage_estimator == "reinforce_pp":
        advantages = ref.whiten_all(ref.discounted_returns(rewards, a.gamma))
    elif a.advantage_estimator == "gae":
        advantages, returns = ref.gae(rewards, old_values, a.gamma, a.lam)
    else:
        raise AssertionError(a.advantage_estimator)

    policy = copy.deepcopy(models["policy"]).train()
    logps, entropy = ref.logps_and_entropy(policy, samples, TEMPERATURE)
    pg, total, kls = [], [], []
    for lp, o, adv, h, i in zip(logps, old, advantages, entropy, range(len(samples))):
        loss = ref.policy_token_loss(a.policy_loss, lp, o, adv, a.clip or a.gate_taus)
        pg.append(loss)
        per_token = loss - a.entropy_coef * h
        if ref_logps is not None:
            kls.append(ref.kl(a.kl_estimator, lp, ref_logps[i]))
            if a.kl_mode == "loss":
                per_token = per_token + a.kl_coef * kls[-1]
        total.append(per_token)
    mode = a.loss_agg_mode
    loss = ref.aggregate(mode, total)
    loss.backward()
    out.update(
        loss=loss.item(),
        policy_loss=ref.aggregate(mode, pg).item(),
        entropy=ref.aggregate(mode, [h.detach() for h in entropy]).item(),
    )
    if kls:
        out["kl"] = ref.aggregate(mode, [k.detach() for k in kls]).item()
    adam = dict(betas=t.adam_betas, eps=t.adam_eps, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm)
    out["grad_norm"] = ref.clipped_adamw_first_step(policy, lr=t.lr, **adam)
    weights = {"policy": (policy, out["grad_norm"], t.lr)}
    if a.needs_critic:
        critic = copy.deepcopy(models["critic"]).train()
        v = ref.values(critic, samples)
        value_loss = ref.aggregate(
            mode,
            [ref.value_token_loss(vi, oi, ri, cfg.critic.value_clip) for vi, oi, ri in zip(v, old_values, returns)],
        )
        value_loss.backward()
        out["value_loss"] = value_loss.item()
        out["critic_grad_norm"] = ref.clipped_adamw_first_step(critic, lr=cfg.critic.lr, **adam)
        weights["critic"] = (critic, out["critic_grad_norm"], cfg.critic.lr)
    return out, weights


def _decay_alone(run: dict, model, initial: dict, lr: float, weight_decay: float):
    """The 2-D weights whose reference gradient is exactly 0 (embedding rows of tokens the batch does not hold) move
    by AdamW's decoupled decay alone, ``-lr wd w``: the first such parameter and the run's error there, relative to
    the decay."""
    for name, param in model.named_parameters():
        zero = param.grad == 0
        if param.ndim < 2 or not bool(zero.any()):
            continue
        before = initial[name].detach()[zero]
        want = -lr * weight_decay * before
        got = run[name].double()[zero] - before
        return name, float((got - want).abs().max() / want.abs().max())
    raise AssertionError("no weight without gradient: the decay is not checked on its own")


# ------------------------------------------------------------------------------------------------ the test
@pytest.mark.parametrize(
    "layout, case, reference",
    [(layout, case, where) for layout in LAYOUTS for where in WHERE for case in CASES],
)
def test_one_rl_step_equals_plain_pytorch(layout, case, reference, actors, initial_models, rollout, paths, tmp_path):
    actors.use(layout)
    cfg = _config(layout, f"model.ref_path={paths['reference']}", f"critic.path={paths['critic']}", *CASES[case])
    started = time.perf_counter()
    stats, run_weights = _run_step(cfg, actors, rollout, tmp_path, held=reference == "held")
    run_s = time.perf_counter() - started
    want, ref_weights = _reference_step(cfg, initial_models, rollout)
    tol = TOL[LAYOUTS[layout]["precision"]]

    assert stats["lr"] == cfg.train.lr and stats.get("critic_lr", CRITIC_LR) == CRITIC_LR
    assert stats["num_tokens"] == sum(len(s.response_ids) for s in rollout["samples"])
    report = []
    for key, value in want.items():
        diff = abs(stats[key] - value)
        report.append(
            f"{key} {stats[key]:.9g} vs {value:.9g} (rel {diff / max(abs(value), 1e-300):.1e}, abs {diff:.1e})"
        )
        assert stats[key] == pytest.approx(value, rel=tol["rel"], abs=tol["abs"]), (case, key, stats[key], value)
    assert want["grad_norm"] > cfg.train.max_grad_norm  # the clipping binds: it is part of what is checked
    if cfg.train.max_tokens_per_micro_batch:  # the ranks ran different numbers of micro-batches (the hard case)
        assert stats["fillers"] > 0 and stats.get("critic_fillers", 1) > 0, (stats["micro_batches"], stats["fillers"])

    for role, (model, norm, lr) in ref_weights.items():
        initial = dict(initial_models[role].named_parameters())
        moved = max(float((p.detach() - initial[name].detach()).abs().max()) for name, p in model.named_parameters())
        worst_lr, ratio, where = ref.weight_agreement(
            run_weights[role],
            model,
            lr=lr,
            eps=cfg.train.adam_eps,
            norm=norm,
            max_grad_norm=cfg.train.max_grad_norm,
            update_rtol=tol["update_rtol"],
            grad_rtol=tol["grad_rtol"],
        )
        report.append(
            f"{role} weights: max |run - ref| = {worst_lr:.1e} lr, {ratio:.2g} of the allowance ({where}; "
            f"the step moved them up to {moved / lr:.2f} lr)"
        )
        assert moved > 0.5 * lr, (role, moved)
        name, decay_error = _decay_alone(run_weights[role], model, initial, lr, cfg.train.weight_decay)
        assert decay_error < 1e-3, (
            f"{layout} {case}: {role}'s {name} (ZeRO-{LAYOUTS[layout][role]}): the weights "
            f"whose gradient is 0 did not move by AdamW's decay -lr wd w alone (off by "
            f"{decay_error:.2g} of it)"
        )
        assert ratio <= 1.0, (layout, case, role, where, ratio, worst_lr)
    print(f"[rl-reference {layout} {case} {reference}] run {run_s:.1f} s; " + "; ".join(report))


# ------------------------------------------------------------------------------------------------ dual clip, TIS
def _on_columns(per_token, samples, width: int) -> torch.Tensor:
    """Ragged per-response-token values -> ``(B, width)`` float64 with token ``j`` of sample ``i`` at column
    ``len(prompt_i) + j`` (rlhf.batch's convention: column t belongs to token t), 0 elsewhere."""
    out = torch.zeros(len(samples), width, dtype=torch.float64)
    for i, ((prompt, response), values) in enumerate(zip(samples, per_token)):
        out[i, len(prompt) : len(prompt) + len(response)] = values
    return out


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_dual_clip_and_tis_change_the_update_as_written(rollout, initial_models):
    """The PPO objective with dual clip and/or TIS on a real model (float64, in this process): its loss, gradient and
    reported ``dual_clip_frac`` / ``tis_weight`` / ``tis_capped_frac`` equal the formulas written out by hand, and
    turning either correction off changes the loss and the gradient.

    pi_old is moved away from the current policy (log-ratios ~ N(0, 0.5^2): ratios up to ~e^1.5) and the engine's
    log-probs away from pi_old (the same spread), with advantages of both signs, so both corrections bind on a
    sizeable share of the tokens (an RL step on the tiny model has ratios and mismatches too close to 1 for that:
    tests/integration/test_rl_algorithms.py only shows them binding in a run)."""
    from rlhf.objectives.actor_critic import PolicyObjective
    from rlhf.ops.policy_loss import PolicyLossConfig
    from rlhf.rl import rollout_batch

    model = copy.deepcopy(initial_models["policy"]).train()
    samples = [(s.prompt_ids, s.response_ids) for s in rollout["samples"]]
    n_tokens = sum(len(r) for _, r in samples)
    gen = torch.Generator().manual_seed(17)
    noise = lambda n: torch.randn(n, generator=gen, dtype=torch.float64)  # noqa: E731
    with torch.no_grad():
        now, _ = ref.logps_and_entropy(model, samples, TEMPERATURE)
    old = [lp + 0.5 * noise(len(lp)) for lp in now]
    engine = [o + 0.5 * noise(len(o)) for o in old]
    advantages = [noise(len(lp)) for lp in now]
    batch = rollout_batch(rollout["samples"], rollout["tokenizer"].pad_token_id)
    width = batch.input_ids.shape[1]
    batch = batch.replace(
        old_logps=_on_columns(old, samples, width),
        rollout_logps=_on_columns(engine, samples, width),
        advantages=_on_columns(advantages, samples, width),
    )
    mode = "token-mean"

    def project(dual, cap):
        objective = PolicyObjective(
            clip=PolicyLossConfig(dual_clip=dual, tis_cap=cap),
            agg_mode=mode,
            temperature=TEMPERATURE,
            correct_off_policy=cap is not None,
        )
        model.zero_grad()
        total, sums = objective.loss(model, batch)
        count = objective.count(batch)
        (total / count).backward()
        return objective.finalize(sums, count), _flat_grad(model)

    def written(dual, cap):
        model.zero_grad()
        logps, _ = ref.logps_and_entropy(model, samples, TEMPERATURE)
        losses, dual_clipped, weights, capped = [], 0.0, [], 0.0
        for lp, o, e, adv in zip(logps, old, engine, advantages):
            weight = None
            if cap is not None:
                raw = torch.exp(o - e)
                capped += float((raw > cap).sum())
                weight = torch.clamp(raw, max=cap)
                weights.append(weight)
            loss, bound = ref.ppo_token_loss(lp, o, adv, 0.2, 0.2, dual_clip=dual or 0.0, tis_weight=weight)
            losses.append(loss)
            dual_clipped += float(bound["dual_clipped"].sum())
        loss = ref.aggregate(mode, losses)
        loss.backward()
        metrics = {"loss": loss.item()}
        if dual is not None:
            metrics["dual_clip_frac"] = dual_clipped / n_tokens
        if cap is not None:
            metrics.update(tis_weight=float(torch.cat(weights).sum()) / n_tokens, tis_capped_frac=capped / n_tokens)
        return metrics, _flat_grad(model)

    settings = {"off": (None, None), "dual clip": (1.25, None), "TIS": (None, 1.2), "both": (1.25, 1.2)}
    grads = {}
    for name, (dual, cap) in settings.items():
        got, got_grad = project(dual, cap)
        want, want_grad = written(dual, cap)
        # both float64: rounding only (a padded batch against one unpadded forward per sample)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (name, key, got[key], value)
        assert float((got_grad - want_grad).norm()) <= 1e-12 * float(want_grad.norm()), name
        for key in ("dual_clip_frac", "tis_capped_frac"):
            if key in want:
                assert 0.05 < got[key] < 0.95, (name, key, got[key])  # binds on some tokens, not on all
        grads[name] = (got["loss"], want_grad)
    off_loss, off_grad = grads["off"]
    for name in ("dual clip", "TIS", "both"):
        loss, grad = grads[name]
        change = float((grad - off_grad).norm() / off_grad.norm())
        print(f"[dual clip / TIS] {name}: loss {loss:.6g} (off: {off_loss:.6g}), gradient changed by {change:.1%}")
        assert abs(loss - off_loss) > 1e-3 * abs(off_loss) and change > 0.02, (name, loss, off_loss, change)
