"""Typed, frozen run configurations.

Each section is a frozen dataclass that validates its own fields in ``__post_init__`` and names the dotted key
in every error (``train.micro_batch_size must be >= 1, got 0``). A run config (``SFTRunConfig`` ...) groups the
sections and checks the rules that span them (the global batch must split evenly over micro-batches and ranks).
Construction is validation: a config object that exists is a valid one, and it exists before any actor starts.

Load one with :func:`rlhf.config.loader.load_config` from YAML and dotted overrides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple, TypeVar


class ConfigError(ValueError):
    """A bad configuration value; the message names the dotted key."""


def check_setting(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key} {msg}")


def check_choice(value: str, key: str, choices: Tuple[str, ...]) -> None:
    check_setting(value in choices, key, f"must be one of {', '.join(choices)}; got {value!r}")


LORA_SYNCS = ("merged", "adapter")
# vLLM's max_lora_rank choices (vllm.config.lora): an adapter-serving engine takes the smallest that holds
# model.lora.r (rlhf.rollout.vllm.engine.engine_lora_rank), so model.lora.r must not pass the largest
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al. 2021) through PEFT on the trained model (and RL's critic): the base stays frozen,
    DPO/RL take it as their reference with no second copy of the weights (docs/long_sequences.md, "LoRA")."""

    r: int = 0  # adapter rank; 0 = off (the whole model trains)
    alpha: float = 16.0  # the adapter's update is (alpha / r) B A
    dropout: float = 0.0  # on the adapters' inputs; > 0 needs model.disable_dropout=false
    # module-name suffixes (q_proj, v_proj, ...) or all-linear (every Linear layer but the output head)
    target_modules: Tuple[str, ...] = ("all-linear",)
    save_merged: bool = True  # final/ holds the merged full model plus final/adapter/; false: the adapter only
    # RL weight sync into the vLLM engines: merged (W + (alpha / r) B A under the base's names, every tensor) |
    # adapter (A and B only; the engines serve the base plus the adapter: docs/lora_sync.md)
    sync: str = "merged"

    def __post_init__(self) -> None:
        # the form of target_modules is checked with the model's layers, before any actor starts
        # (rlhf.trainers.context.check_lora_targets, through rlhf.models.lora.LoraSpec)
        check_setting(self.r >= 0, "model.lora.r", f"must be an integer >= 0 (0 disables LoRA), got {self.r}")
        check_setting(
            self.alpha > 0 and math.isfinite(self.alpha),
            "model.lora.alpha",
            f"must be a finite number > 0 (the adapter is scaled by alpha / r), got {self.alpha}",
        )
        check_setting(0 <= self.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        check_setting(
            bool(self.target_modules),
            "model.lora.target_modules",
            "must name modules (e.g. [q_proj, v_proj]) or be [all-linear]",
        )
        check_choice(self.sync, "model.lora.sync", LORA_SYNCS)
        check_setting(
            not self.adapter_only or 0 < self.r <= VLLM_LORA_RANKS[-1],
            "model.lora.sync",
            f"is adapter, which needs LoRA on with a rank vLLM serves (0 < model.lora.r <= {VLLM_LORA_RANKS[-1]}); "
            f"model.lora.r is {self.r}",
        )

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def adapter_only(self) -> bool:
        """RL weight syncs send the adapter alone (``sync=adapter``)."""
        return self.sync == "adapter"


@dataclass(frozen=True)
class ModelConfig:
    """The model to train (policy for SFT/DPO/RL, the scorer for reward modelling)."""

    path: str = ""  # required: an HF model directory or a hub id (org/name[@revision])
    tokenizer_path: str = ""  # defaults to `path`
    ref_path: str = ""  # DPO/RL reference model; defaults to `path`
    attn_implementation: str = "auto"  # auto: flash_attention_2 on GPU in bf16/fp16 when flash_attn imports, else sdpa
    disable_dropout: bool = True  # dropout breaks split-vs-whole equivalence and RL log-prob ratios
    gradient_checkpointing: bool = False
    # Log-probs and entropies from the LM head applied in tiles (of tokens; the backward, without a sampling filter,
    # of the vocabulary), so a micro-batch's (tokens, vocabulary) logits never exist whole (rlhf/models/head.py): the
    # same numbers to rounding, less memory.
    tiled_head: bool = False
    # The gated MLP of each layer in tiles of positions, recomputed in the backward (rlhf/models/tiled_mlp.py,
    # DeepSpeed's TiledMLP): the same numbers, its (T, intermediate) activations never whole; for long rows.
    tiled_mlp: bool = False
    # torch.compile on each decoder layer (rlhf/models/compiled.py): fused norms, rotary and activations, the same
    # numbers to rounding; the first steps pay the compile. Measured in docs/performance.md.
    compile: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        check_setting(bool(self.path), "model.path", "is required (an HF model directory or a hub id, org/name)")
        check_choice(
            self.attn_implementation, "model.attn_implementation", ("auto", "sdpa", "eager", "flash_attention_2")
        )
        check_setting(
            self.lora.dropout == 0 or not self.disable_dropout,
            "model.lora.dropout",
            f"is {self.lora.dropout}, but model.disable_dropout=true: dropout draws from the RNG per micro-batch "
            f"(a different split trains differently) and breaks RL log-prob ratios; set model.disable_dropout="
            f"false to train with it",
        )

    @property
    def reference_is_initial(self) -> bool:
        """No other ``ref_path``: the DPO / RL reference is the model training starts from."""
        return self.ref_path in ("", self.path)

    @property
    def reference_is_base(self) -> bool:
        """With LoRA and no other ``ref_path``, the DPO / RL reference is the policy's own frozen base, scored with
        the adapters off: no reference workers, no second copy of the weights."""
        return self.lora.enabled and self.reference_is_initial


@dataclass(frozen=True)
class DataConfig:
    """Training data: JSONL, Parquet, or a directory written by ``datasets.save_to_disk``."""

    train_path: str = ""  # required: a file, a saved dataset directory, or a hub dataset id (org/name[@revision])
    eval_path: str = ""  # held-out data, same forms as data.train_path
    split: str = "train"  # split of data.train_path (a hub dataset or a saved DatasetDict)
    eval_split: str = ""  # split of data.eval_path; "" = data.split
    config_name: str = ""  # hub dataset: the configuration (subset) to read; "" = its default
    max_length: int = 512  # prompt + completion tokens; longer completions are truncated
    prompt_key: str = "prompt"  # text, or a list of {role, content} messages (conversational)
    response_key: str = "response"  # SFT completion: text, or a list of assistant messages
    messages_key: str = "messages"  # conversational SFT rows: one list of system/user/assistant messages
    tools_key: str = "tools"  # conversational rows (SFT, pairs, RL prompts): tool schemas for the template; "" = unread
    text_key: str = "text"  # SFT rows of plain text trained on whole (with EOS under data.add_eos); "" = refused
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str = "margin"  # optional per-pair margin for the reward model
    completion_key: str = "completion"  # unpaired preference rows (dpo.loss_type=kto): the one answer
    label_key: str = "label"  # unpaired preference rows: true = desirable answer, false = undesirable
    add_eos: bool = True  # plain-text rows: append the tokenizer's EOS to every completion
    # Conversational rows are rendered with a chat template (docs/your_model_and_data.md); plain text never is.
    chat_template: str = "auto"  # auto (the tokenizer's own) | none (conversational rows refused) | a .jinja file
    assistant_turns: str = "all"  # conversational SFT: loss on all assistant turns | last (only the final one)
    # RL: a text prompt is rendered as one user turn with the chat template (data.chat_template), as conversational
    # prompts are (an Instruct model's turns); false = the text as written (a base model, a prompt already formatted)
    template_text_prompts: bool = False

    def __post_init__(self) -> None:
        check_setting(
            bool(self.train_path),
            "data.train_path",
            "is required (JSON lines, Parquet, a saved dataset directory or a hub dataset id)",
        )
        check_setting(self.max_length >= 2, "data.max_length", f"must be >= 2, got {self.max_length}")
        check_choice(self.assistant_turns, "data.assistant_turns", ("all", "last"))
        check_setting(
            self.chat_template in ("auto", "none") or self.chat_template.endswith((".jinja", ".j2", ".txt")),
            "data.chat_template",
            f"must be auto, none or a template file (.jinja), got {self.chat_template!r}",
        )


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and batching. See docs/concepts.md for the accumulation contract."""

    global_batch_size: int = 8  # samples per optimizer step, summed over all ranks
    micro_batch_size: int = 1  # samples per forward, per rank (not used under max_tokens_per_micro_batch)
    # > 0: cut each rank's share into micro-batches of at most this many tokens (rows x longest row, or with
    # train.packing the sum of row lengths) instead of train.micro_batch_size rows; ranks balanced by tokens
    max_tokens_per_micro_batch: int = 0
    packing: bool = False  # padding-free: a micro-batch's rows run as one sequence, attention kept within each row
    num_workers: int = 1  # data-parallel ranks
    max_epochs: int = 1
    # steps of the whole run (SFT/RM/DPO: optimizer steps; RL: RL steps, each ppo_epochs x rollout / global batch
    # optimizer steps); -1 = no limit. The LR horizon is the run's optimizer steps in every trainer.
    max_steps: int = -1
    lr: float = 1e-5
    lr_scheduler: str = "cosine"  # constant | linear | cosine (after warmup); transformers' schedules
    # optimizer steps of linear warmup from 0 (transformers': step k < warmup_steps trains at lr * k / warmup_steps,
    # so step 0 at lr 0), in every trainer (RL too)
    warmup_steps: int = 0
    # linear / cosine decay towards lr * min_lr_ratio, reached one step after the run's last optimizer step
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_betas: Tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # <= 0 disables clipping (the norm is still measured and logged)
    seed: int = 42
    output_dir: str = ""  # "" = a new directory outputs/TRAINER-YYYYmmdd-HHMMSS, printed at the start
    overwrite: bool = False  # output_dir holds a run: delete its artifacts first (logs, TensorBoard, checkpoints...)
    save_final: bool = True
    eval_every: int = 0  # with data.eval_path: evaluate every N steps (RL: RL steps); 0 = only after the last
    save_every: int = 0  # checkpoint every N steps (RL: RL steps) into output_dir/checkpoints; 0 = off
    keep_checkpoints: int = 2  # newest complete checkpoints kept
    resume: bool = False  # continue output_dir's run from its newest checkpoint (none: an unfinished run starts over)
    stop_after_steps: int = 0  # stop after N steps of this invocation, with a checkpoint (job time limits); 0 = off
    on_failure: str = "exit"  # a dead or failing actor: exit (code 1, checkpoints intact) | restart (from the last one)
    max_restarts: int = 3  # with on_failure=restart: restarts allowed per invocation
    # steps (RL: RL steps) whose batch is consumed but not trained on: no forward, no update; the LR schedule still
    # advances (a function of the planned optimizer step, it ends where the run's optimizer steps end); a row
    # {"step": N, "skipped": 1} is logged
    skip_steps: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for key in ("global_batch_size", "micro_batch_size", "num_workers", "max_epochs", "keep_checkpoints"):
            value = getattr(self, key)
            check_setting(value >= 1, f"train.{key}", f"must be >= 1, got {value}")
        check_setting(
            self.max_steps == -1 or self.max_steps >= 1, "train.max_steps", f"must be -1 or >= 1, got {self.max_steps}"
        )
        check_setting(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        check_choice(self.lr_scheduler, "train.lr_scheduler", ("constant", "linear", "cosine"))
        check_setting(self.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check_setting(
            0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}"
        )
        check_setting(
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            "train.adam_betas",
            f"must be two numbers in [0, 1), got {self.adam_betas}",
        )
        check_setting(
            self.max_tokens_per_micro_batch >= 0,
            "train.max_tokens_per_micro_batch",
            f"must be >= 0 (0 = micro-batches of train.micro_batch_size rows), got {self.max_tokens_per_micro_batch}",
        )
        if self.max_tokens_per_micro_batch:
            check_setting(
                self.global_batch_size % self.num_workers == 0,
                "train.global_batch_size",
                f"({self.global_batch_size}) must be divisible by train.num_workers ({self.num_workers}): under "
                f"train.max_tokens_per_micro_batch every rank takes the same number of rows",
            )
        else:
            per_pass = self.micro_batch_size * self.num_workers
            check_setting(
                self.global_batch_size % per_pass == 0,
                "train.global_batch_size",
                f"({self.global_batch_size}) must be divisible by train.micro_batch_size x train.num_workers "
                f"({self.micro_batch_size} x {self.num_workers} = {per_pass})",
            )
        check_setting(
            bool(self.output_dir) or not self.resume,
            "train.output_dir",
            "must name the run to continue when train.resume=true (it is empty: a new directory)",
        )
        check_choice(self.on_failure, "train.on_failure", ("exit", "restart"))
        check_setting(
            self.on_failure != "restart" or self.save_every > 0,
            "train.on_failure",
            "=restart needs train.save_every > 0: a restart continues from the last checkpoint",
        )
        for key in ("eval_every", "save_every", "stop_after_steps", "max_restarts"):
            check_setting(getattr(self, key) >= 0, f"train.{key}", f"must be >= 0, got {getattr(self, key)}")
        check_setting(
            all(s >= 1 for s in self.skip_steps),
            "train.skip_steps",
            f"must be step numbers >= 1, got {list(self.skip_steps)}",
        )

    @property
    def engine_micro_batch_size(self) -> int:
        """DeepSpeed's micro-batch size: ``micro_batch_size``, or 1 under a token budget (one row is the smallest
        micro-batch the budget cuts)."""
        return 1 if self.max_tokens_per_micro_batch else self.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step; under a token budget the most a step can take (one row each:
        the step's real number depends on its rows)."""
        return self.global_batch_size // (self.engine_micro_batch_size * self.num_workers)

    def describe_batching(self, ranks: Optional[int] = None) -> str:
        """How a global batch is cut over ``ranks`` (default ``num_workers``): ``micro 2 x accumulation 2 x ranks 2``,
        or ``4 rows x ranks 2 in micro-batches of <= 2048 tokens``."""
        ranks = ranks or self.num_workers
        packed = ", packed" if self.packing else ""
        if self.max_tokens_per_micro_batch:
            return (
                f"{self.global_batch_size // ranks} rows x ranks {ranks} in micro-batches of <= "
                f"{self.max_tokens_per_micro_batch} tokens{packed}"
            )
        accumulation = self.global_batch_size // (self.micro_batch_size * ranks)
        return f"micro {self.micro_batch_size} x accumulation {accumulation} x ranks {ranks}{packed}"


@dataclass(frozen=True)
class StrategyConfig:
    """How the trainer workers run: DeepSpeed ZeRO stage, precision, resources per worker."""

    zero_stage: int = 2
    # auto: bf16 on GPU, fp32 on CPU; fp64: audits on CPU, ZeRO 0 only; fp16 is refused (docs/concepts.md, Precision)
    precision: str = "auto"
    backend: str = "auto"  # auto: nccl on GPU, gloo on CPU
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = -1.0  # -1: 1 when the Ray cluster has GPUs, else 0
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (GPU runs)
    deepspeed_config: str = ""  # optional user JSON, merged under the run's settings; contradicting fields are errors
    # Bounds forming each role's process group: a rank that cannot reach rank 0, or never arrives, is named after
    # this long instead of a hang (the ranks start in parallel; loading the model comes after).
    init_timeout_s: float = 300.0
    # The dense peak TFLOP/s of one worker's device in the run's precision, for the perf/<role>/mfu metrics (model
    # FLOPs utilisation); 0: known GPUs by name (rlhf.utils.flops.PEAK_TFLOPS), none on CPUs.
    peak_tflops: float = 0.0
    # Ulysses sequence parallelism (docs/long_sequences.md): N ranks share every row, each running 1/N of its
    # positions, attention heads split N ways; every trainer role runs its num_workers data-parallel ranks x N
    sequence_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_setting(
            self.sequence_parallel_size >= 1,
            "strategy.sequence_parallel_size",
            f"must be >= 1, got {self.sequence_parallel_size}",
        )
        check_setting(self.init_timeout_s > 0, "strategy.init_timeout_s", f"must be > 0, got {self.init_timeout_s}")
        check_setting(
            self.peak_tflops >= 0, "strategy.peak_tflops", f"must be >= 0 (0: known GPUs), got {self.peak_tflops}"
        )
        check_setting(
            self.zero_stage in (0, 1, 2, 3), "strategy.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}"
        )
        check_choice(self.precision, "strategy.precision", ("auto", "fp32", "bf16", "fp64", "fp16"))
        check_setting(
            self.precision != "fp16",
            "strategy.precision",
            "is fp16, which is not supported: DeepSpeed's fp16 path (dynamic loss scaling, overflowing steps "
            "skipped while the LR schedule waits) has no CPU twin the tests could run (DeepSpeed's CPU accelerator "
            "has no fp16); use bf16 (Ampere and newer GPUs, CPUs) or fp32",
        )
        if self.precision == "fp64":
            self._check_fp64()
        check_choice(self.backend, "strategy.backend", ("auto", "gloo", "nccl"))
        check_setting(self.cpus_per_worker > 0, "strategy.cpus_per_worker", f"must be > 0, got {self.cpus_per_worker}")
        check_setting(
            self.gpus_per_worker == -1 or self.gpus_per_worker >= 0,
            "strategy.gpus_per_worker",
            f"must be -1 (auto) or >= 0, got {self.gpus_per_worker}",
        )

    def _check_fp64(self) -> None:
        """fp64 is for audits: only ZeRO 0 trains in float64 end to end (docs/concepts.md, Precision)."""
        check_setting(
            self.zero_stage == 0,
            "strategy.precision",
            f"is fp64, which runs on ZeRO 0 only (strategy.zero_stage=0), got strategy.zero_stage="
            f"{self.zero_stage}: {FP64_REFUSED_STAGES.get(self.zero_stage, '')}",
        )
        check_setting(
            not self.offload_optimizer,
            "strategy.precision",
            "is fp64, which cannot offload the optimizer (strategy.offload_optimizer=true): ZeRO-Offload moves "
            "the ZeRO optimizer's float32 master weights and Adam state to the CPU (DeepSpeedCPUAdam)",
        )


# Why DeepSpeed 0.19.8 cannot train float64 weights on ZeRO 1-3 (seen on its CPU accelerator; docs/concepts.md).
_ZERO_1_2_FP32 = (
    "DeepSpeed's ZeRO 1/2 optimizer (DeepSpeedZeroOptimizer) keeps the master weights, gradient "
    "partitions and Adam state in float32 whatever the weights' dtype (it knows no other master dtype "
    "than fp32, bf16 and fp16), so every update would be rounded to float32 (and its grad norm is "
    "float32)"
)
FP64_REFUSED_STAGES = {
    1: _ZERO_1_2_FP32,
    2: _ZERO_1_2_FP32,
    3: "DeepSpeed's ZeRO 3 loads through deepspeed.zero.Init, which casts the weights to float32 (its dtype follows "
    "the fp16/bf16 flags, float32 when neither is on), and keeps float32 masters: the run would be float32",
}


@dataclass(frozen=True)
class RayConfig:
    """Where the actors run. An empty address starts a local cluster unless RAY_ADDRESS is set."""

    address: str = ""
    num_cpus: int = -1  # local cluster only; -1 = enough logical CPUs for every actor of the run

    def __post_init__(self) -> None:
        check_setting(
            self.num_cpus == -1 or self.num_cpus >= 1, "ray.num_cpus", f"must be -1 or >= 1, got {self.num_cpus}"
        )


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    print_every: int = 1  # driver prints a metrics line every N steps
    console: str = "line"  # line (key=value) | table (aligned columns, header repeated every 20 rows)
    progress_bar: str = "auto"  # auto (when stderr is a terminal) | on | off; ETA is in the step lines either way
    wandb: bool = False  # also log to Weights & Biases (pip install wandb)
    wandb_project: str = "rlhf"
    wandb_mode: str = "offline"  # offline (no network; `wandb sync` later) | online
    wandb_run_name: str = ""  # "" = the base name of train.output_dir

    def __post_init__(self) -> None:
        check_setting(self.print_every >= 1, "logging.print_every", f"must be >= 1, got {self.print_every}")
        check_choice(self.console, "logging.console", ("line", "table"))
        check_choice(self.wandb_mode, "logging.wandb_mode", ("offline", "online"))
        check_choice(self.progress_bar, "logging.progress_bar", ("auto", "on", "off"))


@dataclass(frozen=True)
class HealthConfig:
    """The training health guard (rlhf/trainers/health.py): checks every step's logged metrics."""

    action: str = "stop"  # stop (exit 1) | skip (rewind to the newest checkpoint, pass over the step) | warn | off
    zero_loss_steps: int = 3  # loss or grad norm exactly 0 this many steps in a row trips it (0 = off; not in RL)
    spike_factor: float = 10.0  # grad norm above this x its running median trips it (0 = off)
    spike_window: int = 20  # steps in the running median
    max_skips: int = 5  # with action=skip: steps it may pass over per invocation before it stops instead
    # RL: the KL to the reference (kl) above this trips it: the policy has drifted far from the model it started
    # from (a reward it games, a learning rate too high); 0 = off
    max_kl: float = 1.0
    # RL: the mean |trainer - vLLM| log-prob of the sampled tokens (logp_mismatch) above this trips it: weights that
    # did not reach the engines, a precision gap, or (rollout.max_staleness) samples too far behind the policy that
    # trains on them (then the behaviour / proximal gap); ~1e-6 with synced fp32 weights; 0 = off
    max_logp_mismatch: float = 0.5
    # RL: every sample of a step scored the same (reward_std exactly 0) this many steps in a row trips it: no
    # learning signal left (a collapsed policy, a saturated or broken reward); 0 = off
    flat_reward_steps: int = 10

    def __post_init__(self) -> None:
        check_choice(self.action, "health.action", ("stop", "skip", "warn", "off"))
        check_setting(self.max_skips >= 1, "health.max_skips", f"must be >= 1, got {self.max_skips}")
        check_setting(self.zero_loss_steps >= 0, "health.zero_loss_steps", f"must be >= 0, got {self.zero_loss_steps}")
        check_setting(
            self.spike_factor == 0 or self.spike_factor > 1,
            "health.spike_factor",
            f"must be 0 (off) or > 1, got {self.spike_factor}",
        )
        check_setting(self.spike_window >= 1, "health.spike_window", f"must be >= 1, got {self.spike_window}")
        for key in ("max_kl", "max_logp_mismatch"):
            check_setting(getattr(self, key) >= 0, f"health.{key}", f"must be >= 0 (0 = off), got {getattr(self, key)}")
        check_setting(
            self.flat_reward_steps >= 0, "health.flat_reward_steps", f"must be >= 0, got {self.flat_reward_steps}"
        )


@dataclass(frozen=True)
class DPOConfig:
    """Direct Preference Optimization (Rafailov et al. 2023) and variants; see rlhf/ops/preference.py."""

    # unset: the loss's paper's (rlhf.ops.preference: 0.1, SimPO's 2); ORPO's lambda
    beta: Optional[float] = None
    # a name in rlhf.ops.preference.DPO_LOSSES (preference pairs) or UNPAIRED_LOSSES (kto: prompt, completion, label);
    # simpo, cpo and orpo are reference-free: no reference model, no reference workers
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0  # cDPO: assumed probability that a preference label is flipped
    # + coef x token-averaged NLL of the chosen completion (RPO; CPO's and ORPO's SFT term); unset: the paper's (cpo
    # and orpo 1, else 0)
    nll_coef: Optional[float] = None
    simpo_gamma: Optional[float] = None  # SimPO's target reward margin gamma; unset: 1 (gamma / beta = 0.5)
    # precompute: score every row once before training (the starting policy: on the policy's ranks); online: every step
    ref_mode: str = "precompute"
    # reference workers: online, or another model.ref_path (LoRA's base: none); 0: none, the policy's ranks hold a
    # frozen copy of the reference in their own processes (as TRL's ref_model beside the model)
    ref_num_workers: int = 1
    # online with dpo.ref_num_workers=0: the copy the policy's ranks hold waits in host memory between its passes, so
    # the policy trains with its device memory (OpenRLHF's --ref_offload). A precomputed reference is dropped anyway
    ref_offload: bool = False
    # KTO (Ethayarajh et al. 2024): lambda_D and lambda_U, the weights of desirable and undesirable rows; the paper
    # advises lambda_D n_D / (lambda_U n_U) in [1, 4/3] (n: rows of each label), the run logs the ratio it reads
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        check_setting(self.beta is None or self.beta > 0, "dpo.beta", f"must be > 0, got {self.beta}")
        check_setting(
            0.0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}"
        )
        check_setting(self.nll_coef is None or self.nll_coef >= 0, "dpo.nll_coef", f"must be >= 0, got {self.nll_coef}")
        check_setting(
            self.simpo_gamma is None or self.simpo_gamma >= 0,
            "dpo.simpo_gamma",
            f"must be >= 0, got {self.simpo_gamma}",
        )
        check_choice(self.ref_mode, "dpo.ref_mode", ("precompute", "online"))
        check_setting(self.ref_num_workers >= 0, "dpo.ref_num_workers", f"must be >= 0, got {self.ref_num_workers}")
        for key in ("desirable_weight", "undesirable_weight"):
            check_setting(getattr(self, key) > 0, f"dpo.{key}", f"must be > 0, got {getattr(self, key)}")
        if self.unpaired:
            for key in ("label_smoothing", "nll_coef", "simpo_gamma"):
                check_setting(
                    not getattr(self, key),
                    f"dpo.{key}",
                    f"is not used by dpo.loss_type={self.loss_type} (unpaired rows): remove it",
                )
            return
        check_setting(
            self.simpo_gamma is None or self.loss.margin is not None,
            "dpo.simpo_gamma",
            f"is SimPO's target margin; dpo.loss_type={self.loss_type} has none: unset it",
        )
        check_setting(
            not self.label_smoothing or self.loss.label_smoothing,
            "dpo.label_smoothing",
            f"is not modelled by dpo.loss_type={self.loss_type}; set it to 0",
        )

    @property
    def unpaired(self) -> bool:
        """Whether the loss reads unpaired rows (prompt, completion, label) instead of preference pairs."""
        from rlhf.ops.preference import preference_rows  # imports torch; keeps `import rlhf.config` light

        try:
            return preference_rows(self.loss_type) == "unpaired"
        except KeyError as e:  # UnknownNameError lists the valid names
            raise ConfigError(f"dpo.loss_type: {e}") from None

    @property
    def loss(self):
        """The loss's registry entry (:class:`rlhf.ops.preference.DPOLoss` or ``UnpairedLoss``): its paper's facts."""
        from rlhf.ops.preference import preference_loss  # imports torch; keeps `import rlhf.config` light

        try:
            return preference_loss(self.loss_type)
        except KeyError as e:  # UnknownNameError lists the valid names
            raise ConfigError(f"dpo.loss_type: {e}") from None

    @property
    def reference_free(self) -> bool:
        """Whether the loss reads no reference model (SimPO, CPO, ORPO): a run starts no reference workers."""
        return not self.unpaired and not self.loss.reference

    @property
    def trained_beta(self) -> float:
        """``beta`` trained with: as set, or the loss's paper's."""
        return self.loss.beta if self.beta is None else self.beta

    @property
    def trained_nll_coef(self) -> float:
        """The chosen NLL's weight trained with: as set, or the loss's paper's (CPO's and ORPO's 1, else 0)."""
        if self.nll_coef is not None:
            return self.nll_coef
        return 0.0 if self.unpaired else self.loss.nll_coef

    @property
    def trained_margin(self) -> Optional[float]:
        """SimPO's target margin trained with (as set, or the paper's); ``None`` for a loss without one."""
        if self.unpaired or self.loss.margin is None:
            return None
        return self.loss.margin if self.simpo_gamma is None else self.simpo_gamma

    def describe_loss(self) -> str:
        """The loss and the settings trained with, saying which came from its paper (``--dry-run``, the first
        lines of a run)."""
        settings = [("beta", self.beta, self.trained_beta)]
        if self.nll_coef is not None or self.trained_nll_coef:
            settings.append(("nll_coef", self.nll_coef, self.trained_nll_coef))
        if self.trained_margin is not None:
            settings.append(("simpo_gamma", self.simpo_gamma, self.trained_margin))
        parts = [f"{key} {trained:g}" + (" (the paper's)" if set_ is None else "") for key, set_, trained in settings]
        reference = "no reference model" if self.reference_free else "against a frozen reference"
        return f"dpo.loss_type={self.loss_type}: {self.loss.paper}; {reference}; " + ", ".join(parts)


@dataclass(frozen=True)
class RewardModelConfig:
    """Pairwise Bradley-Terry reward model (Ouyang et al. 2022, eq. 1) with an optional margin (Llama 2)."""

    use_margin: bool = False  # subtract data.margin_key from the reward difference


@dataclass(frozen=True)
class RunConfig:
    """Any trainer's run config: the sections every trainer has.

    Each trainer's own config (:class:`SFTRunConfig`, :class:`RewardModelRunConfig`, :class:`DPORunConfig`,
    :class:`rlhf.config.rl_schema.RLRunConfig`) extends it with its own sections; code that serves any trainer takes
    a ``RunConfig``.
    """

    model: ModelConfig  # no default: model.path is required
    data: DataConfig  # no default: data.train_path is required
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        check_setting(
            self.health.action != "skip" or self.train.save_every > 0,
            "health.action",
            "is skip, which needs train.save_every > 0: a skip rewinds to the newest checkpoint",
        )
        check_setting(
            not self.train.packing or self.model.attn_implementation != "eager",
            "train.packing",
            "needs a variable-length attention, which model.attn_implementation=eager does not have: use auto "
            "(flash_attention_2 on GPU, else rlhf's varlen sdpa), sdpa or flash_attention_2",
        )
        check_setting(
            not self.model.tiled_head or self.strategy.zero_stage != 3,
            "model.tiled_head",
            "needs the LM head's whole weight on each rank, which ZeRO 3 partitions: use strategy.zero_stage 0-2",
        )
        check_setting(
            not self.model.tiled_mlp or self.strategy.zero_stage != 3,
            "model.tiled_mlp",
            "runs each MLP in a number of tiles that depends on the row length, which ZeRO 3 cannot take: every "
            "tile gathers the MLP's weights on every rank, so ranks with different lengths would wait on each "
            "other; use strategy.zero_stage 0-2",
        )
        check_setting(
            not self.model.tiled_head or not self.model.lora.enabled,
            "model.tiled_head",
            "is not supported with LoRA (model.lora.r > 0) yet: the head is swapped inside the PEFT wrapper's model, "
            "which no test covers",
        )
        for other, on in (
            ("strategy.zero_stage=3", self.strategy.zero_stage == 3),
            ("strategy.sequence_parallel_size > 1", self.strategy.sequence_parallel_size > 1),
            ("model.tiled_mlp", self.model.tiled_mlp),
            ("model.gradient_checkpointing", self.model.gradient_checkpointing),
            ("LoRA (model.lora.r > 0)", self.model.lora.enabled),
        ):
            check_setting(
                not (self.model.compile and on),
                "model.compile",
                f"is not supported with {other}: each hooks into the layers a compile traces (ZeRO 3's gathers, "
                f"the sequence group's all-to-all, tiles, recomputation, adapters) and no test covers the pair yet",
            )
        check_setting(
            self.strategy.precision != "fp64" or self.model.attn_implementation != "eager",
            "model.attn_implementation",
            "is eager, which strategy.precision=fp64 cannot audit: transformers' eager "
            "attention takes its softmax in float32, whose rounding depends on the padded width (~1e-8 between "
            "factorisations); use auto or sdpa",
        )


# A function that returns the run config it was given (changed or not) keeps its class: RunConfigT -> RunConfigT.
RunConfigT = TypeVar("RunConfigT", bound=RunConfig)


@dataclass(frozen=True)
class SFTRunConfig(RunConfig):
    """``python -m rlhf.cli.train_sft``: supervised fine-tuning, loss on response tokens."""


@dataclass(frozen=True)
class RewardModelRunConfig(RunConfig):
    """``python -m rlhf.cli.train_rm``: pairwise reward model."""

    rm: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass(frozen=True)
class DPORunConfig(RunConfig):
    """``python -m rlhf.cli.train_dpo``: offline preference optimisation, against a frozen reference or
    reference-free (SimPO, CPO, ORPO)."""

    dpo: DPOConfig = field(default_factory=DPOConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_ref_offload()
        check_setting(
            not (self.model.ref_path and self.dpo.reference_free),
            "model.ref_path",
            f"names a reference model, which dpo.loss_type={self.dpo.loss_type} does not read (reference-free): "
            "unset it, or choose a loss that reads a reference",
        )

    def _check_ref_offload(self) -> None:
        """``dpo.ref_offload`` has a reference to move: a copy the policy's ranks hold and score at every step."""
        d = self.dpo
        if not d.ref_offload:
            return
        for problem, why in (
            (d.reference_free, f"dpo.loss_type={d.loss_type} reads no reference model"),
            (self.model.reference_is_base, "with model.lora.r > 0 the reference is the policy's own frozen base"),
            (d.ref_mode != "online", "dpo.ref_mode=precompute scores the reference once, then drops it"),
            (d.ref_num_workers > 0, "a reference group (dpo.ref_num_workers > 0) has devices of its own; "
             "dpo.ref_num_workers=0 puts a copy in the policy's ranks"),
        ):  # fmt: skip
            check_setting(not problem, "dpo.ref_offload", f"has nothing to offload: {why}")
