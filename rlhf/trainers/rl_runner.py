"""``train_rl(cfg)``: validate, start the actors (policy, vLLM engines, reference, critic, reward model), run the
:class:`~rlhf.trainers.rl.RLTrainer`, save ``final/``."""
from __future__ import annotations

import os

from rlhf.config.loader import save_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.io import read_rows
from rlhf.data.plan import EpochPlan
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
from rlhf.trainers.offline import RunResult, check_paths, load_tokenizer, save_final
from rlhf.trainers.rl import RLActors, RLTrainer
from rlhf.trainers.rl_experience import prepare_prompts
from rlhf.trainers.runner import optim_spec, start_cluster
from rlhf.utils.metrics import MetricsWriter


def _objectives(cfg: RLRunConfig):
    from rlhf.objectives.rl import PolicyObjective, ValueObjective
    from rlhf.ops.policy_loss import PolicyLossConfig

    a = cfg.algo
    clip = PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip or None,
                            tis_cap=a.tis_cap or None)
    policy = PolicyObjective(loss_type=a.policy_loss, clip=clip, agg_mode=a.loss_agg_mode,
                             temperature=cfg.rollout.temperature, entropy_coef=a.entropy_coef,
                             kl_loss_coef=a.kl_coef if a.kl_mode == "loss" else 0.0, kl_estimator=a.kl_estimator,
                             use_tis=a.tis_cap > 0)
    value = ValueObjective(clip=cfg.critic.value_clip or None, agg_mode=a.loss_agg_mode)
    return policy, value


def _check_rl_paths(cfg: RLRunConfig) -> None:
    check_paths(cfg)
    for key, path in (("reward.model_path", cfg.reward.model_path), ("critic.path", cfg.critic.path)):
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{key}: {path!r} is not an HF model directory (no config.json)")
    per_pass = cfg.train.micro_batch_size * cfg.critic.num_workers
    if cfg.algo.needs_critic and cfg.train.global_batch_size % per_pass:
        raise ConfigError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be divisible by "
                          f"train.micro_batch_size x critic.num_workers ({per_pass})")


def _start_engines(cfg: RLRunConfig, ctx) -> list:
    import ray

    from rlhf.distributed.cluster import actor_env
    from rlhf.rollout.vllm_engine import EngineSpec, VLLMEngine

    r = cfg.rollout
    spec = EngineSpec(model_path=cfg.model.path, tensor_parallel_size=r.tensor_parallel_size, seed=cfg.train.seed,
                      max_model_len=r.max_prompt_length + r.max_new_tokens,
                      dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[ctx.precision],
                      gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_gib=r.kv_cache_gib)
    gpus = r.tensor_parallel_size if ctx.gpus_per_worker > 0 else 0
    actor = ray.remote(VLLMEngine).options(num_cpus=r.cpus_per_engine, num_gpus=gpus,
                                           runtime_env={"env_vars": actor_env(gpus)})
    engines = [actor.remote(spec) for _ in range(r.num_engines)]
    ray.get([e.ready.remote() for e in engines])
    return engines


def _start_actors(cfg: RLRunConfig, ctx, total_optimizer_steps: int) -> RLActors:
    import dataclasses

    t = cfg.train
    engine = ctx.engine_spec(t.micro_batch_size, t.grad_accum_steps)
    policy = ctx.make_group("policy", t.num_workers)
    policy.build(ctx.model_spec(cfg.model.path, CAUSAL_LM), engine, optim_spec(t, total_optimizer_steps))
    actors = RLActors(policy=policy, engines=_start_engines(cfg, ctx))
    frozen = ctx.engine_spec(micro_batch_size=1, grad_accum_steps=1)
    if cfg.algo.kl_coef > 0:
        actors.reference = ctx.make_group("reference", t.num_workers)
        actors.reference.build(ctx.model_spec(cfg.model.ref_path or cfg.model.path, CAUSAL_LM), frozen, None)
    if cfg.algo.needs_critic:
        actors.critic = ctx.make_group("critic", cfg.critic.num_workers)
        critic_engine = ctx.engine_spec(t.micro_batch_size,
                                        t.global_batch_size // (t.micro_batch_size * cfg.critic.num_workers))
        critic_optim = dataclasses.replace(optim_spec(t, total_optimizer_steps), lr=cfg.critic.lr)
        actors.critic.build(ctx.model_spec(cfg.critic.path or cfg.model.path, SCALAR_HEAD), critic_engine,
                            critic_optim)
    if cfg.reward.model_path:
        actors.reward_model = ctx.make_group("reward_model", cfg.reward.model_num_workers)
        actors.reward_model.build(ctx.model_spec(cfg.reward.model_path, SCALAR_HEAD), frozen, None)
    return actors


def train_rl(cfg: RLRunConfig) -> RunResult:
    from rlhf.rewards.functions import RewardFunctionScorer

    _check_rl_paths(cfg)
    tokenizer = load_tokenizer(cfg)
    d, r, t = cfg.data, cfg.rollout, cfg.train
    rows = read_rows(d.train_path, required=(d.prompt_key,), optional=cfg.reward.columns, split=d.split)
    prompts = prepare_prompts(rows, tokenizer, prompt_key=d.prompt_key, columns=cfg.reward.columns,
                              max_prompt_length=r.max_prompt_length, overflow=r.prompt_overflow)
    plan = EpochPlan(num_samples=len(prompts.prompt_ids), global_batch_size=r.prompts_per_step,
                     max_epochs=t.max_epochs, max_steps=t.max_steps, seed=t.seed)
    scorer = RewardFunctionScorer(tuple(cfg.reward.functions)) if cfg.reward.functions else None
    if scorer is not None:
        scorer.load()  # a bad spec fails here, before any actor starts
    optimizer_steps = plan.total_steps * cfg.algo.ppo_epochs * (r.samples_per_step // t.global_batch_size)
    print(f"[rl] {len(prompts.prompt_ids)} prompts ({prompts.skipped} skipped, {prompts.truncated} truncated), "
          f"{plan.total_steps} RL steps x {r.samples_per_step} samples, {optimizer_steps} optimizer steps; "
          f"{cfg.algo.advantage_estimator} / {cfg.algo.policy_loss}", flush=True)
    os.makedirs(t.output_dir, exist_ok=True)
    save_config(cfg, os.path.join(t.output_dir, "config.yaml"))

    actors_cpus = (t.num_workers * (2 if cfg.algo.kl_coef > 0 else 1) + r.num_engines * r.cpus_per_engine
                   + (cfg.critic.num_workers if cfg.algo.needs_critic else 0)
                   + (cfg.reward.model_num_workers if cfg.reward.model_path else 0))
    ctx = start_cluster(cfg, needed_cpus=actors_cpus * cfg.strategy.cpus_per_worker)
    writer, actors = None, None
    try:
        actors = _start_actors(cfg, ctx, optimizer_steps)
        writer = MetricsWriter(t.output_dir, tensorboard=cfg.logging.tensorboard)
        policy_objective, value_objective = _objectives(cfg)
        trainer = RLTrainer(cfg, tokenizer, prompts, plan, actors, scorer, policy_objective, value_objective, writer)
        last = trainer.fit()
        final_dir = save_final(actors.policy, tokenizer, t.output_dir) if t.save_final else None
        return RunResult(output_dir=t.output_dir, steps=plan.total_steps, final_metrics=last, final_dir=final_dir)
    finally:
        if writer is not None:
            writer.close()
        ctx.shutdown()
        if actors is not None:
            import ray

            for engine in actors.engines:
                ray.kill(engine)
