"""``train_ppo(cfg)``: the PPO family (PPO, GRPO, Dr. GRPO, RLOO, REINFORCE++; ``python -m rlhf.cli.train_ppo``):
validate, read the prompts (:mod:`~rlhf.trainers.online.prompts`), start the roles
(:mod:`~rlhf.trainers.online.roles`), run the :class:`~rlhf.trainers.online.steps.RLTrainer`'s steps in a
:class:`~rlhf.trainers.run.Run`, save ``final/``. :data:`PPO` is the trainer's descriptor."""

from __future__ import annotations

from typing import Dict, List, Tuple

from rlhf.config.rl_schema import RLRunConfig
from rlhf.data.plan import EpochPlan
from rlhf.data.vocab import load_tokenizer
from rlhf.distributed.resource_plan import (
    JUDGE,
    REWARD_POOL,
    offloaded_roles,
    rl_plan,
    sleeping_roles,
)
from rlhf.hub import RUN_MODEL_KEYS, pin_run_sources
from rlhf.models.loading import SCALAR_HEAD
from rlhf.objectives.actor_critic import PolicyObjective, ValueObjective
from rlhf.ops.policy_loss import PolicyLossConfig
from rlhf.rewards.functions import RewardFunctionScorer
from rlhf.rollout.sources import observation_format
from rlhf.trainers.checkpoint import Checkpointable
from rlhf.trainers.descriptor import TrainerKind
from rlhf.trainers.online import checks
from rlhf.trainers.online.prompts import check_reward_columns, read_data, read_prompt_sets, row_fields
from rlhf.trainers.online.roles import (
    connect_weight_sync,
    rl_actors,
    rollout_source,
    start_roles,
    write_placement,
)
from rlhf.trainers.online.scoring import scored_rewards
from rlhf.trainers.online.steps import RLTrainer
from rlhf.trainers.output_dir import claim_output_dir
from rlhf.trainers.preflight import preflight
from rlhf.trainers.run import Run, RunResult, run_identity, with_restarts
from rlhf.utils.log import get_logger
from rlhf.utils.versions import check_versions

log = get_logger(__name__)


def build_objectives(cfg: RLRunConfig) -> Tuple[PolicyObjective, ValueObjective]:
    """The run's policy and value objectives from ``algo.*`` (the clip, the off-policy correction, the loss
    aggregation and its length constant, the KL as a loss) and the sampling the trainer's log-probs replay."""
    a = cfg.algo
    clip_range = {} if a.clip is None else dict(zip(("clip_low", "clip_high"), a.clip))
    gate = {} if a.gate_taus is None else dict(zip(("gate_tau_pos", "gate_tau_neg"), a.gate_taus))
    clip = PolicyLossConfig(
        **clip_range,
        **gate,
        dual_clip=a.dual_clip or None,
        tis_cap=a.tis_cap or None,
        off_policy=a.behaviour_correction,
    )
    length = cfg.max_response_tokens  # the constant of a per-length aggregation (Dr. GRPO's budget)
    policy = PolicyObjective(
        loss_type=a.policy_loss,
        clip=clip,
        agg_mode=a.aggregation,
        agg_length=length,
        temperature=cfg.rollout.temperature,
        sampling_filter=cfg.rollout.sampling_filter,
        entropy_coef=a.entropy_coef,
        kl_loss_coef=a.kl_coef if a.kl_mode == "loss" else 0.0,
        kl_estimator=a.kl_estimator,
        correct_off_policy=clip.correction is not None,
        distill_coef=a.teacher.coef_in("loss"),
        distill_estimator=a.teacher.resolved_estimator,
        distill_divergence=a.teacher.divergence,
        distill_beta=a.teacher.beta,
    )
    value = ValueObjective(clip=cfg.critic.value_clip or None, agg_mode=a.aggregation, agg_length=length)
    return policy, value


def _identity(cfg: RLRunConfig, plan: EpochPlan) -> dict:
    """What an RL checkpoint must share with the run that resumes it."""
    r = cfg.rollout
    return {
        **run_identity(cfg, plan),
        "rollout.prompts_per_step": r.prompts_per_step,
        "rollout.n_samples_per_prompt": r.n_samples_per_prompt,
        "algo.ppo_epochs": cfg.algo.ppo_epochs,
        "critic.num_workers": cfg.critic.num_workers if cfg.algo.needs_critic else 0,
        **({"algo.teacher.path": cfg.algo.teacher.path} if cfg.algo.teacher.path else {}),
        **({"env.spec": cfg.env.spec, "rollout.max_turns": r.max_turns} if cfg.multi_turn else {}),
        **({"rollout.max_staleness": r.max_staleness} if r.max_staleness else {}),
    }


def train_ppo(cfg: RLRunConfig) -> RunResult:
    """Online RL of the PPO family end to end (see the module docstring); ``train.on_failure=restart`` restarts
    from checkpoints."""
    # hub ids -> org/name@<sha>: config.yaml and every actor get the pins
    return with_restarts(pin_run_sources(claim_output_dir(cfg, PPO.run_name), PPO.model_keys), _train_ppo_once)


def _train_ppo_once(cfg: RLRunConfig) -> RunResult:
    check_versions(PPO.packages)
    preflight(cfg, PPO)
    tokenizer = load_tokenizer(cfg)
    r, t = cfg.rollout, cfg.train
    prompts, eval_prompts = read_prompt_sets(cfg, tokenizer)
    plan = EpochPlan(
        num_samples=len(prompts.prompt_ids),
        global_batch_size=r.prompts_per_step,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        seed=t.seed,
    )
    scorer = RewardFunctionScorer(tuple(cfg.reward.functions)) if cfg.reward.functions else None
    if scorer is not None:
        scorer.load()  # a bad spec fails here, before any actor starts
        check_reward_columns(cfg, scorer, prompts, eval_prompts)
    optimizer_steps = plan.total_steps * cfg.optimizer_steps_per_rl_step
    log.info(
        f"[rl] {len(prompts.prompt_ids)} prompts ({prompts.skipped} skipped, {prompts.truncated} truncated), "
        f"{plan.total_steps} RL steps x {r.samples_per_step} samples, {optimizer_steps} optimizer steps; "
        f"{cfg.algo.advantage_estimator} / {cfg.algo.policy_loss} / {cfg.algo.describe_aggregation()}; "
        f"{cfg.algo.describe_clip()}"
    )
    log.info(f"[rl] {cfg.describe_schedule()}")
    if cfg.algo.teacher.path:
        log.info(f"[rl] {checks.describe_distillation(cfg)}")
    if cfg.multi_turn:
        e = cfg.env
        log.info(
            f"[rl] episodes of {e.spec} on {e.num_actors} actor(s): up to {r.max_turns} turns and "
            f"{r.max_episode_tokens} tokens (rollout.episode_limit={r.episode_limit}), observations as "
            f"{observation_format(r.observation_format, prompts.chat is not None)}; a sample is an episode"
        )
        longest = r.max_prompt_length + r.max_turns * r.max_new_tokens  # before any observation token
        if longest > r.max_episode_tokens:
            log.info(
                f"[rl] note: a longest prompt and {r.max_turns} full responses take {longest} tokens, more than "
                f"rollout.max_episode_tokens={r.max_episode_tokens}: long episodes will end at the token budget "
                f"(episode/ended_token_budget)"
            )
    run = Run(cfg, PPO, plan, _identity(cfg, plan))
    # CPUs do not depend on the GPUs per worker, which are known only once the cluster is joined.
    with run.cluster(needed_cpus=PPO.plan(cfg, 0.0).needed_cpus) as ctx:
        held = PPO.reference_held(cfg)
        started = start_roles(cfg, ctx, PPO.plan(cfg, ctx.gpus_per_worker), optimizer_steps, reference_held=held)
        actors = rl_actors(
            started,
            reference_is_base=PPO.reference_on_base(cfg),
            sleepers=sleeping_roles(cfg.colocate, ctx.gpus_per_worker),
            offloaded=offloaded_roles(cfg, ctx.gpus_per_worker),
        )
        connect_weight_sync(cfg, ctx, actors)
        write_placement(started, t.output_dir)
        policy_objective, value_objective = build_objectives(cfg)
        source = rollout_source(cfg, ctx, started, prompts, tokenizer)
        scorers = scored_rewards(cfg, scorer, started.get(REWARD_POOL), started.get(JUDGE))
        trainer = RLTrainer(
            cfg,
            tokenizer,
            prompts,
            plan,
            actors,
            scorers,
            policy_objective,
            value_objective,
            eval_prompts=eval_prompts,
            source=source,
        )
        trained: Dict[str, Checkpointable] = {"policy": actors.policy}
        if actors.critic is not None:
            trained["critic"] = actors.critic
        if r.max_staleness:  # the samples generated ahead are part of the run's state: a resume trains on them
            trained["rollouts"] = trainer.schedule
        last = run.train(trainer, trained)
        return run.finish(actors.policy, tokenizer, last)


def _critic(cfg: RLRunConfig) -> List[Tuple[str, str]]:
    """The critic, trained beside the policy (and wrapped by LoRA with it) when the algorithm has one."""
    return [(cfg.critic.path or cfg.model.path, SCALAR_HEAD)] if cfg.algo.needs_critic else []


#: Online RL's descriptor (rlhf.trainers.descriptor), listed in rlhf.trainers.kinds; its hooks are
#: rlhf.trainers.online.checks'.
PPO = TrainerKind(
    name="ppo",
    run_name="rl",
    config_cls=RLRunConfig,
    train=train_ppo,
    cli_module="rlhf.cli.train_ppo",
    row_fields=row_fields,
    read_data=read_data,
    batch_lines=checks.batch_lines,
    lint_batches=checks.lint_batches,
    primary_loss="policy_loss",
    sections=("rollout", "reward", "algo", "critic", "colocate"),
    preset_prefixes=("ppo", "grpo"),
    has_reference=lambda cfg: cfg.algo.kl_coef > 0,
    reference_held_by_policy=lambda cfg: cfg.colocate.reference_in_policy,
    model_keys=RUN_MODEL_KEYS + ("critic.path", "reward.model_path", "algo.teacher.path"),
    extra_packages=("vllm",),
    resource_plan=rl_plan,
    extra_trained=_critic,
    checks=checks.start_up_checks,
    describe=checks.describe,
    audit_overrides=checks.audit_overrides,
    audit_split_fits=checks.audit_split_fits,
    online=True,
)
