"""Online RL steps: PPO (GAE + critic), GRPO, Dr. GRPO, RLOO, REINFORCE++ over vLLM rollouts.

One RL step reads like the algorithm::

    generate (vLLM; turn by turn with an environment) -> score (environment, reward functions, reward model)
    -> old & reference log-probs, values -> advantages over the whole rollout batch -> policy (and critic) updates
    -> weight sync -> log

With ``rollout.max_staleness = k >= 1`` the generate stage takes samples generated ``k`` steps earlier, and the
generation of step ``t + k`` runs on the engines while step ``t`` scores and trains
(:mod:`rlhf.trainers.online.schedule`); it ends before the weight sync, and a probe after the sync checks that it
landed (:meth:`RLTrainer.probe_sync`). ``k = 0`` is the synchronous trainer, call for call.

Each stage is one method of :class:`RLTrainer`; the maths lives in ``rlhf.ops`` and ``rlhf.objectives.actor_critic``,
the actors in ``rlhf.distributed`` and ``rlhf.rollout``. The run around the steps (checkpoints, the
health guard, logging, rewinds) is :class:`rlhf.trainers.run.Run`'s, the same as every trainer's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from rlhf.batch import Batch
from rlhf.config.rl_schema import RLRunConfig
from rlhf.data.plan import EpochPlan, StepPlan
from rlhf.distributed.group import WorkerGroup
from rlhf.distributed.resource_plan import TEACHER
from rlhf.distributed.sleep import moved_text
from rlhf.models.lora import OnBaseModel
from rlhf.objectives.actor_critic import (
    PolicyObjective,
    TeacherTopK,
    TokenLogps,
    TokenValues,
    ValueObjective,
    split_teacher_topk,
)
from rlhf.objectives.base import ScoreFn
from rlhf.ops.batch_advantages import advantages_for
from rlhf.ops.mismatch import logp_mismatch
from rlhf.rewards.scoring import reward_scorers
from rlhf.rollout.backend import RolloutBackend
from rlhf.rollout.episodes import rollout_batch
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.sources import Rollout, RolloutSource, SingleTurnRollout, staleness_metrics
from rlhf.rollout.types import SamplingSpec
from rlhf.trainers.online.draws import draw_until_varied, partial_single_turn
from rlhf.trainers.online.report import (
    CONSOLE_KEYS,
    EVAL_CONSOLE_KEYS,
    TABLE_COLUMNS,
    StageTimer,
    UpdateTotals,
    sample_stats,
    step_row,
)
from rlhf.trainers.online.schedule import Pause, RolloutSchedule, behaviour_version
from rlhf.trainers.online.scoring import StepScoring, reward_sources
from rlhf.utils.log import get_logger
from rlhf.utils.metrics import ConsoleTable, Progress, format_row

log = get_logger(__name__)

# Metrics the health guard keeps finite. No zero-loss check: an RL step whose groups all tie has a zero loss.
RL_WATCHED = ("policy_loss", "grad_norm", "kl", "value_loss", "critic_grad_norm", "reward_mean")
EVAL_SEED_BASE = 1 << 40  # evaluation seeds live far from the training steps' (seed * 1_000_003 + step * 10_007 + j)
DRAW_SEED_BASE = 1 << 42  # dynamic sampling's draw d of a step: d * this + the step's base (far from both)
PROBE_SEED = 3 << 40  # the weight-sync probe's requests: this + j, every step (between evaluation's and draw 1's)
PROBE_SAMPLES = 4  # requests of the probe (k >= 1): enough tokens that one layer not synced shows, few to cost little
PROBE_TOKENS = 16  # new tokens each, at most (rollout.max_new_tokens if fewer)


@dataclass
class RLActors:
    """The run's actors by role; the optional ones exist when the config asks for them."""

    policy: WorkerGroup  # trainable
    engines: RolloutBackend  # the vLLM engine actors (rlhf.rollout.vllm.engines.RolloutEngines)
    reference: Optional[WorkerGroup] = None  # frozen, when a KL term is used
    reference_is_base: bool = False  # LoRA: the KL reference is the policy's own frozen base (no reference group)
    teacher: Optional[WorkerGroup] = None  # frozen, for on-policy distillation (algo.teacher.path)
    critic: Optional[WorkerGroup] = None  # trainable, for GAE
    reward_model: Optional[WorkerGroup] = None  # frozen scalar head
    # colocate.trainer_sleep: the roles on the engines' devices that sleep while the engines generate
    sleepers: Tuple[str, ...] = ()
    # colocate.offload_frozen: the frozen roles held in host memory between their scoring passes (offloaded_roles)
    offloaded: Tuple[str, ...] = ()

    def frozen(self, role: str) -> Optional[Callable[[Batch, ScoreFn], torch.Tensor]]:
        """How the frozen model of ``role`` (``reference``, ``teacher``) scores a batch (``score_batch``): on its
        own group, or on the copy the policy's ranks hold (``WorkerGroup.hold``); None if the run has none."""
        group = self.frozen_groups()[role]
        if group is not None:
            return group.score_batch
        return functools.partial(self.policy.score_batch, on=role) if role in self.policy.held else None

    def perf_metrics(self) -> Dict[str, float]:
        """Every trainer group's ``perf/<role>/...`` metrics since the last call (WorkerGroup.perf_metrics)."""
        return {k: v for group in self.trainer_groups() for k, v in group.perf_metrics().items()}

    def frozen_groups(self) -> Dict[str, Optional[WorkerGroup]]:
        """The frozen roles' groups of their own, by role (None where the run has none: no such model, or a copy the
        policy's ranks hold)."""
        return {"reference": self.reference, TEACHER: self.teacher, "reward_model": self.reward_model}

    def offload_frozen(self) -> Dict[str, List[int]]:
        """``colocate.offload_frozen``: the frozen models of :attr:`offloaded` to host memory until each next scores
        (a sleeping rank wakes itself to score): a group's ranks sleep whole, the copies the policy's ranks hold sleep
        alone, beside the model those train. The bytes each rank moved, by role."""
        groups, moved = self.frozen_groups(), {}
        for role in self.offloaded:
            group = groups[role]
            if group is not None:
                moved[role] = group.sleep()
        held = [role for role in self.offloaded if role in self.policy.held]
        if held:
            moved[f"{' + '.join(held)} (in the policy's ranks)"] = self.policy.sleep_held(held)
        return moved

    def sleeping_groups(self) -> Tuple[WorkerGroup, ...]:
        """The groups of :attr:`sleepers`, which hand their devices to the engines while these generate."""
        return tuple(group for group in self.trainer_groups() if group.role in self.sleepers)

    def trainer_groups(self) -> Tuple[WorkerGroup, ...]:
        """The trainer-side groups the run holds (policy, reference, teacher, critic, reward model)."""
        groups = (self.policy, self.reference, self.teacher, self.critic, self.reward_model)
        return tuple(group for group in groups if group is not None)


class RLTrainer:
    """The RL steps of a run (:class:`rlhf.trainers.run.Steps`): :meth:`train` is one RL step."""

    name = "rl"
    watched = RL_WATCHED
    zero_loss_key = None
    # KL to the reference, and the trainer / engine log-prob gap (the behaviour / proximal gap when asynchronous)
    ceilings = ("kl", "logp_mismatch")
    flat_key: Optional[str] = "reward_std"  # every sample of the step scored the same: no advantage anywhere
    eval_console_keys = EVAL_CONSOLE_KEYS
    evaluates_start = True  # the starting point, on the same held-out samples as every later evaluation

    def __init__(
        self,
        cfg: RLRunConfig,
        tokenizer,
        prompts: PromptSet,
        plan: EpochPlan,
        actors: RLActors,
        scorer,
        policy_objective: PolicyObjective,
        value_objective: Optional[ValueObjective],
        eval_prompts: Optional[PromptSet] = None,
        source: Optional[RolloutSource] = None,
    ) -> None:
        self.cfg, self.tokenizer, self.prompts, self.plan = cfg, tokenizer, prompts, plan
        self.actors, self.eval_prompts = actors, eval_prompts
        # the step's reward: the environment's, the reward functions' (driver or actors), HTTP, the judge, the reward
        # model's, then shaping and limits (rlhf.trainers.online.scoring)
        self.scoring = StepScoring(cfg, reward_sources(cfg, reward_scorers(scorer), actors.reward_model))
        if cfg.algo.teacher.path:  # tied scores still leave the teacher's term to learn from (alone: every score 0)
            self.flat_key = None
        # where the samples come from (env.spec: an environment's or an agent's episodes); None: single-turn
        self.source: RolloutSource = source if source is not None else SingleTurnRollout(tokenizer)
        self.policy_objective, self.value_objective = policy_objective, value_objective
        columns = [c for c in TABLE_COLUMNS if c[0] != "value_loss" or actors.critic is not None]
        self.table = ConsoleTable(columns) if cfg.logging.console == "table" else None
        self._told_sleep = False  # sleep_trainers() logs what the first sleep moved
        self._told_offload = False  # offload_frozen() logs what the first offload moved

    @functools.cached_property
    def schedule(self) -> RolloutSchedule[Rollout]:
        """Which weights generate each step's samples, and the generation running ahead (``rollout.max_staleness``)."""
        r = self.cfg.rollout
        return RolloutSchedule(
            r.max_staleness, self.plan.total_steps, self._generate_step, partial=bool(r.partial_rollout_tokens)
        )

    @property
    def has_eval(self) -> bool:
        return self.eval_prompts is not None

    def resume(self, done: int) -> None:
        # the engines hold model.path (resume) or a later step's weights (rewind): step done's, checked on arrival
        self.push_weights(done)

    def train(self, step: StepPlan) -> dict:
        """One RL step (the module docstring's pipeline); returns its logged row."""
        timer = StageTimer()
        with timer("generate"):
            self.sleep_trainers(tell=False)  # colocate.trainer_sleep: asleep already but at the run's first generate
            rollout = self.schedule.take(step.step)  # k >= 1: the generation of step + k starts on the engines
            self.actors.engines.sleep()  # hybrid engine on GPUs: hand the devices to training
            self.wake_trainers()
        with timer("score"):
            scores, per_source = rollout.scored or self.score(rollout, self.prompts)
        with timer("logprobs"):
            batch = self.annotate(rollout.batch)
        if self.actors.offloaded:  # every frozen model has scored the step: its device memory to the update's
            with timer("offload"):
                self.offload_frozen()
        failed = rollout.failures()  # out of every statistic of the step (rlhf.ops.failures)
        batch, kl_stats = self.advantages(
            batch, scores, rollout.prompt_index, self.scoring.turn_credit(rollout), failed
        )
        with timer("train"):
            train_stats = self.update(self.scoring.trained_rows(batch, rollout), step.step)
        if self.schedule.staleness:
            with timer("wait"):  # the generation running ahead ends (or pauses) before the weights change
                self.schedule.settle_for_push()
        with timer("sync"):
            sync = self.push_weights(step.step)
        probed = self._probe_after_push(timer)  # before pushed(): a paused generation leaves the engines idle
        self.schedule.pushed(step.step)
        stats = {**rollout.metrics, **train_stats, **kl_stats, **self._staleness(step.step, rollout)}
        stats.update(self.actors.perf_metrics())
        return step_row(self.prompts, step, scores, per_source, batch, stats, sync, timer, failed, sync_mismatch=probed)

    def _probe_after_push(self, timer: StageTimer) -> Optional[float]:
        """``k >= 1``: :meth:`probe_sync` of the weights just pushed (``time/probe``); ``k = 0``: ``None``, the
        step's own samples show it (``logp_mismatch`` in :func:`~rlhf.trainers.online.report.step_row`), and the
        synchronous step makes no extra call."""
        if not self.schedule.staleness:
            return None
        with timer("probe"):
            return self.probe_sync()

    def probe_sync(self) -> Optional[float]:
        """Mean |trainer - engine| log-prob on a probe both scored with the same weights: whether the last weight
        sync landed (``sync_mismatch``; ~1e-7 when it did).

        Why a probe: with ``rollout.max_staleness = k >= 1`` the step's samples were sampled by weights ``k``
        updates older than the trainer's, so their gap (``logp_mismatch``) is the behaviour / proximal one, and the
        step's tokens sampled by the trainer's own weights exist only with partial rollouts at ``k = 1``. The probe
        is exact in every mode: right after the push the engines sample :data:`PROBE_SAMPLES` replies of at most
        :data:`PROBE_TOKENS` tokens to the first training prompt (fixed seeds, the trainer's sampling) and the
        policy scores them with the distribution sampled, as :meth:`annotate` does."""
        r = self.cfg.rollout
        sampling = dataclasses.replace(
            self._sampling(self.prompts, PROBE_SEED), max_new_tokens=min(r.max_new_tokens, PROBE_TOKENS)
        )
        generations = self.actors.engines.generate([self.prompts.prompt_ids[0]] * PROBE_SAMPLES, sampling)
        batch = rollout_batch(generations, self.tokenizer.pad_token_id)
        logps = TokenLogps(temperature=r.temperature, sampling_filter=r.sampling_filter)
        return logp_mismatch(batch.replace(old_logps=self.actors.policy.score_batch(batch, logps)))

    def _generate_step(self, step: int, pause: Optional[Pause] = None) -> Rollout:
        """Step ``step``'s samples with the engines' current weights, each sampled token recording the version
        that generated it (the schedule's, :func:`~rlhf.trainers.online.schedule.behaviour_version`); with a ``pause``
        (partial rollouts), the responses' first tokens before it, the rest with the next weights (:meth:`_partial`)."""
        if pause is not None:
            return self._partial(self.plan.step(step), pause)
        rollout = self.generate(self.plan.step(step))
        if not self.schedule.staleness:
            return rollout
        mask = rollout.batch.loss_mask
        assert mask is not None, "a rollout batch carries its loss mask"
        version = behaviour_version(step, self.schedule.staleness)
        rollout.token_versions = torch.where(mask != 0, version, -1)
        return rollout

    def _partial(self, step: StepPlan, pause: Pause) -> Rollout:
        """The step's responses in two halves around ``pause``
        (:func:`~rlhf.trainers.online.draws.partial_single_turn`): the first ``rollout.partial_rollout_tokens`` with
        the schedule's version, the rest with the next."""
        r = self.cfg.rollout
        prompt_index = [i for i in step.indices for _ in range(r.n_samples_per_prompt)]
        sampling = self._sampling(self.prompts, self._seed_base(step.step))
        version = behaviour_version(step.step, r.max_staleness)
        return partial_single_turn(
            self.actors.engines, self.tokenizer, self.prompts, prompt_index, sampling, r, pause, version
        )

    def _staleness(self, step: int, rollout: Rollout) -> dict:
        """``async/*`` of the step's samples (:func:`~rlhf.rollout.sources.staleness_metrics`)."""
        if not self.schedule.staleness or rollout.token_versions is None:
            return {}
        return staleness_metrics(step, rollout.token_versions, self.schedule.times)

    # ---------------------------------------------------------------------------------------- stages
    def generate(self, step: StepPlan) -> Rollout:
        """``n_samples_per_prompt`` samples (or episodes) of each prompt of the step, spread over the engines; with
        ``rollout.dynamic_sampling``, of prompts drawn until the step's groups differ (:meth:`_dynamic`)."""
        r = self.cfg.rollout
        prompt_index = [i for i in step.indices for _ in range(r.n_samples_per_prompt)]
        rollout = self._sample(self.prompts, prompt_index, self._seed_base(step.step), step.step)
        return self._dynamic(step, rollout) if r.dynamic_sampling else rollout

    def _seed_base(self, step: int, draw: int = 0) -> int:
        """Sample ``j`` of ``step``'s draw ``draw`` (dynamic sampling; 0: the plan's prompts) has seed base + j."""
        return draw * DRAW_SEED_BASE + self.cfg.train.seed * 1_000_003 + step * 10_007

    def _dynamic(self, step: StepPlan, first: Rollout) -> Rollout:
        """DAPO's dynamic sampling (:func:`~rlhf.trainers.online.draws.draw_until_varied`): more prompts drawn, with
        seeds of the step's own, until the step holds ``rollout.prompts_per_step`` groups whose scores differ."""
        return draw_until_varied(
            first,
            step,
            self.cfg.rollout,
            len(self.prompts.prompt_ids),
            sample=lambda prompt_index, seed_base: self._sample(self.prompts, prompt_index, seed_base, step.step),
            score=lambda rollout: self.score(rollout, self.prompts),
            seed_base=lambda draw: self._seed_base(step.step, draw),
            pad_id=self.tokenizer.pad_token_id,
        )

    def _sampling(self, prompts: PromptSet, seed_base: int) -> SamplingSpec:
        r = self.cfg.rollout
        # Sample j is drawn with seed base + j whichever engine serves it: reproducible rollouts that do not
        # depend on rollout.num_engines.
        return SamplingSpec(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=seed_base,
            stop_token_ids=prompts.stop_token_ids or (self.tokenizer.eos_token_id,),
        )

    def _sample(self, prompts: PromptSet, prompt_index: List[int], seed_base: int, step: int) -> Rollout:
        return self.source(self.actors.engines, prompts, prompt_index, self._sampling(prompts, seed_base), step)

    def score(self, rollout: Rollout, prompt_set: PromptSet) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Summed reward per sample and each source's ``(B,)`` scores (:meth:`StepScoring.score`)."""
        return self.scoring.score(rollout, prompt_set)

    def annotate(self, batch: Batch) -> Batch:
        """Per-token log-probs of the policy that generated the batch (pi_old), of the reference and the
        distillation teacher, and values:
        ``(B, T)`` each, float32 (float64 from an fp64 run's models). Every group scores in chunks of its build's
        micro-batch size, ``train.micro_batch_size`` for each (rlhf.trainers.online.roles.start_roles)."""
        a = self.actors
        r = self.cfg.rollout
        # the distribution the engines sampled from: tempered, cut to the top-k / top-p set (the reference's own)
        logps = TokenLogps(temperature=r.temperature, sampling_filter=r.sampling_filter)
        batch = batch.replace(old_logps=a.policy.score_batch(batch, logps))
        # a frozen model scores on its own group, or on the copy the policy's ranks hold
        reference, teacher = a.frozen("reference"), a.frozen(TEACHER)
        if reference is not None:
            batch = batch.replace(ref_logps=reference(batch, logps))
        elif a.reference_is_base:  # LoRA: the policy's frozen base, adapters off
            batch = batch.replace(ref_logps=a.policy.score_batch(batch, OnBaseModel(logps)))
        if teacher is not None and self.cfg.algo.teacher.on_distributions:  # GKD: its top-k of every distribution
            scored = teacher(batch, TeacherTopK(self.cfg.algo.teacher.top_k, r.temperature))
            topk_logps, topk_ids = split_teacher_topk(scored)
            batch = batch.replace(teacher_topk_logps=topk_logps, teacher_topk_ids=topk_ids)
        elif teacher is not None:  # distillation: the teacher scores the sampled tokens as the reference does
            batch = batch.replace(teacher_logps=teacher(batch, logps))
        if a.critic is not None:
            batch = batch.replace(values=a.critic.score_batch(batch, TokenValues()))
        return batch

    def advantages(
        self,
        batch: Batch,
        scores: torch.Tensor,
        prompt_index: List[int],
        turn_rewards: Optional[torch.Tensor] = None,
        failed: Optional[torch.Tensor] = None,
    ):
        """Advantages over the whole rollout batch (:func:`rlhf.ops.batch_advantages.advantages_for`); the ``failed``
        samples and, for a group estimator, their groups are out of the step: no advantage, no loss, in no statistic."""
        a = self.cfg.algo
        return advantages_for(
            batch,
            scores,
            torch.tensor(prompt_index, dtype=torch.long),
            turn_rewards=turn_rewards,
            estimator=a.advantage_estimator,
            gamma=a.gamma,
            lam=a.lam,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
            kl_in_reward=a.kl_mode == "reward",
            whiten_advantages=a.whiten_advantages,
            failed=failed,
            distill_coef=a.teacher.coef_in("reward"),
            distill_estimator=a.teacher.resolved_estimator,
        )

    def update(self, batch: Batch, rl_step: int) -> dict:
        """``algo.ppo_epochs`` passes over the rollout batch in exact global train batches (policy, critic).

        The returned numbers are the RL step's global quantities (docs/concepts.md, "Steps and the LR schedule"):
        each objective's sums over *all* the step's optimizer steps divided once by their summed normalizer, so they
        do not depend on how the rollout batch was shuffled into optimizer steps. ``num_tokens`` is the loss tokens
        trained on (summed over the optimizer steps), ``lr`` the LR of the last optimizer step, ``grad_norm`` the
        largest pre-clip norm among them (a non-finite one wins), ``optimizer_steps`` how many there were. Under a
        token budget, ``micro_batches`` and ``fillers`` (``critic_*`` for the critic) are summed over them.
        """
        t, a = self.cfg.train, self.cfg.algo
        plan = EpochPlan(
            num_samples=len(batch),
            global_batch_size=t.global_batch_size,
            max_epochs=a.ppo_epochs,
            seed=t.seed * 7919 + rl_step,
        )
        first = (rl_step - 1) * plan.total_steps  # the run's 0-based optimizer step where this RL step starts
        policy, critic = UpdateTotals(), UpdateTotals()
        empty = 0
        for train_step in plan.steps():
            rows = batch.select(train_step.indices)
            assert rows.loss_mask is not None, "a rollout batch carries its loss mask"
            if not bool(rows.loss_mask.any()):  # every episode masked (rollout.episode_limit=mask): nothing to learn
                empty += 1
                continue
            schedule_step = first + train_step.step - 1  # skipped RL steps advance the schedule too
            policy.add(self.actors.policy.train_batch(rows, self.policy_objective, schedule_step))
            if self.actors.critic is not None:
                assert self.value_objective is not None, "a critic is trained with its value objective"
                critic.add(self.actors.critic.train_batch(rows, self.value_objective, schedule_step))
        return {
            **critic.metrics(self.value_objective, "critic_"),
            **policy.metrics(self.policy_objective, ""),
            "optimizer_steps": plan.total_steps - empty,
            **({"optimizer_steps_empty": empty} if empty else {}),
        }

    def push_weights(self, version: Optional[int] = None) -> dict:
        """The policy's weights -> the engines as weight ``version`` (the step they come from), through the transport
        connected at start-up; every engine worker echoes the version and a checksum of what it received, checked
        against what was sent (:func:`rlhf.rollout.weights.senders.check_delivery`). Returns the transport's stats.

        Hybrid engine on GPUs (vLLM sleep mode, engines asleep since :meth:`train`'s generate): every trainer group
        first empties its CUDA cache, the engines map their weights back (contents undefined after a level-2 sleep),
        the sync fills them, and only then do the engines map their KV cache, so the sync's buckets and the cache
        never compete for the device. Without sleep mode (CPU) the engines' two wake calls run and do nothing.
        Every wake-up is thus followed by a full sync before the next generate.
        """
        a = self.actors
        if a.engines.sleeps:
            for group in a.trainer_groups():
                group.release_cached_memory()
        a.engines.wake_weights()
        sync = a.policy.push_weights(version)
        self.sleep_trainers()  # before the KV cache takes the device
        a.engines.wake_kv_cache()
        return sync

    def sleep_trainers(self, tell: bool = True) -> None:
        """``colocate.trainer_sleep``: the ranks on the engines' devices (:attr:`RLActors.sleepers`) hold their state
        in host memory until :meth:`wake_trainers` (or any call that needs it: a sleeping rank wakes itself). The
        first sleep after a step (``tell``: the optimizer's states exist by then) says how much each moved."""
        moved = {group.role: group.sleep() for group in self.actors.sleeping_groups()}
        if tell and not self._told_sleep and any(any(m) for m in moved.values()):
            self._told_sleep = True
            where = "in host memory while engines run"
            log.info(f"[rl] trainer sleep: {_sizes(moved)} (ranks x the most a rank moved) {where}")

    def offload_frozen(self) -> None:
        """``colocate.offload_frozen``: the frozen models hold their weights in host memory until they next score
        (:meth:`RLActors.offload_frozen`); the first offload says how much each moved."""
        moved = self.actors.offload_frozen()
        if not self._told_offload and any(any(m) for m in moved.values()):
            self._told_offload = True
            where = "in host memory between their passes"
            log.info(f"[rl] frozen offload: {_sizes(moved)} (ranks x the most a rank moved) {where}")

    def wake_trainers(self) -> None:
        for group in self.actors.sleeping_groups():
            group.wake()

    def evaluate(self, step: Optional[StepPlan]) -> dict:
        """Held-out prompts (``data.eval_path``), ``rollout.eval_samples_per_prompt`` samples each, scored like
        training samples; the run calls it before the first step, every ``train.eval_every`` steps and after the
        last. The seeds are the same at every evaluation, so successive rows differ only by the policy."""
        self.schedule.settle()  # partial rollouts: the generation running ahead ends before the engines evaluate
        n = self.cfg.rollout.eval_samples_per_prompt
        assert self.eval_prompts is not None, "the run evaluates only with has_eval, i.e. with eval_prompts"
        index = [i for i in range(len(self.eval_prompts.prompt_ids)) for _ in range(n)]
        rollout = self._sample(self.eval_prompts, index, EVAL_SEED_BASE + self.cfg.train.seed * 1_000_003, step=0)
        scores, per_source = self.score(rollout, self.eval_prompts)
        if self.actors.offloaded:  # the reward model scored the held-out samples
            self.offload_frozen()
        return {
            "step": step.step if step else 0,
            **sample_stats(scores, per_source, rollout.batch, rollout.failures()),
            **rollout.metrics,
            "num_samples": len(rollout.batch),
        }

    def console(self, row: dict, progress: Progress) -> str:
        if self.table is not None:
            return self.table.render({**row, "eta": progress.remaining()})
        return f"[rl] step {row['step']}/{progress.total} " + format_row(row, CONSOLE_KEYS) + f" ({progress.eta()})"


def _sizes(moved: Dict[str, List[int]]) -> str:
    """``role ranks x MiB`` for each role of ``moved`` (the bytes each of its ranks moved), the most a rank moved."""
    return ", ".join(f"{role} {moved_text(m)}" for role, m in moved.items())
