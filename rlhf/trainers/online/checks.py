"""What only online RL checks and prints, reached through its descriptor's hooks (``rlhf.trainers.online.runner.PPO``):
the start-up checks of the preflight (the engines' contexts against the models' positions, the reward functions, the
environment, the judge, the reward model's head, the critic's batch), ``--dry-run``'s rollout and batch lines, the
audit's findings on the rollout batch and its overrides for a split. The generic rooms (:mod:`rlhf.trainers.preflight`,
:mod:`rlhf.cli.dry_run`, :mod:`rlhf.audit`) call the hooks and never ask a config which trainer it is for."""

from __future__ import annotations

import importlib.util
import os
from typing import List, Optional

from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.vocab import check_same_tokenizer
from rlhf.distributed.resource_plan import (
    ROLLOUT,
    Devices,
    ResourcePlan,
    engine_gpus,
    engine_sleep,
    offloaded_roles,
    sleeping_roles,
)
from rlhf.envs import EnvError, load_environment
from rlhf.hub import cached_model_dir, model_dir
from rlhf.models.checks import Positions, check_scalar_head, model_positions
from rlhf.ops.algorithms import describe as describe_algorithm
from rlhf.ops.algorithms import needs_length
from rlhf.ops.distill import DIVERGENCES
from rlhf.trainers.descriptor import Row
from rlhf.trainers.findings import ERROR, WARNING, Finding, epoch_findings
from rlhf.trainers.preflight import NOT_HERE, model_status, readable
from rlhf.utils.metrics import plural
from rlhf.utils.specs import looks_like_path


def start_up_checks(cfg: RLRunConfig, here: bool) -> List[Row]:
    """The preflight's RL checks (``TrainerKind.checks``): each engine's context within its model's positions, the
    judge's template fields, the reward model's scalar head, the critic's batch; refused by key
    (:class:`ConfigError`). Returns the rows of what they read: the reward functions (``--dry-run`` loads them; a
    run's scorer does), the environment class, the judge model."""
    check_engine_context(cfg)
    rows: List[Row] = []
    if not here:  # a run loads them into its scorer (rlhf.rewards.functions)
        rows += [("reward.functions", spec, reward_function_status(spec)) for spec in cfg.reward.functions]
    if cfg.env.spec:
        rows.append(("env.spec", cfg.env.spec, environment_status(cfg.env.spec, here)))
    if cfg.reward.judge.path:
        from rlhf.rewards.judge_spec import JudgeSpec  # lazy: pulls in torch

        spec = JudgeSpec.of(cfg.reward.judge, seed=cfg.train.seed)  # the question, pattern and parsing keys
        _check_judge_fields(cfg, spec)
        _check_judge_context(cfg)
        path = cfg.reward.judge.path
        rows.append(("reward.judge.path", path, model_status("reward.judge.path", path, here)))
    if cfg.algo.teacher.path:
        rows.append(("algo.teacher.path", "(its tokenizer)", _teacher_tokenizer(cfg, here)))
    if cfg.reward.model_path and readable(cfg.reward.model_path, here):
        check_scalar_head(model_dir(cfg.reward.model_path), "reward.model_path", cfg.reward.model_path)
    if cfg.critic_batch_problem():
        raise ConfigError(cfg.critic_batch_problem())
    return rows


def _teacher_tokenizer(cfg: RLRunConfig, here: bool) -> str:
    """The distillation teacher's tokenizer, compared with the policy's when both models' files are on this machine
    (refused by key when they read an id differently); its folder is checked with the run's models."""
    teacher, policy = cfg.algo.teacher.path, cfg.model.tokenizer_path or cfg.model.path
    if not (readable(teacher, here) and readable(policy, here)):
        return "compared with the policy's by the run"
    return f"equal to the policy's ({check_same_tokenizer(policy, teacher, 'algo.teacher.path')} tokens)"


def policy_positions(cfg: RLRunConfig) -> Optional[Positions]:
    """The positions of ``model.path`` (the policy engines' model) if this machine has its files, else ``None``."""
    folder = cached_model_dir(cfg.model.path)
    return model_positions(folder) if folder else None


def check_engine_context(cfg: RLRunConfig) -> None:
    """The policy engines' ``max_model_len`` (:attr:`~rlhf.config.rl_schema.RLRunConfig.engine_context`) within
    the policy model's positions. vLLM refuses a longer one only at engine start, inside a Ray actor, after the
    cluster and the policy started, and suggests ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``, which runs positions the
    model never learned (NaNs with RoPE). A model whose files are not here is left to vLLM."""
    positions = policy_positions(cfg)
    context, keys = cfg.engine_context, cfg.engine_context_keys
    if positions is None or context <= positions.limit:
        return
    r = cfg.rollout
    first = r.max_episode_tokens if cfg.multi_turn else r.max_prompt_length
    raise ConfigError(
        f"{keys} ({first} + {r.max_new_tokens} = {context}), the policy engines' max_model_len, is above the "
        f"{positions.limit} positions of model.path {cfg.model.path!r} ({positions.source}): vLLM would refuse it "
        f"when the engines start. Lower {' or '.join(keys.split(' + '))} to sum to at most {positions.limit}, or use "
        f"a model with more positions"
    )


def _check_judge_context(cfg: RLRunConfig) -> None:
    """``reward.judge.max_model_len`` within the judge model's positions, for the reason of
    :func:`check_engine_context`; a judge whose files are not here is left to vLLM."""
    j = cfg.reward.judge
    folder = cached_model_dir(j.path)
    positions = model_positions(folder) if folder else None
    if positions is None or j.max_model_len <= positions.limit:
        return
    raise ConfigError(
        f"reward.judge.max_model_len ({j.max_model_len}), the judge engines' context, is above the "
        f"{positions.limit} positions of reward.judge.path {j.path!r} ({positions.source}): vLLM would refuse it "
        f"when the judge's engines start. Lower reward.judge.max_model_len to at most {positions.limit} (above "
        f"reward.judge.max_new_tokens={j.max_new_tokens}), or use a judge model with more positions"
    )


def _check_judge_fields(cfg: RLRunConfig, spec) -> None:
    """The judge's template may use its own fields and the columns each sample has: ``reward.columns`` (the data
    reader refuses a row without one the template reads, :func:`rlhf.trainers.online.runner.row_fields`) and an
    episode's :data:`~rlhf.rollout.sources.EPISODE_COLUMNS`; any other field would stop the run at its first
    scoring."""
    from rlhf.rollout.sources import EPISODE_COLUMNS  # lazy: pulls in torch

    columns = (*cfg.reward.columns, *(EPISODE_COLUMNS if cfg.multi_turn else ()))
    unknown = [f for f in spec.column_fields if f not in columns]
    if unknown:
        raise ConfigError(
            f"reward.judge.template uses {{{unknown[0]}}}, which no sample has: a {spec.mode} judge fills "
            f"{', '.join('{' + f + '}' for f in spec.own_fields)}, and the other fields come from reward.columns "
            f"({', '.join(cfg.reward.columns) or 'none'})"
            + (f" or an episode's {' and '.join(EPISODE_COLUMNS)}" if cfg.multi_turn else "")
            + f"; add {unknown[0]} to reward.columns or fix the template"
        )


def reward_function_status(spec: str) -> str:
    """Load a reward function that resolves here (a bad one is an error); one that does not is left to the run."""
    from rlhf.rewards.functions import RewardFunctionScorer, load_reward_function  # lazy: pulls in torch

    RewardFunctionScorer((spec,))  # spec form and weight, nothing imported
    head, at, tail = spec.rpartition("@")
    name = head if at and ":" not in tail else spec
    if not _resolves_here(name.rpartition(":")[0]):
        return NOT_HERE
    load_reward_function(name)
    return "found, loads"


def _resolves_here(target: str) -> bool:
    """Whether the file or the top-level module a spec's target names exists on this machine (nothing imported)."""
    if looks_like_path(target):
        return os.path.isfile(target)
    return importlib.util.find_spec(target.split(".")[0]) is not None


def environment_status(spec: str, here: bool) -> str:
    """Load the environment class (a bad one is an error); under ``--dry-run`` one whose module is not on this
    machine is left to the run."""
    if not here and not _resolves_here(spec.strip().rpartition(":")[0]):
        return NOT_HERE
    try:
        load_environment(spec)
    except EnvError as e:
        raise ConfigError(f"env.spec: {e}") from None
    return "found, loads"


# ---------------------------------------------------------------------------------------------------- --dry-run


def describe(cfg: RLRunConfig, plan: ResourcePlan, devices: Devices) -> List[str]:
    """Engines, devices per engine, vLLM sleep mode and the weight-sync transport, as the RL runner resolves them."""
    from rlhf.rollout.weights.sync import resolve_weight_sync  # lazy: pulls in torch

    r, c = cfg.rollout, cfg.colocate
    engines = next(a for a in plan.actors if a.role == ROLLOUT)
    sleep = engine_sleep(c, engine_gpus(r.tensor_parallel_size, devices.gpus_per_worker))
    sleepers = sleeping_roles(c, devices.gpus_per_worker)
    offloaded = offloaded_roles(cfg, devices.gpus_per_worker)
    sync = resolve_weight_sync(r.weight_sync, hybrid_engine=c.hybrid_engine, gpus_per_engine=engines.gpus)
    device = (f"{r.tensor_parallel_size:g} GPU" if engines.gpus >= 1 else "CPU") + " per engine"
    if engines.group:
        device = f"engine e on policy rank e's {'device' if engines.gpus else 'bundle'} (colocate.hybrid_engine)"
    backend = "nccl" if engines.gpus > 0 and devices.gpus_per_worker > 0 else "gloo"  # both ends on GPUs
    transport = {
        "ipc": "CUDA IPC handles, policy rank e -> engine e on their shared device",
        "object_store": "buckets through the Ray object store",
        "broadcast": f"policy rank 0 -> every engine worker over a {backend} process group",
    }.get(sync, sync)
    context = f"{cfg.engine_context} ({cfg.engine_context_keys}" + (
        ": a turn may sample past the episode's budget, which keeps what fits)" if cfg.multi_turn else ")"
    )
    positions = policy_positions(cfg)  # a longer context was refused by the preflight
    context += (
        f", within the model's {positions.limit} positions ({positions.source})"
        if positions
        else "; the model's positions are checked by the run (its config.json is not on this machine)"
    )
    lines = [
        f"rollout: {plural(r.num_engines, 'vLLM engine')}, tensor_parallel_size {r.tensor_parallel_size}, {device}",
        f"  max_model_len {context}",
        f"  vLLM sleep mode: {'on' if sleep else 'off'} (colocate.engine_sleep={c.engine_sleep})",
        f"  trainer sleep: {', '.join(sleepers) + ' in host memory while the engines generate' if sleepers else 'off'}"
        f" (colocate.trainer_sleep={c.trainer_sleep})",
        f"  frozen offload: {', '.join(offloaded) + ' in host memory between their passes' if offloaded else 'off'}"
        f" (colocate.offload_frozen={c.offload_frozen})",
        f"  weight sync: {sync}: {transport} (rollout.weight_sync={r.weight_sync}), "
        f"{r.weight_sync_bucket_mb} MB buckets",
        "  " + cfg.describe_schedule(),
    ]
    for role, path, key, held in (
        ("reference", cfg.model.ref_path or cfg.model.path, "reference_in_policy", c.reference_in_policy),
        ("teacher", cfg.algo.teacher.path, "teacher_in_policy", c.teacher_in_policy),
    ):
        if held:
            lines.append(
                f"{role}: {path}, a frozen copy in each policy rank's own process (colocate.{key}): no {role} workers"
            )
    if cfg.multi_turn:
        e = cfg.env
        lines += [
            f"environment: {e.spec} on {plural(e.num_actors, 'actor')}, {e.step_timeout_s:g} s per reset or "
            f"step at most (env.step_timeout_s)",
            f"  episodes: up to {r.max_turns} turns and {r.max_episode_tokens} tokens each, then "
            f"rollout.episode_limit={r.episode_limit}; observations: rollout.observation_format="
            f"{r.observation_format}; an episode is one sample of the rollout batch",
        ]
    return lines


def batch_lines(cfg: RLRunConfig, lines: List[str]) -> List[str]:
    """``--dry-run``'s batch lines of online RL (``TrainerKind.batch_lines``): the rollout batch first, then
    ``lines`` (the global batch, LoRA), then the optimizer steps, the LR schedule and the algorithm."""
    t, r, a = cfg.train, cfg.rollout, cfg.algo
    dropped = r.samples_per_step % t.global_batch_size
    lines.insert(
        0,
        f"  RL step: {r.prompts_per_step} prompts x {r.n_samples_per_prompt} samples = rollout batch "
        f"{r.samples_per_step} ({-(-r.samples_per_step // r.num_engines)} samples per engine)",
    )
    lines.append(
        f"  optimizer steps per RL step: algo.ppo_epochs {a.ppo_epochs} x floor({r.samples_per_step} / "
        f"{t.global_batch_size}) = {cfg.optimizer_steps_per_rl_step}"
        + (f" ({dropped} samples per pass dropped)" if dropped else "")
    )
    if a.needs_critic:
        lines.append(f"  critic: {t.describe_batching(cfg.critic.num_workers)}")
    lines.append(
        f"  RL steps: min(train.max_steps={t.max_steps}, train.max_epochs={t.max_epochs} x "
        f"floor(prompts / {r.prompts_per_step})), prompts counted at run time"
    )
    decay = (
        "constant"
        if t.lr_scheduler == "constant"
        else f"{t.lr_scheduler} towards lr x {t.min_lr_ratio} over the run's optimizer steps (RL steps x "
        f"{cfg.optimizer_steps_per_rl_step})"
    )
    lines.append(f"  LR: warmup {t.warmup_steps} optimizer steps, then {decay}; skipped steps advance it")
    lines.append(
        f"  loss aggregation: {a.describe_aggregation()}"
        + (f", L = {cfg.max_response_tokens} tokens (the generation budget)" if needs_length(a.aggregation) else "")
    )
    lines.append(f"  clip: {a.describe_clip()}")
    algorithm = describe_algorithm(a.advantage_estimator, a.policy_loss, a.kl_mode, a.kl_estimator, a.kl_coef)
    lines += [f"  {line}" for line in algorithm]
    if a.teacher.path:
        lines.append(f"  {describe_distillation(cfg)}")
    return lines


def describe_distillation(cfg: RLRunConfig) -> str:
    """One line on the on-policy distillation term (``--dry-run``, the run's first lines)."""
    t, a = cfg.algo.teacher, cfg.algo
    where = (
        f"-{t.coef:g} x it in the token rewards, read by {a.advantage_estimator}"
        if t.mode == "reward"
        else f"+{t.coef:g} x it in each response token's policy loss, aggregated with it ({a.describe_aggregation()})"
    )
    alone = "alone (no task reward)" if cfg.distills_alone else "with the task reward"
    if t.on_distributions:
        entry = DIVERGENCES.get(t.divergence)
        name = entry.title + (f" (beta {t.beta:g})" if entry.beta else "")
        what = (
            f"{name} of the policy's next-token distributions from algo.teacher.path's, on the teacher's top "
            f"{t.top_k} tokens and a tail"
        )
    else:
        what = f"reverse KL of the policy from algo.teacher.path on the sampled tokens ({t.resolved_estimator})"
    return f"distillation: {what}, {where}; {alone}"


# -------------------------------------------------------------------------------------------------------- audit


def lint_batches(cfg: RLRunConfig, prompts: Optional[int]) -> List[Finding]:
    t, r = cfg.train, cfg.rollout
    """The audit's findings on the rollout batch (``TrainerKind.lint_batches``): the epochs the prompts give, samples
    left out of every pass, the critic's batch, and the algorithm settings that do not do what their names say."""
    key = "rollout.prompts_per_step"
    found = [] if prompts is None else epoch_findings(r.prompts_per_step, key, "prompts", prompts, t)
    samples, batch = r.samples_per_step, t.global_batch_size
    if samples % batch:
        found.append(
            Finding(
                WARNING,
                f"train.global_batch_size={batch}",
                f"each rollout batch of {samples} samples (rollout.prompts_per_step x "
                f"rollout.n_samples_per_prompt) gives {samples // batch} optimizer steps and leaves "
                f"{samples % batch} samples out of every pass: generated and scored, never trained on",
            )
        )
    if cfg.critic_batch_problem():
        found.append(Finding(ERROR, f"critic.num_workers={cfg.critic.num_workers}", cfg.critic_batch_problem()))
    return found + _algorithm_findings(cfg)


def _algorithm_findings(cfg: RLRunConfig) -> List[Finding]:
    """Settings the config accepts whose effect is not what their names suggest (the registry entries' facts)."""
    a, found = cfg.algo, []
    if a.aggregation == "seq-mean-token-sum" and cfg.train.max_grad_norm > 0:
        found.append(
            Finding(
                WARNING,
                "algo.loss_agg_mode=seq-mean-token-sum",
                f"sums each response's ~{cfg.max_response_tokens} token losses, so the gradient norm is "
                f"~{cfg.max_response_tokens}x the per-token scale and train.max_grad_norm="
                f"{cfg.train.max_grad_norm:g} clips almost every step (a clipped step no longer follows "
                f"its gradient's size); seq-mean-token-sum-norm is the same objective over the "
                f"generation budget, Dr. GRPO's",
            )
        )
    entry, clip = a.policy_loss_entry, a.clip
    if not entry.sequence_level or clip is None:  # only a sequence-level ratio's clip range can be too wide
        return found
    low, high = clip
    if max(low / entry.clip_low, high / entry.clip_high) >= 10:
        found.append(
            Finding(
                WARNING,
                "algo.clip_low" if low / entry.clip_low >= 10 else "algo.clip_high",
                f"{low:g} / {high:g} with policy loss {a.policy_loss}: its ratio is a per-token geometric "
                f"mean over the sequence, which almost never leaves [1 - {low:g}, 1 + {high:g}], so it "
                f"runs unclipped; its paper clips at {entry.clip_low:g} / {entry.clip_high:g} (unset "
                f"algo.clip_low and algo.clip_high to train with it)",
            )
        )
    return found


def audit_overrides(cfg: RLRunConfig, micro: int, ranks: int) -> List[str]:
    """The audit's overrides for a split into ``ranks`` policy ranks (``TrainerKind.audit_overrides``): the groups
    tied to the policy's ranks follow (a critic with as many ranks, a colocated reward model, hybrid-engine
    vLLM engines)."""
    out = []
    if cfg.algo.needs_critic and cfg.critic.num_workers == cfg.train.num_workers:
        out.append(f"critic.num_workers={ranks}")
        if cfg.colocate.critic_reward:
            out.append(f"reward.model_num_workers={ranks}")
    if cfg.colocate.hybrid_engine:
        out.append(f"rollout.num_engines={ranks}")
    return out


def audit_split_fits(cfg: RLRunConfig, micro: int, ranks: int) -> bool:
    """With a critic, its ranks (tied to the policy's, or fixed) x ``micro`` must divide the global batch too
    (``TrainerKind.audit_split_fits``)."""
    if not cfg.algo.needs_critic:
        return True
    critic = ranks if cfg.critic.num_workers == cfg.train.num_workers else cfg.critic.num_workers
    return cfg.train.global_batch_size % (micro * critic) == 0
