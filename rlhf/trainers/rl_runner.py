"""``train_ppo(cfg)``: the PPO family (PPO, GRPO, Dr. GRPO, RLOO, REINFORCE++; ``python -m rlhf.cli.train_ppo``):
validate, start the actors (policy, vLLM engines, reference, critic, reward model, environment pool), run the
:class:`~rlhf.trainers.rl_steps.RLTrainer`'s steps in a :class:`~rlhf.trainers.run.Run`, save ``final/``."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional, Union

from rlhf.config.rl_schema import HYBRID_BROADCAST_ON_GPUS, RLRunConfig
from rlhf.distributed.cluster import actor_env
from rlhf.distributed.errors import WorkerError, WorkerTimeout
from rlhf.distributed.group import WorkerGroup
from rlhf.distributed.resource_plan import engine_gpus, engine_sleep, policy_side_roles, rl_plan
from rlhf.envs import EnvError, EnvironmentPool, load_environment
from rlhf.config.schema import ConfigError
from rlhf.data.formats import located, prompt_fields, read_formatted
from rlhf.data.io import DataError
from rlhf.data.plan import EpochPlan
from rlhf.hub import is_hub_ref, model_dir, pin_run_sources
from rlhf.models.checks import check_scalar_head
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
from rlhf.objectives.actor_critic import PolicyObjective, ValueObjective
from rlhf.ops.policy_loss import PolicyLossConfig
from rlhf.rewards.functions import RewardFunctionScorer
from rlhf.rl import ChatObservations, TurnLimits
from rlhf.rollout.engines import RolloutEngines
from rlhf.rollout.sync_group import SyncTimeouts
from rlhf.rollout.vllm_engine import VLLMSpec
from rlhf.rollout.weight_sync import resolve_weight_sync
from rlhf.trainers.kinds import kind_of
from rlhf.trainers.offline import check_paths, load_tokenizer
from rlhf.trainers.output_dir import claim_output_dir
from rlhf.trainers.rl_steps import RLActors, RLTrainer
from rlhf.trainers.rl_experience import PromptSet, prepare_prompts
from rlhf.trainers.rl_rollout import EpisodeRollout, observation_format
from rlhf.trainers.run import (Run, RunContext, RunResult, check_lora_targets, optim_spec,
                               run_identity, with_restarts)
from rlhf.utils.versions import check_versions


def _objectives(cfg: RLRunConfig):
    a = cfg.algo
    low, high = a.clip
    clip = PolicyLossConfig(clip_low=low, clip_high=high, dual_clip=a.dual_clip or None, tis_cap=a.tis_cap or None)
    length = cfg.max_response_tokens  # the constant of a per-length aggregation (Dr. GRPO's budget)
    policy = PolicyObjective(loss_type=a.policy_loss, clip=clip, agg_mode=a.aggregation, agg_length=length,
                             temperature=cfg.rollout.temperature,
                             sampling_filter=cfg.rollout.sampling_filter,
                             entropy_coef=a.entropy_coef,
                             kl_loss_coef=a.kl_coef if a.kl_mode == "loss" else 0.0, kl_estimator=a.kl_estimator,
                             use_tis=a.tis_cap > 0)
    value = ValueObjective(clip=cfg.critic.value_clip or None, agg_mode=a.aggregation, agg_length=length)
    return policy, value


def _check_rl_paths(cfg: RLRunConfig) -> None:
    check_paths(cfg)
    for key, path in (("reward.model_path", cfg.reward.model_path), ("critic.path", cfg.critic.path)):
        # a hub reference's repository was checked when it was pinned (rlhf.hub.pin_run_sources)
        if path and not is_hub_ref(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{key}: {path!r} is not an HF model directory (no config.json)")
    if cfg.critic_batch_problem():
        raise ConfigError(cfg.critic_batch_problem())
    check_lora_targets(cfg, kind_of(cfg).trained_models(cfg))


def _start_engines(cfg: RLRunConfig, ctx, placement):
    r = cfg.rollout
    gpus = engine_gpus(r.tensor_parallel_size, ctx.gpus_per_worker)  # what the plan and --dry-run count
    sleep = engine_sleep(cfg.colocate, gpus)
    # vLLM runs no float64: an fp64 run's engines sample in float32 (the weight sync casts, rlhf.rollout.senders)
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float32"}[ctx.precision]
    spec = VLLMSpec(model_path=cfg.model.path, tensor_parallel_size=r.tensor_parallel_size, seed=cfg.train.seed,
                      max_model_len=_engine_context(cfg), dtype=dtype,
                      gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gib=r.kv_cache_gib,
                      enable_sleep_mode=sleep)
    engines = RolloutEngines(spec, r.num_engines, cpus_per_engine=r.cpus_per_engine, gpus_per_engine=gpus,
                             env_vars=actor_env(gpus), placement=placement, sleep=sleep)
    ctx.groups.append(engines)  # shut down with the worker groups, before the placement groups go
    return engines


def _engine_context(cfg: RLRunConfig) -> int:
    """The engines' ``max_model_len``: a prompt and its response; for episodes, the episode's budget plus one
    response (a turn may sample past the budget; the episode keeps only what fits, rlhf.rollout.multi_turn)."""
    r = cfg.rollout
    return cfg.max_sequence_length + (r.max_new_tokens if cfg.multi_turn else 0)


def _start_environments(cfg: RLRunConfig, ctx, prompts: PromptSet, tokenizer) -> EpisodeRollout:
    """The environment pool (``env.*``) and the multi-turn rollout around it; shut down with the worker groups."""
    e, r = cfg.env, cfg.rollout
    pool = EnvironmentPool(e.spec, e.num_actors, cpus_per_actor=e.cpus_per_actor, step_timeout_s=e.step_timeout_s)
    ctx.groups.append(pool)
    return EpisodeRollout(pool, tokenizer, observation_format(r.observation_format, prompts.chat is not None),
                          r.observation_role, TurnLimits(r.max_turns, r.max_episode_tokens), r.on_prefix_mismatch,
                          on_error=e.on_error)


def _check_episodes(cfg: RLRunConfig, *prompt_sets: Optional[PromptSet]) -> None:
    """What a multi-turn run needs, checked before any actor starts: the environment class loads here, and each
    prompt set (training, held-out) can take its observations (chat format: conversational prompts whose template
    renders observation turns, rlhf.rollout.observations)."""
    try:
        load_environment(cfg.env.spec)
    except EnvError as e:
        raise ConfigError(f"env.spec: {e}") from None
    r = cfg.rollout
    for prompts in filter(None, prompt_sets):
        if observation_format(r.observation_format, prompts.chat is not None) == "chat":
            try:
                ChatObservations(prompts.chat, r.observation_role)
            except ValueError as e:  # names rollout.observation_role
                raise ConfigError(str(e)) from None


def _connect_weight_sync(cfg: RLRunConfig, ctx, actors: RLActors) -> None:
    """Form the policy -> engines transport before the first step. ``auto`` falls back to the object store when a
    process group cannot be formed (and says so); a method asked for by name that cannot be set up is an error
    naming ``rollout.weight_sync``."""
    r = cfg.rollout
    gpus = actors.engines.gpus_per_engine
    method = resolve_weight_sync(r.weight_sync, hybrid_engine=cfg.colocate.hybrid_engine, gpus_per_engine=gpus)
    bucket_bytes = r.weight_sync_bucket_mb << 20
    backend = "nccl" if gpus > 0 and ctx.gpus_per_worker > 0 else "gloo"  # both ends on GPUs, else host memory
    if method == "broadcast" and cfg.colocate.hybrid_engine and backend == "nccl":  # known only now (auto GPUs)
        raise ConfigError(f"rollout.weight_sync {HYBRID_BROADCAST_ON_GPUS}")
    timeouts = SyncTimeouts.of(r)
    try:
        actors.engines.connect_weight_sync(actors.policy, method, bucket_bytes, backend, timeouts)
    except WorkerError as exc:
        # not a transport that cannot form: the run's actors are gone, or one is stuck (a fallback would queue
        # behind its call)
        if _actor_died(exc) or isinstance(exc, WorkerTimeout):
            raise
        if r.weight_sync != "auto" or method == "object_store":
            raise ConfigError(f"rollout.weight_sync={r.weight_sync}: cannot set up the {method} transport: "
                              f"{exc}") from exc
        print(f"[rl] weight sync: a {method} group could not be formed ({exc}); using the object store "
              f"(rollout.weight_sync=auto)", flush=True)
        method = "object_store"
        actors.engines.connect_weight_sync(actors.policy, method, bucket_bytes, backend, timeouts)
    print(f"[rl] weight sync: {method} in {r.weight_sync_bucket_mb} MB buckets"
          + (f" ({backend})" if method == "broadcast" else ""), flush=True)


def _actor_died(exc: BaseException) -> bool:
    import ray

    return isinstance(exc.__cause__, ray.exceptions.RayActorError)


def _policy_side_roles(cfg: RLRunConfig) -> list:
    """The roles sharing the policy's bundles: ``["policy"]`` plus colocated reference / engines."""
    return list(policy_side_roles(cfg.colocate))


def _start_actors(cfg: RLRunConfig, ctx: RunContext, total_optimizer_steps: int) -> RLActors:
    t, c = cfg.train, cfg.colocate
    roles = _policy_side_roles(cfg)
    shared = ctx.shared_placement(roles, t.num_workers) if len(roles) > 1 else None
    policy = ctx.make_group("policy", t.num_workers, placement=shared)
    policy.build(ctx.model_spec(cfg.model.path, CAUSAL_LM), ctx.engine_spec(t.num_workers),
                 optim_spec(t, total_optimizer_steps))
    actors = RLActors(policy=policy, engines=_start_engines(cfg, ctx, shared if c.hybrid_engine else None))
    _connect_weight_sync(cfg, ctx, actors)
    actors.reference_is_base = cfg.algo.kl_coef > 0 and cfg.model.reference_is_base
    if cfg.algo.kl_coef > 0 and not actors.reference_is_base:
        actors.reference = ctx.make_group("reference", t.num_workers,
                                          placement=shared if c.policy_reference else None)
        actors.reference.build(ctx.model_spec(cfg.model.ref_path or cfg.model.path, CAUSAL_LM),
                               ctx.engine_spec(t.num_workers, trainable=False), None)
    critic_side = (ctx.shared_placement(["critic", "reward_model"], cfg.critic.num_workers)
                   if c.critic_reward else None)
    if cfg.algo.needs_critic:
        actors.critic = ctx.make_group("critic", cfg.critic.num_workers, placement=critic_side)
        critic_engine = ctx.engine_spec(cfg.critic.num_workers)
        critic_optim = dataclasses.replace(optim_spec(t, total_optimizer_steps), lr=cfg.critic.lr)
        actors.critic.build(ctx.model_spec(cfg.critic.path or cfg.model.path, SCALAR_HEAD), critic_engine,
                            critic_optim)
    if cfg.reward.model_path:
        actors.reward_model = ctx.make_group("reward_model", cfg.reward.model_num_workers, placement=critic_side)
        actors.reward_model.build(ctx.model_spec(cfg.reward.model_path, SCALAR_HEAD),
                                  ctx.engine_spec(cfg.reward.model_num_workers, trainable=False), None)
    return actors


def _needed_cpus(cfg: RLRunConfig) -> float:
    """CPUs the run's actors ask for: one bundle per rank of each placement, plus engines of their own (the plan
    ``--dry-run`` prints; CPU counts do not depend on the GPUs per worker, unknown before the cluster is joined)."""
    return rl_plan(cfg, gpus_per_worker=0.0).needed_cpus


def _write_placement(actors: RLActors, output_dir: str) -> None:
    """``placement.json``: every rank's placement group and resources, by role (shows what is colocated)."""
    roles: Dict[str, Union[WorkerGroup, RolloutEngines, None]] = {
        "policy": actors.policy, "rollout": actors.engines, "reference": actors.reference,
        "critic": actors.critic, "reward_model": actors.reward_model}
    where = {role: group.placements() for role, group in roles.items() if group is not None}
    with open(os.path.join(output_dir, "placement.json"), "w", encoding="utf-8") as f:
        json.dump(where, f, indent=1)
    groups: dict = {}
    for role, ranks in where.items():
        for rank in ranks:
            groups.setdefault(rank["placement_group"], set()).add(role)
    shared = [" + ".join(sorted(roles)) for roles in groups.values() if len(roles) > 1]
    print(f"[rl] colocated: {'; '.join(shared)}" if shared else "[rl] every role on its own resources", flush=True)


def _identity(cfg: RLRunConfig, plan: EpochPlan) -> dict:
    """What an RL checkpoint must share with the run that resumes it."""
    r = cfg.rollout
    return {**run_identity(cfg, plan), "rollout.prompts_per_step": r.prompts_per_step,
            "rollout.n_samples_per_prompt": r.n_samples_per_prompt, "algo.ppo_epochs": cfg.algo.ppo_epochs,
            "critic.num_workers": cfg.critic.num_workers if cfg.algo.needs_critic else 0,
            **({"env.spec": cfg.env.spec, "rollout.max_turns": r.max_turns} if cfg.multi_turn else {})}


def _read_prompts(cfg: RLRunConfig, tokenizer, key: str, path: str, split: str):
    d, r = cfg.data, cfg.rollout
    columns = tuple(dict.fromkeys(cfg.reward.columns + cfg.env.columns))  # an environment's row holds both
    rows, chat = read_formatted(d, path, split, tokenizer, prompt_fields(d.prompt_key, columns),
                                chat_keys=(d.prompt_key,))
    with located(key, path):
        return prepare_prompts(rows, tokenizer, prompt_key=d.prompt_key, columns=cfg.reward.columns,
                               max_prompt_length=r.max_prompt_length, overflow=r.prompt_overflow, chat=chat)


def train_ppo(cfg: RLRunConfig) -> RunResult:
    """Online RL of the PPO family end to end (see the module docstring); ``train.on_failure=restart`` restarts
    from checkpoints."""
    # hub ids -> org/name@<sha>: config.yaml and every actor get the pins
    return with_restarts(pin_run_sources(claim_output_dir(cfg), kind_of(cfg).model_keys), _train_ppo_once)


def _train_ppo_once(cfg: RLRunConfig) -> RunResult:
    check_versions(kind_of(cfg).packages)
    _check_rl_paths(cfg)
    if cfg.reward.model_path:
        check_scalar_head(model_dir(cfg.reward.model_path), "reward.model_path", cfg.reward.model_path)
    tokenizer = load_tokenizer(cfg)
    d, r, t = cfg.data, cfg.rollout, cfg.train
    prompts = _read_prompts(cfg, tokenizer, "data.train_path", d.train_path, d.split)
    eval_prompts = (_read_prompts(cfg, tokenizer, "data.eval_path", d.eval_path, d.eval_split or d.split)
                    if d.eval_path else None)
    if not prompts.prompt_ids:
        raise DataError(f"data.train_path={d.train_path}: every prompt is longer than rollout.max_prompt_length="
                        f"{r.max_prompt_length} ({prompts.skipped} skipped); raise it or set "
                        f"rollout.prompt_overflow=truncate")
    plan = EpochPlan(num_samples=len(prompts.prompt_ids), global_batch_size=r.prompts_per_step,
                     max_epochs=t.max_epochs, max_steps=t.max_steps, seed=t.seed)
    scorer = RewardFunctionScorer(tuple(cfg.reward.functions)) if cfg.reward.functions else None
    if scorer is not None:
        scorer.load()  # a bad spec fails here, before any actor starts
    if cfg.multi_turn:
        _check_episodes(cfg, prompts, eval_prompts)
    optimizer_steps = plan.total_steps * cfg.optimizer_steps_per_rl_step
    print(f"[rl] {len(prompts.prompt_ids)} prompts ({prompts.skipped} skipped, {prompts.truncated} truncated), "
          f"{plan.total_steps} RL steps x {r.samples_per_step} samples, {optimizer_steps} optimizer steps; "
          f"{cfg.algo.advantage_estimator} / {cfg.algo.policy_loss} / {cfg.algo.describe_aggregation()}; "
          f"{cfg.algo.describe_clip()}", flush=True)
    if cfg.multi_turn:
        e = cfg.env
        print(f"[rl] episodes of {e.spec} on {e.num_actors} actor(s): up to {r.max_turns} turns and "
              f"{r.max_episode_tokens} tokens (rollout.episode_limit={r.episode_limit}), observations as "
              f"{observation_format(r.observation_format, prompts.chat is not None)}; a sample is an episode",
              flush=True)
        longest = r.max_prompt_length + r.max_turns * r.max_new_tokens  # before any observation token
        if longest > r.max_episode_tokens:
            print(f"[rl] note: a longest prompt and {r.max_turns} full responses take {longest} tokens, more than "
                  f"rollout.max_episode_tokens={r.max_episode_tokens}: long episodes will end at the token budget "
                  f"(episode/ended_token_budget)", flush=True)
    run = Run(cfg, "rl", plan, _identity(cfg, plan))
    with run.cluster(needed_cpus=_needed_cpus(cfg)) as ctx:
        actors = _start_actors(cfg, ctx, optimizer_steps)
        _write_placement(actors, t.output_dir)
        policy_objective, value_objective = _objectives(cfg)
        episodes = _start_environments(cfg, ctx, prompts, tokenizer) if cfg.multi_turn else None
        trainer = RLTrainer(cfg, tokenizer, prompts, plan, actors, scorer, policy_objective, value_objective,
                            eval_prompts=eval_prompts, episodes=episodes)
        trained = {"policy": actors.policy, **({"critic": actors.critic} if actors.critic is not None else {})}
        last = run.train(trainer, trained)
        return run.finish(actors.policy, tokenizer, last)
