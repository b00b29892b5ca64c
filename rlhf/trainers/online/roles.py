"""Online RL's roles: the policy, the vLLM engines, the reference, the critic, the reward model, the environment
pool, the reward-function pool and the judge, each started from the run's plan (:func:`start_roles`); the weight
sync connected between the policy and the engines; the source of multi-turn episodes (an environment's, or an
agent's through the endpoint) and the reward scorers the trainer calls."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from rlhf.config.rl_schema import HYBRID_BROADCAST_ON_GPUS, RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.distributed.cluster import actor_env
from rlhf.distributed.errors import WorkerError, WorkerTimeout
from rlhf.distributed.placement import Placement
from rlhf.distributed.resource_plan import (
    ENVIRONMENT,
    JUDGE,
    REWARD_POOL,
    ROLLOUT,
    TEACHER,
    ActorPlan,
    ResourcePlan,
    engine_gpus,
    engine_sleep,
)
from rlhf.envs import EnvironmentPool, load_environment
from rlhf.envs.loading import is_agent
from rlhf.hub import model_dir
from rlhf.models.loading import CAUSAL_LM, SCALAR_HEAD
from rlhf.rewards.functions import RewardFunctionScorer
from rlhf.rollout.backend import RolloutBackend
from rlhf.rollout.multi_turn import TurnLimits
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.sources import EpisodeRollout, RolloutSource, SingleTurnRollout, observation_format
from rlhf.rollout.types import SamplingSpec
from rlhf.rollout.vllm.engine import VLLMSpec, engine_lora_rank
from rlhf.rollout.vllm.engines import RolloutEngines, as_backend
from rlhf.rollout.weights.group import SyncTimeouts
from rlhf.rollout.weights.sync import resolve_weight_sync
from rlhf.trainers.actors import RoleStarter, frozen_group, holding, start_plan, trained_group
from rlhf.trainers.context import RunContext, optim_spec
from rlhf.trainers.online.steps import RLActors
from rlhf.utils.log import get_logger

log = get_logger(__name__)


def _engine_dtype(precision: str) -> str:
    """The vLLM dtype of engines in a run of ``precision``. vLLM runs no float64: an fp64 run's engines sample in
    float32 (the weight sync casts, rlhf.rollout.weights.senders)."""
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float32"}[precision]


def _start_engines(
    cfg: RLRunConfig, ctx: RunContext, engines: ActorPlan, placement: Optional[Placement]
) -> RolloutBackend:
    """The plan's engines, of ``rollout.backend``: on the policy's bundles (hybrid engine) or with resources of their
    own."""
    return ENGINE_STARTERS[cfg.rollout.backend](cfg, ctx, engines, placement)


def _start_vllm_engines(
    cfg: RLRunConfig, ctx: RunContext, engines: ActorPlan, placement: Optional[Placement]
) -> RolloutEngines:
    """vLLM engine actors (``rollout.backend=vllm``)."""
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
        max_lora_rank=engine_lora_rank(cfg.model.lora.r) if cfg.model.lora.adapter_only else 0,
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


#: ``rollout.backend`` -> its engines' starter: one per name of rlhf.config.rl_schema.ROLLOUT_BACKENDS (tested).
ENGINE_STARTERS: Dict[str, Callable[[RLRunConfig, RunContext, ActorPlan, Optional[Placement]], Any]] = {
    "vllm": _start_vllm_engines,
}


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
    from rlhf.rollout.vllm.judge_engines import start_judge

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


def rollout_source(
    cfg: RLRunConfig, ctx: RunContext, started: Dict[str, Any], prompts: PromptSet, tokenizer
) -> RolloutSource:
    """Where the run's samples come from: one response per prompt, or (``env.spec``) the episodes of an environment
    class, turn by turn, or of an agent function through the endpoint."""
    if not cfg.multi_turn:
        return SingleTurnRollout(tokenizer)
    pool = started[ENVIRONMENT]
    if not is_agent(load_environment(cfg.env.spec)):
        return _episode_rollout(cfg, pool, prompts, tokenizer)
    from rlhf.rollout.agent import AgentRollout  # the endpoint's server stack: only agent runs need it

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
    from rlhf.rollout.openai.endpoint import AgentEndpoint
    from rlhf.rollout.openai.render import OpenAIRenderer

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


def connect_weight_sync(cfg: RLRunConfig, ctx, actors: RLActors) -> None:
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
    adapter_only = cfg.model.lora.adapter_only
    try:
        actors.engines.connect_weight_sync(actors.policy, method, bucket_bytes, backend, timeouts, adapter_only)
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
        actors.engines.connect_weight_sync(actors.policy, method, bucket_bytes, backend, timeouts, adapter_only)
    log.info(
        f"[rl] weight sync: {method} in {r.weight_sync_bucket_mb} MB buckets"
        + (f" ({backend})" if method == "broadcast" else "")
        + (", the LoRA adapter alone (model.lora.sync=adapter)" if adapter_only else "")
    )


def _actor_died(exc: BaseException) -> bool:
    import ray

    return isinstance(exc.__cause__, ray.exceptions.RayActorError)


def start_roles(
    cfg: RLRunConfig, ctx: RunContext, plan: ResourcePlan, total_optimizer_steps: int, reference_held: bool = False
) -> Dict[str, Any]:
    """Every role of the run's ``plan`` (``--dry-run`` prints it), started as :func:`start_plan` says;
    ``{role: started group}`` in the plan's order. The policy's ranks also load the frozen reference
    (``reference_held``: ``colocate.reference_in_policy``) and the teacher (``colocate.teacher_in_policy``) when
    they hold them; the plan has no group for those then."""
    m = cfg.model
    optim = optim_spec(cfg.train, total_optimizer_steps)
    policy = trained_group(ctx, m.path, CAUSAL_LM, optim)
    held = [(role, path, CAUSAL_LM) for role, path in held_models(cfg, reference_held)]
    starters: Dict[str, RoleStarter] = {
        "policy": holding(ctx, policy, held, "rl") if held else policy,
        ROLLOUT: lambda engines, placement: _start_engines(cfg, ctx, engines, placement),
        "reference": frozen_group(ctx, m.ref_path or m.path, CAUSAL_LM),
        TEACHER: frozen_group(ctx, cfg.algo.teacher.path, CAUSAL_LM),
        "critic": trained_group(
            ctx, cfg.critic.path or m.path, SCALAR_HEAD, dataclasses.replace(optim, lr=cfg.critic.lr)
        ),
        "reward_model": frozen_group(ctx, cfg.reward.model_path, SCALAR_HEAD),
        ENVIRONMENT: lambda pool, _: _start_environment_pool(cfg, ctx, pool),
        REWARD_POOL: lambda pool, _: _start_reward_pool(cfg, ctx, pool),
        JUDGE: lambda engines, _: _start_judge(cfg, ctx, engines),
    }
    return start_plan(plan, ctx, starters, name="rl")


def held_models(cfg: RLRunConfig, reference_held: bool) -> List[Tuple[str, str]]:
    """``(role, path)`` of the frozen models the policy's ranks hold in their own processes: the reference
    (``reference_held``, the descriptor's fact) and the distillation teacher (``colocate.teacher_in_policy``)."""
    m = cfg.model
    return [("reference", m.ref_path or m.path)] * reference_held + [
        (TEACHER, cfg.algo.teacher.path)
    ] * cfg.colocate.teacher_in_policy


def rl_actors(
    started: Dict[str, Any],
    reference_is_base: bool = False,
    sleepers: Tuple[str, ...] = (),
    offloaded: Tuple[str, ...] = (),
) -> RLActors:
    """The started roles as the trainer holds them. No reference group, the policy's workers score the reference:
    ``reference_is_base``, LoRA's frozen base; or a reference and a teacher the policy's ranks hold. ``sleepers``:
    :func:`sleeping_roles`; ``offloaded``: :func:`offloaded_roles`."""
    return RLActors(
        policy=started["policy"],
        engines=as_backend(started[ROLLOUT]),
        reference=started.get("reference"),
        reference_is_base=reference_is_base,
        teacher=started.get(TEACHER),
        critic=started.get("critic"),
        reward_model=started.get("reward_model"),
        sleepers=sleepers,
        offloaded=offloaded,
    )


def write_placement(started: Dict[str, Any], output_dir: str) -> None:
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
