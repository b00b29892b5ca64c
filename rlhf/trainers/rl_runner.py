"""``train_ppo(cfg)``: the PPO family (PPO, GRPO, Dr. GRPO, RLOO, REINFORCE++; ``python -m rlhf.cli.train_ppo``):
validate, start the actors (policy, vLLM engines, reference, critic, reward model, environment pool), run the
:class:`~rlhf.trainers.rl_steps.RLTrainer`'s steps in a :class:`~rlhf.trainers.run.Run`, save ``final/``."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional, Tuple

from rlhf.config.rl_schema import HYBRID_BROADCAST_ON_GPUS, RewardConfig, RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.formats import located, prompt_fields, read_formatted, text_prompts_note
from rlhf.data.io import DataError
from rlhf.data.plan import EpochPlan
from rlhf.data.vocab import load_tokenizer
from rlhf.distributed.cluster import actor_env
from rlhf.distributed.errors import WorkerError, WorkerTimeout
from rlhf.distributed.placement import Placement
from rlhf.distributed.resource_plan import (
    ENVIRONMENT,
    JUDGE,
    REWARD_POOL,
    ROLLOUT,
    ActorPlan,
    engine_gpus,
    engine_sleep,
)
from rlhf.envs import EnvError, EnvironmentPool, load_environment
from rlhf.envs.loading import is_agent
from rlhf.envs.rows import MissingColumn, probe_agent
from rlhf.hub import model_dir, pin_run_sources
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
from rlhf.objectives.actor_critic import PolicyObjective, ValueObjective
from rlhf.ops.policy_loss import PolicyLossConfig
from rlhf.rewards.functions import RewardFunctionError, RewardFunctionScorer, compute_rewards
from rlhf.rewards.scoring import RewardScorers
from rlhf.rl import ChatObservations, TurnLimits
from rlhf.rollout.engines import RolloutEngines, as_backend
from rlhf.rollout.sync_group import SyncTimeouts
from rlhf.rollout.vllm_engine import SamplingSpec, VLLMSpec
from rlhf.rollout.weight_sync import resolve_weight_sync
from rlhf.trainers.actors import RoleStarter, frozen_group, start_plan, trained_group
from rlhf.trainers.agent_template import check_tools_rendered
from rlhf.trainers.checkpoint import Checkpointable
from rlhf.trainers.kinds import kind_of
from rlhf.trainers.output_dir import claim_output_dir
from rlhf.trainers.preflight import preflight
from rlhf.trainers.rl_experience import PromptSet, prepare_prompts
from rlhf.trainers.rl_rollout import EPISODE_COLUMNS, EpisodeRollout, observation_format
from rlhf.trainers.rl_steps import RLActors, RLTrainer
from rlhf.trainers.run import Run, RunContext, RunResult, optim_spec, run_identity, with_restarts
from rlhf.utils.log import get_logger
from rlhf.utils.specs import clip_plain
from rlhf.utils.versions import check_versions

log = get_logger(__name__)


def _objectives(cfg: RLRunConfig):
    a = cfg.algo
    low, high = a.clip
    clip = PolicyLossConfig(
        clip_low=low,
        clip_high=high,
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
    )
    value = ValueObjective(clip=cfg.critic.value_clip or None, agg_mode=a.aggregation, agg_length=length)
    return policy, value


def _start_engines(
    cfg: RLRunConfig, ctx: RunContext, engines: ActorPlan, placement: Optional[Placement]
) -> RolloutEngines:
    """The plan's vLLM engines: on the policy's bundles (hybrid engine) or with resources of their own."""
    r = cfg.rollout
    sleep = engine_sleep(cfg.colocate, engine_gpus(r.tensor_parallel_size, ctx.gpus_per_worker))
    dtype = _engine_dtype(ctx.precision)
    spec = VLLMSpec(
        model_path=cfg.model.path,
        tensor_parallel_size=r.tensor_parallel_size,
        seed=cfg.train.seed,
        max_model_len=cfg.engine_context,
        dtype=dtype,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_gib=r.kv_cache_gib,
        enable_sleep_mode=sleep,
    )
    started = RolloutEngines(
        spec,
        engines.count,
        cpus_per_engine=engines.cpus,
        gpus_per_engine=engines.gpus,
        env_vars=actor_env(engines.gpus),
        placement=placement,
        sleep=sleep,
    )
    ctx.groups.append(started)  # shut down with the worker groups, before the placement groups go
    return started


def _engine_dtype(precision: str) -> str:
    """The vLLM dtype of engines in a run of ``precision``. vLLM runs no float64: an fp64 run's engines sample in
    float32 (the weight sync casts, rlhf.rollout.senders)."""
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float32"}[precision]


def _start_environment_pool(cfg: RLRunConfig, ctx: RunContext, actors: ActorPlan) -> EnvironmentPool:
    """The plan's environment actors (``env.*``, multi-turn); shut down with the worker groups."""
    pool = EnvironmentPool(
        cfg.env.spec, actors.count, cpus_per_actor=actors.cpus, step_timeout_s=cfg.env.step_timeout_s
    )
    ctx.groups.append(pool)
    return pool


def _start_reward_pool(cfg: RLRunConfig, ctx: RunContext, actors: ActorPlan):
    """The plan's reward-function actors (``reward.num_workers``); shut down with the worker groups."""
    from rlhf.rewards.pool import RewardPool  # imports Ray: only a run with reward actors needs it

    w = cfg.reward
    pool = RewardPool(
        RewardFunctionScorer(tuple(w.functions)),
        num_workers=actors.count,
        chunk_size=w.chunk_size,
        timeout_s=w.timeout_s,
        on_error=w.failure_policy,
        cpus_per_worker=actors.cpus,
    )
    ctx.groups.append(pool)
    return pool


def _start_judge(cfg: RLRunConfig, ctx: RunContext, engines: ActorPlan):
    """The plan's LLM judge (``reward.judge.*``) on vLLM engines of its own; shut down with the worker groups."""
    from rlhf.rewards.judge_spec import JudgeSpec  # imports torch's judge maths: only a run with a judge needs it
    from rlhf.rollout.judge import start_judge

    dtype = _engine_dtype(ctx.precision)
    judge = start_judge(
        JudgeSpec.of(cfg.reward.judge, seed=cfg.train.seed),
        engines.count,
        cpus_per_engine=engines.cpus,
        gpus_per_engine=engines.gpus,
        env_vars=actor_env(engines.gpus),
        dtype=dtype,
    )
    ctx.groups.append(judge)
    return judge


def _episodes(cfg: RLRunConfig, ctx: RunContext, started: Dict[str, Any], prompts: PromptSet, tokenizer):
    """Multi-turn rollouts: of an environment class, turn by turn, or of an agent function through the endpoint."""
    pool = started[ENVIRONMENT]
    if not is_agent(load_environment(cfg.env.spec)):
        return _episode_rollout(cfg, pool, prompts, tokenizer)
    from rlhf.trainers.agent_rollout import AgentRollout  # the endpoint's server stack: only agent runs need it

    r = cfg.rollout
    endpoint = _start_endpoint(cfg, ctx, started[ROLLOUT])
    return AgentRollout(
        pool, endpoint, tokenizer, r.max_episode_tokens, r.max_turns, r.on_prefix_mismatch, cfg.env.on_error
    )


def _start_endpoint(cfg: RLRunConfig, ctx: RunContext, engines: RolloutEngines):
    """The OpenAI-compatible endpoint over the engines, on this node's address (agents may run on other nodes);
    stopped with the worker groups."""
    import ray

    # FastAPI, uvicorn and vLLM's serving code: agent runs only
    from rlhf.rollout.endpoint import AgentEndpoint
    from rlhf.rollout.openai_render import OpenAIRenderer

    e = cfg.env
    renderer = OpenAIRenderer(
        model_dir(cfg.model.path),
        tool_parser=e.tool_parser or None,
        chat_template=e.chat_template or None,
        served_model_name="policy",
        max_model_len=cfg.engine_context,
    )
    sampling = SamplingSpec(max_new_tokens=cfg.rollout.max_new_tokens)  # each step sets the trainer's sampling
    endpoint = AgentEndpoint(renderer, engines.generate_each, sampling, host=ray.util.get_node_ip_address()).start()
    ctx.groups.append(endpoint)
    log.info(f"[rl] agents of {e.spec} reach the policy at http://{endpoint.host}:{endpoint.port}/episodes/<key>/v1")
    return endpoint


def _episode_rollout(cfg: RLRunConfig, pool: EnvironmentPool, prompts: PromptSet, tokenizer) -> EpisodeRollout:
    """Multi-turn rollouts of the environment pool's episodes."""
    r = cfg.rollout
    return EpisodeRollout(
        pool,
        tokenizer,
        observation_format(r.observation_format, prompts.chat is not None),
        r.observation_role,
        TurnLimits(r.max_turns, r.max_episode_tokens),
        r.on_prefix_mismatch,
        on_error=cfg.env.on_error,
    )


def _check_episodes(cfg: RLRunConfig, *prompt_sets: Optional[PromptSet]) -> None:
    """What a multi-turn run needs of its prompts, checked before any actor starts (the environment class loaded in
    the preflight): each prompt set (training, held-out) can take its observations (chat format: conversational
    prompts whose template renders observation turns, rlhf.rollout.observations)."""
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
            raise ConfigError(
                f"rollout.weight_sync={r.weight_sync}: cannot set up the {method} transport: {exc}"
            ) from exc
        log.info(
            f"[rl] weight sync: a {method} group could not be formed ({exc}); using the object store "
            f"(rollout.weight_sync=auto)"
        )
        method = "object_store"
        actors.engines.connect_weight_sync(actors.policy, method, bucket_bytes, backend, timeouts)
    log.info(
        f"[rl] weight sync: {method} in {r.weight_sync_bucket_mb} MB buckets"
        + (f" ({backend})" if method == "broadcast" else "")
    )


def _actor_died(exc: BaseException) -> bool:
    import ray

    return isinstance(exc.__cause__, ray.exceptions.RayActorError)


def _start_actors(cfg: RLRunConfig, ctx: RunContext, total_optimizer_steps: int) -> Dict[str, Any]:
    """Every role of the run's plan (``--dry-run`` prints it), in its order; ``{role: started group}``."""
    m = cfg.model
    optim = optim_spec(cfg.train, total_optimizer_steps)
    starters: Dict[str, RoleStarter] = {
        "policy": trained_group(ctx, m.path, CAUSAL_LM, optim),
        ROLLOUT: lambda engines, placement: _start_engines(cfg, ctx, engines, placement),
        "reference": frozen_group(ctx, m.ref_path or m.path, CAUSAL_LM),
        "critic": trained_group(
            ctx, cfg.critic.path or m.path, SCALAR_HEAD, dataclasses.replace(optim, lr=cfg.critic.lr)
        ),
        "reward_model": frozen_group(ctx, cfg.reward.model_path, SCALAR_HEAD),
        ENVIRONMENT: lambda pool, _: _start_environment_pool(cfg, ctx, pool),
        REWARD_POOL: lambda pool, _: _start_reward_pool(cfg, ctx, pool),
        JUDGE: lambda engines, _: _start_judge(cfg, ctx, engines),
    }
    return start_plan(kind_of(cfg).plan(cfg, ctx.gpus_per_worker), ctx, starters)


def _rl_actors(cfg: RLRunConfig, started: Dict[str, Any]) -> RLActors:
    return RLActors(
        policy=started["policy"],
        engines=as_backend(started[ROLLOUT]),
        reference=started.get("reference"),
        reference_is_base=kind_of(cfg).reference_on_policy(cfg),
        critic=started.get("critic"),
        reward_model=started.get("reward_model"),
    )


def _write_placement(started: Dict[str, Any], output_dir: str) -> None:
    """``placement.json``: every rank's placement group and resources, by role (shows what is colocated)."""
    where = {
        role: group.placements() for role, group in started.items() if role not in (ENVIRONMENT, REWARD_POOL, JUDGE)
    }
    with open(os.path.join(output_dir, "placement.json"), "w", encoding="utf-8") as f:
        json.dump(where, f, indent=1)
    groups: dict = {}
    for role, ranks in where.items():
        for rank in ranks:
            groups.setdefault(rank["placement_group"], set()).add(role)
    shared = [" + ".join(sorted(roles)) for roles in groups.values() if len(roles) > 1]
    log.info(f"[rl] colocated: {'; '.join(shared)}" if shared else "[rl] every role on its own resources")


def _identity(cfg: RLRunConfig, plan: EpochPlan) -> dict:
    """What an RL checkpoint must share with the run that resumes it."""
    r = cfg.rollout
    return {
        **run_identity(cfg, plan),
        "rollout.prompts_per_step": r.prompts_per_step,
        "rollout.n_samples_per_prompt": r.n_samples_per_prompt,
        "algo.ppo_epochs": cfg.algo.ppo_epochs,
        "critic.num_workers": cfg.critic.num_workers if cfg.algo.needs_critic else 0,
        **({"env.spec": cfg.env.spec, "rollout.max_turns": r.max_turns} if cfg.multi_turn else {}),
        **({"rollout.max_staleness": r.max_staleness} if r.max_staleness else {}),
    }


def row_fields(cfg: RLRunConfig) -> Dict[str, Any]:
    """The :func:`rlhf.data.io.read_rows` arguments of the prompt rows (the descriptor's ``row_fields``: no tokenizer
    needed, ``--dry-run`` reads them too). ``reward.columns`` as a user set it, and a multi-turn run's
    ``env.columns``, must be in every row, so a typo fails as the data is read, before any actor; the default
    (``answer``) is passed when present, and required when the judge's template reads it."""
    columns = tuple(dict.fromkeys(cfg.reward.columns + cfg.env.columns))  # an environment's row holds both
    named = cfg.reward.columns if cfg.reward.columns != RewardConfig().columns else ()
    required = {
        "reward.columns": named,
        "env.columns": cfg.env.columns if cfg.env.spec else (),
        "reward.judge.template": _judge_columns(cfg),
    }
    return prompt_fields(cfg.data.prompt_key, columns, required_columns=required, tools_key=cfg.data.tools_key)


def _judge_columns(cfg: RLRunConfig) -> Tuple[str, ...]:
    """The prompt-data columns the judge's template reads: a row without one would fail its rendering at the first
    scoring. Fields outside ``reward.columns`` are the preflight's to refuse (rlhf.trainers.preflight)."""
    if not cfg.reward.judge.path:
        return ()
    from rlhf.rewards.judge_spec import JudgeSpec  # imports torch's judge maths: only a run with a judge needs it

    return tuple(f for f in JudgeSpec.of(cfg.reward.judge).column_fields if f in cfg.reward.columns)


def _read_prompts(cfg: RLRunConfig, tokenizer, key: str, path: str, split: str):
    d, r = cfg.data, cfg.rollout
    rows, chat = read_formatted(
        d,
        path,
        split,
        tokenizer,
        row_fields(cfg),
        chat_keys=(d.prompt_key,),
        user_turn_key=d.prompt_key if d.template_text_prompts else "",
    )
    if note := text_prompts_note(rows, d.prompt_key, tokenizer):
        log.info(f"[rl] {key}: {note}")
    with located(key, path):
        return prepare_prompts(
            rows,
            tokenizer,
            prompt_key=d.prompt_key,
            columns=cfg.reward.columns,
            max_prompt_length=r.max_prompt_length,
            overflow=r.prompt_overflow,
            chat=chat,
            tools_key=d.tools_key,
        )


def read_prompt_sets(cfg: RLRunConfig, tokenizer) -> Tuple[PromptSet, Optional[PromptSet]]:
    """The training and held-out prompts, tokenized, with every check a run makes of them before any actor starts
    (a set left empty by rollout.max_prompt_length, a multi-turn run's observations, an agent run's tools against
    the endpoint's chat template: rlhf.trainers.agent_template)."""
    d, r = cfg.data, cfg.rollout
    prompts = _read_prompts(cfg, tokenizer, "data.train_path", d.train_path, d.split)
    eval_prompts = (
        _read_prompts(cfg, tokenizer, "data.eval_path", d.eval_path, d.eval_split or d.split) if d.eval_path else None
    )
    for key, path, prompt_set in (
        ("data.train_path", d.train_path, prompts),
        ("data.eval_path", d.eval_path, eval_prompts),
    ):
        if prompt_set is not None and not prompt_set.prompt_ids:  # an evaluation of nothing: no reward, NaN lengths
            raise DataError(
                f"{key}={path}: every prompt is longer than rollout.max_prompt_length="
                f"{r.max_prompt_length} ({prompt_set.skipped} skipped); raise it or set "
                f"rollout.prompt_overflow=truncate"
            )
    if cfg.multi_turn:
        _check_episodes(cfg, prompts, eval_prompts)
    if cfg.multi_turn and _agent_run(cfg):  # the endpoint's template must write the tools the episodes carry
        check_tools_rendered(cfg, tokenizer, (prompts, eval_prompts))
    return prompts, eval_prompts


def _agent_run(cfg: RLRunConfig) -> bool:
    """Whether ``env.spec`` names an agent function. False when it does not load here: the preflight refuses it in a
    run, and ``--dry-run`` leaves a spec only the cluster has to the run."""
    try:
        return is_agent(load_environment(cfg.env.spec))
    except EnvError:
        return False


def check_reward_columns(
    cfg: RLRunConfig, scorer: RewardFunctionScorer, prompts: PromptSet, eval_prompts: Optional[PromptSet]
) -> None:
    """Each reward function's parameters against the columns each prompt set gives it: the ``reward.columns`` every
    row of the set has (the default, ``answer``, is optional) and an episode's. A parameter that no column fills
    would stop the run at the evaluation before its first step, or at the first step, after every actor started."""
    episode = EPISODE_COLUMNS if cfg.multi_turn else ()
    for key, prompt_set in (("data.train_path", prompts), ("data.eval_path", eval_prompts)):
        if prompt_set is None:
            continue
        columns = [*prompt_set.columns, *episode]
        try:  # no sample: the functions are not called, their parameters are bound (as each scoring binds them)
            compute_rewards(scorer.load(), [], [], {c: [] for c in columns})
        except RewardFunctionError as e:
            raise ConfigError(
                f"reward.functions: with the columns of {key} ({', '.join(columns) or 'none'}), {e}"
            ) from None


def read_data(cfg: RLRunConfig, tokenizer) -> str:
    """``--dry-run``: the prompts read and tokenized as the run reads them (the descriptor's ``read_data``), and an
    agent (``env.spec`` naming a function) run once on the first row (:func:`probe_row_reads`)."""
    prompts, eval_prompts = read_prompt_sets(cfg, tokenizer)
    held_out = f"; {len(eval_prompts.prompt_ids)} held-out" if eval_prompts is not None else ""
    return (
        f"{len(prompts.prompt_ids)} prompts tokenized ({prompts.skipped} skipped, {prompts.truncated} truncated)"
        f"{held_out}{probe_row_reads(cfg, prompts)}"
    )


def probe_row_reads(cfg: RLRunConfig, prompts: PromptSet) -> str:
    """An agent run once on the first prompt row as the run would give it, with a stand-in client
    (:func:`rlhf.envs.rows.probe_agent`): a field it reads that no key passes is a :class:`ConfigError` naming
    ``env.columns``, here rather than in every episode after the start-up. Returns what the dry run prints."""
    if not cfg.env.spec or not prompts.env_rows:
        return ""
    agent = load_environment(cfg.env.spec)
    if not is_agent(agent):
        return ""
    try:
        stopped = probe_agent(agent, prompts.env_rows[0])
    except MissingColumn as e:
        where = f"env.columns: agent {cfg.env.spec} read a field of prompt row 0 it does not get"
        raise ConfigError(f"{where}: {e}") from None
    if stopped is None:
        return "; the agent ran on row 0 (stand-in replies)"
    return f"; the agent ran on row 0 until the stand-in's empty reply stopped it ({clip_plain(stopped, 120)})"


def train_ppo(cfg: RLRunConfig) -> RunResult:
    """Online RL of the PPO family end to end (see the module docstring); ``train.on_failure=restart`` restarts
    from checkpoints."""
    # hub ids -> org/name@<sha>: config.yaml and every actor get the pins
    return with_restarts(pin_run_sources(claim_output_dir(cfg), kind_of(cfg).model_keys), _train_ppo_once)


def _train_ppo_once(cfg: RLRunConfig) -> RunResult:
    check_versions(kind_of(cfg).packages)
    preflight(cfg)
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
    run = Run(cfg, "rl", plan, _identity(cfg, plan))
    # CPUs do not depend on the GPUs per worker, which are known only once the cluster is joined.
    with run.cluster(needed_cpus=kind_of(cfg).plan(cfg, 0.0).needed_cpus) as ctx:
        started = _start_actors(cfg, ctx, optimizer_steps)
        actors = _rl_actors(cfg, started)
        _connect_weight_sync(cfg, ctx, actors)
        _write_placement(started, t.output_dir)
        policy_objective, value_objective = _objectives(cfg)
        episodes = _episodes(cfg, ctx, started, prompts, tokenizer) if cfg.multi_turn else None
        scorers = _reward_scorers(cfg, scorer, started.get(REWARD_POOL), started.get(JUDGE))
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
            episodes=episodes,
        )
        trained: Dict[str, Checkpointable] = {"policy": actors.policy}
        if actors.critic is not None:
            trained["critic"] = actors.critic
        if r.max_staleness:  # the samples generated ahead are part of the run's state: a resume trains on them
            trained["rollouts"] = trainer.schedule
        last = run.train(trainer, trained)
        return run.finish(actors.policy, tokenizer, last)


def _reward_scorers(
    cfg: RLRunConfig, functions: Optional[RewardFunctionScorer], pool: Optional[Any], judge: Optional[Any]
) -> Optional[RewardScorers]:
    """The reward functions (in the driver, or on the plan's reward actors, ``pool``), the remote reward
    (``reward.http``) and the LLM judge (``judge``, the plan's), or ``None`` when the run has none of them."""
    w = cfg.reward
    http = None
    if w.http:
        from rlhf.rewards.remote import HttpReward  # urllib and threads: only a run with a remote reward needs it

        http = HttpReward(
            w.http,
            batch_size=w.http_batch_size,
            timeout_s=w.timeout_s,
            retries=w.http_retries,
            backoff_s=w.http_backoff_s,
            concurrency=w.http_concurrency,
            on_error=w.failure_policy,
            weight=w.http_weight,
        )
    if pool is not None:
        functions = None  # scored on the actors
    if functions is None and pool is None and http is None and judge is None:
        return None
    return RewardScorers(functions=functions, pool=pool, http=http, judge=judge)
