"""The one DeepSpeed engine every trainer uses (SFT, reward model, DPO; PPO's policy and critic later).

Gradient-accumulation contract (docs/concepts.md):

* The caller hands the engine losses that are already normalized over the *whole global batch* (all
  micro-batches, all ranks) and multiplied by the data-parallel world size, because DeepSpeed averages gradients
  over ranks. DeepSpeed's own ``1 / gradient_accumulation_steps`` scaling is switched off
  (``backward(scale_wrt_gas=False)``): exactly one normalization.
* One optimizer step consumes the micro-batches the caller hands it, ``gradient_accumulation_steps`` of them, or
  under a token budget as many as the step's longest rank needs (at most ``gradient_accumulation_steps``, one row
  each). :meth:`TrainEngine.micro_step` tells DeepSpeed where the boundary is and checks that DeepSpeed stepped the
  optimizer exactly there, once, so an accumulation window can never straddle two steps (or two epochs, or a
  resume).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, overload

import torch

from rlhf.config.deepspeed_check import grad_accum_dtype
from rlhf.distributed.flat_grads import FlatLowPrecisionGrads
from rlhf.distributed.fp32_clip import install_multi_tensor_clip, multi_tensor_clip_applies
from rlhf.distributed.overflow_check import check_overflow_in_one_read
from rlhf.distributed.unfused_step import install_unfused_step, unfused_step_applies
from rlhf.utils.schedule import lr_multiplier
from rlhf.utils.startup import import_deepspeed_muon_uncompiled


@dataclass(frozen=True)
class OptimSpec:
    """AdamW and its schedule. ``total_steps`` is the run's exact number of optimizer steps."""

    lr: float
    total_steps: int
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    scheduler: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class EngineSpec:
    """How DeepSpeed shards and computes, and how a group cuts batches for it (:mod:`rlhf.distributed.micro_batches`).
    ``precision`` is already resolved (fp32 | bf16 | fp64).

    ``max_tokens_per_micro_batch > 0`` cuts micro-batches by tokens (``packing``: counted packed, else padded);
    ``micro_batch_size`` is then 1 and ``grad_accum_steps`` a rank's rows, the most micro-batches a step can take.
    """

    zero_stage: int
    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    offload_optimizer: bool = False
    user_config: Optional[Dict[str, Any]] = None
    max_tokens_per_micro_batch: int = 0
    packing: bool = False
    peak_tflops: float = 0.0  # the device's dense peak for the perf/*/mfu metrics; 0: rlhf.utils.flops's table
    # ranks sharing each row (rlhf.models.sequence_parallel): a group of W ranks has W / this data-parallel ranks
    sequence_parallel_size: int = 1
    # ZeRO 3: parameters of at most this many elements stay whole on every rank (DeepSpeed's
    # stage3_param_persistence_threshold); the worker sets the model's largest 1-D parameter (persistent_numel)
    persist_numel: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 0, got {self.max_tokens_per_micro_batch}")
        if self.sequence_parallel_size < 1:
            raise ValueError(f"sequence_parallel_size must be >= 1, got {self.sequence_parallel_size}")
        if self.max_tokens_per_micro_batch and self.micro_batch_size != 1:
            raise ValueError(
                "a token budget cuts micro-batches itself: micro_batch_size must be 1 (one row is the "
                f"smallest micro-batch), got {self.micro_batch_size}"
            )

    @classmethod
    def for_global_batch(
        cls,
        global_batch_size: int,
        micro_batch_size: int,
        num_workers: int,
        *,
        zero_stage: int = 0,
        precision: str = "fp32",
        **kwargs: Any,
    ) -> "EngineSpec":
        """The spec whose optimizer step consumes ``global_batch_size`` rows: ``grad_accum_steps`` micro-batches of
        ``micro_batch_size`` on each of ``num_workers`` ranks (refused, with the numbers, when they do not divide)."""
        per_step = micro_batch_size * num_workers
        if micro_batch_size < 1 or num_workers < 1 or global_batch_size < per_step or global_batch_size % per_step:
            raise ValueError(
                f"global batch {global_batch_size} is not a multiple of micro_batch_size "
                f"{micro_batch_size} x {num_workers} workers = {per_step}"
            )
        return cls(
            zero_stage=zero_stage,
            precision=precision,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=global_batch_size // per_step,
            **kwargs,
        )

    @classmethod
    def for_token_budget(
        cls,
        global_batch_size: int,
        max_tokens: int,
        num_workers: int,
        *,
        packing: bool = False,
        zero_stage: int = 0,
        precision: str = "fp32",
        **kwargs: Any,
    ) -> "EngineSpec":
        """The spec whose optimizer step consumes ``global_batch_size`` rows, ``global_batch_size / num_workers`` per
        rank, in micro-batches of at most ``max_tokens`` tokens."""
        if num_workers < 1 or global_batch_size < num_workers or global_batch_size % num_workers:
            raise ValueError(f"global batch {global_batch_size} does not divide over {num_workers} workers")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        return cls(
            zero_stage=zero_stage,
            precision=precision,
            micro_batch_size=1,
            grad_accum_steps=global_batch_size // num_workers,
            max_tokens_per_micro_batch=max_tokens,
            packing=packing,
            **kwargs,
        )

    def global_batch_size(self, world_size: int) -> int:
        """Rows one optimizer step consumes over ``world_size`` ranks (``world_size / sequence_parallel_size``
        data-parallel ones)."""
        return self.micro_batch_size * self.grad_accum_steps * (world_size // self.sequence_parallel_size)


def build_ds_config(spec: EngineSpec, world_size: int, max_grad_norm: float, trainable: bool = True) -> Dict[str, Any]:
    """The DeepSpeed JSON for one worker group. The run's batch sizes and precision always win over a user's
    file: they are what the accumulation contract is computed from."""
    config: Dict[str, Any] = copy.deepcopy(spec.user_config) if spec.user_config else {}
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = spec.zero_stage
    if spec.offload_optimizer and trainable:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if spec.zero_stage == 3:
        # Tensors larger than the width are gathered for every use, whatever their size, so the tiny test models
        # partition as the huge ones do; the vectors (norms, biases: up to spec.persist_numel elements) stay whole on
        # every rank, where gathering each at every use would cost a collective for a few kilobytes. DeepSpeed's own
        # default (1e5 elements) would keep a tiny model whole and partition nothing.
        zero.setdefault("stage3_param_persistence_threshold", spec.persist_numel)
    if _one_rank_fp32_zero1(spec, world_size):
        # DeepSpeed's ZeRO-1 optimizer (fp32 weights) registers a hook on every parameter when its gradients are to
        # be kept contiguous (DeepSpeed's default), and at every backward each hook runs Python that a stage-1 step
        # does not use: stage 1 reduces at the boundary, where one rank copies each gradient into the bucket and
        # "all-reduces" it over itself. Off, the same gradients reach the step untouched (bit for bit,
        # tests/unit/test_one_rank_stage.py) without a Python call per parameter and micro-batch (0.79x -> 0.90x a
        # plain loop on the bench's `narrow` CPU model). Several ranks keep the default: their reduction is a real
        # all-reduce, whose summation order follows the buffer it is handed.
        zero.setdefault("contiguous_gradients", False)
    config["zero_optimization"] = zero
    config["train_micro_batch_size_per_gpu"] = spec.micro_batch_size
    config["gradient_accumulation_steps"] = spec.grad_accum_steps
    # every rank counts as data-parallel here: a sequence group's ranks each take the micro-batch (their positions)
    config["train_batch_size"] = spec.micro_batch_size * spec.grad_accum_steps * world_size
    # Clipping is applied by DeepSpeed; 0 disables it (the norm is still measured, see TrainEngine._step_grad_norm).
    config["gradient_clipping"] = max(0.0, max_grad_norm)
    config["bf16"] = {"enabled": spec.precision == "bf16"}
    config["fp16"] = {"enabled": False}  # refused by StrategyConfig (docs/concepts.md, "Precision")
    data_types = dict(config.get("data_types", {}))
    data_types["grad_accum_dtype"] = grad_accum_dtype(spec.precision, spec.zero_stage)
    if spec.precision == "fp64":
        if spec.zero_stage != 0:
            raise ValueError(f"fp64 trains on ZeRO 0 only, got ZeRO {spec.zero_stage} (StrategyConfig says why)")
        # DeepSpeed takes the run for fp32 (neither bf16 nor fp16): it wraps no optimizer, so AdamW updates the
        # float64 weights from their float64 `.grad`, which sums the micro-batches. `_train_in_fp64` does the rest.
        del data_types["grad_accum_dtype"]
    config["data_types"] = data_types
    config.setdefault("steps_per_print", 10**9)  # the driver logs; keep DeepSpeed quiet
    config.setdefault("wall_clock_breakdown", False)
    return config


def _one_rank_fp32_zero1(spec: EngineSpec, world_size: int) -> bool:
    """Whether a group builds DeepSpeed's ZeRO-1 optimizer for fp32 weights on one rank, optimizer on the device
    (bf16 weights take ``BF16_Optimizer``, fp64 trains on ZeRO 0)."""
    return world_size == 1 and spec.zero_stage == 1 and spec.precision == "fp32" and not spec.offload_optimizer


def effective_zero_stage(requested: int, world_size: int, offload_optimizer: bool = False) -> int:
    """The ZeRO stage a group of ``world_size`` ranks builds for ``strategy.zero_stage=requested``.

    ZeRO 2 and 3 partition gradients (3: the weights too) over the ranks. A group of one rank has nothing to
    partition, and DeepSpeed's paths then only add host work:

    * stage 2: a hook per parameter and micro-batch copies its gradient into a bucket, "reduces" the bucket over the
      one rank and adds it into the (whole) fp32 partition (on CPU, a model of 580 small parameters: 1.2 s of 5 s in
      those hooks, the step at 0.69x a plain loop where ZeRO 1 runs at 0.91x);
    * stage 3: besides those hooks, a gather before and a release after every module's forward and backward (one
      H200, 1.5B SFT: 2.44 s a step against ZeRO 1's 0.56 s, the same peak memory within 2 GiB).

    ZeRO 1 keeps everything a one-rank ZeRO 2 or 3 holds (the whole bf16 weights, the same fp32 sum of the
    micro-batch gradients, the whole fp32 master and Adam state) and sums each gradient once per micro-batch, without
    the buckets: the same weights, bit for bit in fp32 (tests/unit/test_one_rank_stage.py). Every other request is
    built as asked (offloading keeps the stage it was configured with: the optimizer lives on the host there).
    """
    if requested in (2, 3) and world_size == 1 and not offload_optimizer:
        return 1
    return requested


def built_spec(engine: "EngineSpec", world_size: int) -> "EngineSpec":
    """``engine`` with the ZeRO stage a group of ``world_size`` ranks builds (:func:`effective_zero_stage`): what the
    worker loads the model for (ZeRO 3 loads straight into partitions) and the engine wraps it in."""
    stage = effective_zero_stage(engine.zero_stage, world_size, engine.offload_optimizer)
    return engine if stage == engine.zero_stage else dataclasses.replace(engine, zero_stage=stage)


def _train_in_fp64(ds_engine) -> None:
    """Keep a ZeRO-0 engine's float64 gradients float64 where DeepSpeed 0.19 would not.

    * The all-reduce over ranks: ``allreduce_gradients`` refuses any gradient dtype its accelerator does not list
      (``AssertionError: attempting to reduce an unsupported grad type: torch.float64`` on the CPU accelerator,
      even with one rank), then casts to ``communication_data_type``, float32 unless fp16/bf16 is on (the JSON
      field accepts no fp64). The accelerator is told float64 is fine, and the engine communicates in float64.
    * Clipping: DeepSpeed's ZeRO-0 clip (``clip_fp32_gradients``) takes each gradient's norm in float32, so the
      clip coefficient would carry float32 rounding. torch's ``clip_grad_norm_`` computes the same
      ``min(1, max_norm / (norm + 1e-6))`` in the gradients' dtype; the gradients are already all-reduced.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = accelerator.supported_dtypes()
    if torch.float64 not in supported:
        accelerator.supported_dtypes = lambda: supported + [torch.float64]
    ds_engine.communication_data_type = torch.float64
    ds_engine.clip_fp32_gradients = lambda: torch.nn.utils.clip_grad_norm_(
        ds_engine.module.parameters(), ds_engine.gradient_clipping()
    )


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and norm weights (1-D parameters).

    The rank is the parameter's full shape: ZeRO-3 (``deepspeed.zero.Init``) replaces every local tensor by an empty
    1-D placeholder and keeps the real shape in ``ds_shape``, so ``param.ndim`` would put every weight in the
    no-decay group and silently switch weight decay off.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if len(getattr(param, "ds_shape", param.shape)) < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _make_optimizer(model: torch.nn.Module, optim: OptimSpec, offload: bool):
    """AdamW over :func:`parameter_groups`: torch's, on every device, so nothing is compiled at start-up.

    On a CUDA worker the single fused kernel (``fused=True``: one launch for all parameters, what DeepSpeed's
    ``FusedAdam`` gives) is chosen; DeepSpeed's ``FusedAdam`` itself is JIT-built with nvcc on first use, which
    needs a CUDA toolkit matching torch's build on every node. The CPU path is the same optimizer unfused (torch's
    per-parameter loop, the updates the CPU exactness and resume tests were written against). With ``offload`` the
    optimizer steps on the host: DeepSpeed's CPU Adam, which ZeRO-Offload requires.
    """
    groups = parameter_groups(model, optim.weight_decay)
    kwargs: Dict[str, Any] = dict(lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    # The parameters may still be on the host here (DeepSpeed moves the module afterwards, in place): the device
    # the worker trains on decides. torch checks the fused kernel's device and dtype at the first step.
    return torch.optim.AdamW(groups, fused=torch.cuda.is_available(), **kwargs)


def _is_bf16_optimizer(optimizer) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(optimizer, BF16_Optimizer)


def _is_unfused_bf16_optimizer(optimizer) -> bool:
    """DeepSpeed's wrapper for bf16 weights on ZeRO 0 (fp16, its other use, is refused by the config)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return isinstance(optimizer, FP16_UnfusedOptimizer)


def _undo_construction_step(optimizer) -> None:
    """Make DeepSpeed's ZeRO-0 bf16 optimizer start where every other stage starts.

    ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` (what DeepSpeed wraps the optimizer in for fp16 or bf16 without
    ZeRO) create Adam's state by running one optimizer step on zero gradients while they are built. That step
    counts: Adam's bias correction then runs one step ahead for the whole run (the first real update is ~0.73x the
    size it has under ZeRO 1-3 or fp32 with betas (0.9, 0.95)), and AdamW's decoupled weight decay has already
    shrunk the fp32 master weights once. Forget that state and copy the masters back from the model's weights.
    Other wrappers take no such step and are left alone.
    """
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    pairs: Iterable[Tuple[Any, Any]]
    if isinstance(optimizer, FP16_Optimizer):
        pairs = zip(optimizer.fp32_groups_flat, optimizer.fp16_groups_flat)
    elif isinstance(optimizer, FP16_UnfusedOptimizer):
        pairs = ((hp, lp) for hps, lps in zip(optimizer.fp32_groups, optimizer.fp16_groups) for hp, lp in zip(hps, lps))
    else:
        return
    with torch.no_grad():
        for master, weight in pairs:
            master.copy_(weight)
    inner = optimizer.optimizer
    inner.state.clear()
    for group in inner.param_groups:
        if "step" in group:  # DeepSpeed's own Adams (CPU Adam, FusedAdam) also count steps per group
            group["step"] = 0


# _local_grad_norm keeps its float64 scratch buffer between steps up to this many elements (512 MiB).
_NORM_BUFFER_MAX_ELEMENTS = 2**26

CHECKPOINT_TAG = "state"  # DeepSpeed's sub-directory of a role's checkpoint directory


class TrainEngine:
    """A DeepSpeed engine with the project's accumulation contract.

    Use: for each micro-batch of a step, ``loss = engine(...)``-derived normalized loss, then
    ``micro_step(loss, is_last)``; after the last one, :attr:`last_grad_norm` holds the step's pre-clip norm.
    """

    def __init__(self, model: torch.nn.Module, *, engine: EngineSpec, optim: OptimSpec, world_size: int) -> None:
        import deepspeed

        import_deepspeed_muon_uncompiled()  # imported by the engine below, for isinstance checks only
        engine = built_spec(engine, world_size)
        self.spec = engine
        self.optim_spec = optim
        self.world_size = world_size
        ds_config = build_ds_config(engine, world_size, optim.max_grad_norm)
        optimizer = _make_optimizer(model, optim, engine.offload_optimizer)

        def schedule(opt):  # DeepSpeed calls this with the optimizer it wraps
            return torch.optim.lr_scheduler.LambdaLR(
                opt,
                lambda step: lr_multiplier(
                    step,
                    total_steps=optim.total_steps,
                    warmup_steps=optim.warmup_steps,
                    kind=optim.scheduler,
                    min_ratio=optim.min_lr_ratio,
                ),
            )

        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=schedule, config=ds_config
        )
        _undo_construction_step(self.engine.optimizer)
        if engine.precision == "fp64":
            _train_in_fp64(self.engine)
        elif multi_tensor_clip_applies(self.engine):
            install_multi_tensor_clip(self.engine)  # ZeRO 0 in fp32: DeepSpeed's clip without a loop a parameter
        if _is_bf16_optimizer(self.engine.optimizer) and FlatLowPrecisionGrads.applies_to(self.engine.optimizer):
            FlatLowPrecisionGrads(self.engine.optimizer)  # one add a group, not a Python loop a parameter
        # ZeRO 0 in bf16: DeepSpeed's per-parameter step in a few multi-tensor operations, its norm the one logged;
        # where that step does not fit, DeepSpeed's own, its NaN test read back once a step, not once a parameter
        unfused = _is_unfused_bf16_optimizer(self.engine.optimizer)
        self._unfused_step = unfused and unfused_step_applies(self.engine.optimizer)
        if self._unfused_step:
            install_unfused_step(self.engine.optimizer)
        elif unfused:
            check_overflow_in_one_read(self.engine.optimizer)
        if world_size == 1 and (engine.zero_stage == 0 or _is_bf16_optimizer(self.engine.optimizer)):
            # One rank, whole gradients: DeepSpeed's all-reduce at the boundary (ZeRO 0, and bf16's BF16_Optimizer
            # on ZeRO 1) would flatten every gradient into a new buffer, all-reduce it over a group of one and copy
            # it back (3 passes over the gradients and a fresh allocation, ~50 ms a step for 25M parameters on CPU).
            # In fp32 that changes no bit: the sum is the tensor itself and the average divides by 1.0. In bf16 the
            # buffer is BF16_Optimizer's fp32 sum of the micro-batch gradients, cast to bf16 to be communicated and
            # back: skipped, the step sees the fp32 sum, as a one-rank ZeRO 2 does.
            self.engine.enable_backward_allreduce = False
        self._norm_buffer: Optional[torch.Tensor] = None  # _local_grad_norm's float64 scratch, kept between steps
        # LoRA: checkpoints hold the trainable parameters only (the frozen base is reloaded from model.path)
        self.adapters_only = any(not p.requires_grad for p in model.parameters())
        self._micro_in_step = 0
        self._steps_before = 0  # DeepSpeed's optimizer-step count when the current window began
        self.last_grad_norm: Optional[float] = None
        # False when DeepSpeed skipped the last optimizer step (a non-finite gradient in bf16): weights, Adam state
        # and the LR schedule stayed where they were.
        self.last_step_applied = True

    # ------------------------------------------------------------------ training
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self) -> None:
        self.engine.train()

    def current_lr(self) -> float:
        """The LR the next optimizer step will use."""
        return float(self.engine.get_lr()[0])

    def position_schedule(self, step: int) -> None:
        """Make the next optimizer step use the LR of the run's 0-based optimizer step ``step``.

        The schedule is a function of the *planned* step (docs/concepts.md, "Steps and the LR schedule"): a step
        passed over (``train.skip_steps``, a health-guard skip, a step DeepSpeed skipped on a non-finite gradient)
        still advances it, so the decay ends where the run's optimizer steps end. Without skips the
        scheduler is already there and nothing changes.
        """
        if self.scheduler.last_epoch == step:
            return
        import warnings

        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a skip before step 1
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.last_epoch = step - 1
            self.scheduler.step()  # sets every group's LR to base_lr * lr_multiplier(step)

    def micro_step(self, loss: torch.Tensor, is_last: bool) -> None:
        """Backward one micro-batch's already-normalized loss; on the last micro-batch, update the weights.

        DeepSpeed is told the boundary (``set_gradient_accumulation_boundary``: its own counter assumes a fixed
        number of micro-batches a step, which a token budget does not have); that it reduced and stepped exactly
        there, once per window, is checked from its optimizer-step count.
        """
        if self._micro_in_step == 0:
            self._steps_before = self.engine.global_steps
        if self._micro_in_step + 1 > self.spec.grad_accum_steps:
            raise RuntimeError(
                f"accumulation window out of step: micro-batch {self._micro_in_step + 1} of a window "
                f"of at most {self.spec.grad_accum_steps} (is_last={is_last})"
            )
        self.engine.set_gradient_accumulation_boundary(is_last)
        self.engine.backward(loss, scale_wrt_gas=False)
        own_norm = self._local_grad_norm() if is_last and self._measures_norm_itself() else None
        self.engine.step()
        self._micro_in_step += 1
        stepped = self.engine.global_steps - self._steps_before
        if stepped != int(is_last):
            raise RuntimeError(
                f"accumulation window out of step: DeepSpeed took {stepped} optimizer steps by "
                f"micro-batch {self._micro_in_step} (is_last={is_last})"
            )
        if is_last:
            self.last_step_applied = bool(self.engine.was_step_applied())
            self.last_grad_norm = self._step_grad_norm(own_norm)
            self._micro_in_step = 0

    def _step_grad_norm(self, own_norm: Optional[float]) -> Optional[float]:
        """The step's pre-clip global gradient norm, identical on every rank; ``None`` only if a user's DeepSpeed
        JSON turned ``zero_optimization.compute_grad_norm`` off."""
        if not self.last_step_applied:
            return float("inf")  # DeepSpeed's own report for a skipped step: the gradient was not finite
        if own_norm is not None:
            return own_norm
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str) -> None:
        """Model, optimizer and LR-schedule state (this rank's ZeRO partitions) plus this rank's RNG states.

        Collective: every rank of the group calls it with the same ``directory``.
        """
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }
        self.engine.save_checkpoint(
            directory,
            tag=CHECKPOINT_TAG,
            client_state={"rng": rng},
            save_latest=False,
            exclude_frozen_parameters=self.adapters_only,
        )

    def load_checkpoint(self, directory: str) -> None:
        _, client = self.engine.load_checkpoint(
            directory,
            tag=CHECKPOINT_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not self.adapters_only,
        )
        if client is None:
            raise RuntimeError(f"no checkpoint under {directory}/{CHECKPOINT_TAG}")
        torch.set_rng_state(client["rng"]["torch"])
        if client["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(client["rng"]["cuda"])

    def _measures_norm_itself(self) -> bool:
        # ZeRO 0 keeps whole, already all-reduced gradients in `.grad`, so the norm is taken here, in float64: fp32 and
        # fp64 wrap a torch optimizer that computes none. In bf16 the multi-tensor step (rlhf.distributed.unfused_step)
        # takes DeepSpeed's float32 norm, the one it clips with, and that is the one reported, as at ZeRO 1-3 in bf16
        # (BF16_Optimizer and the ZeRO optimizers reduce theirs over ranks, in fp32): a second pass over every
        # gradient would cost what the multi-tensor step saves. DeepSpeed's own bf16 step reports no usable norm.
        return self.spec.zero_stage == 0 and not self._unfused_step

    def _local_grad_norm(self) -> float:
        grads = [p.grad.detach() for p in self.engine.module.parameters() if p.grad is not None]
        squares, scratch = float64_sum_of_squares(grads, self._norm_buffer)
        # Kept only on CPU, where fresh pages are the cost (CUDA's allocator caches by itself), and only while
        # small: the largest gradient of a big model (an embedding) would hold gigabytes between steps.
        keep = scratch is not None and scratch.device.type == "cpu" and scratch.numel() <= _NORM_BUFFER_MAX_ELEMENTS
        self._norm_buffer = scratch if keep else None
        return math.sqrt(squares)


def float64_sum_of_squares(
    tensors: Sequence[torch.Tensor], scratch: Optional[torch.Tensor] = None
) -> Tuple[float, Optional[torch.Tensor]]:
    """The sum of every element's square, in float64 (a float32 square is exact in float64).

    Each tensor is upcast into ``scratch`` (a 1-D float64 buffer, grown when too small) and squared in place: the
    same values summed in the same order as ``sum(t.double().pow(2).sum() for t in tensors)``, so the same bits,
    without allocating two float64 copies of every tensor each call (fresh pages: 20-120 ms a step for 25M
    parameters on CPU). Returns the sum and the buffer, for the next call.
    """
    if not tensors:
        return 0.0, scratch
    device, largest = tensors[0].device, max(t.numel() for t in tensors)
    if scratch is None or scratch.numel() < largest or scratch.device != device:
        scratch = torch.empty(largest, dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors:
        upcast = scratch[: tensor.numel()].view(tensor.shape).copy_(tensor)
        total += upcast.mul_(upcast).sum()
    return float(total), scratch


_CPU = torch.device("cpu")
GATHER_BYTES = 64 << 20  # ZeRO-3: full parameters gathered at once for a weight sync or an export
Keep = Callable[[str], bool]  # which state-dict entries to yield, by name


# Typed per device: a device yields tensors, ``device=None`` yields ``None`` for each.
@overload
def iter_full_state(
    module: torch.nn.Module, zero_stage: int, device: torch.device = _CPU, *, keep: Optional[Keep] = None
) -> Iterator[Tuple[str, torch.Tensor]]: ...


@overload
def iter_full_state(
    module: torch.nn.Module, zero_stage: int, device: None, *, keep: Optional[Keep] = None
) -> Iterator[Tuple[str, None]]: ...


@overload
def iter_full_state(
    module: torch.nn.Module, zero_stage: int, device: Optional[torch.device] = _CPU, *, keep: Optional[Keep] = None
) -> Iterator[Tuple[str, Optional[torch.Tensor]]]: ...


def iter_full_state(
    module: torch.nn.Module,
    zero_stage: int,
    device: Optional[torch.device] = _CPU,
    gather_bytes: int = GATHER_BYTES,
    *,
    keep: Optional[Keep] = None,
) -> Iterator[Tuple[str, Optional[torch.Tensor]]]:
    """Yield ``(name, full tensor on device)`` for every entry of the module's state dict (those whose name ``keep``
    accepts, when given: the others are never gathered), gathering ZeRO-3 shards.

    ``device=None`` yields ``(name, None)``: the caller only takes part in the gathers. Collective under ZeRO-3:
    every rank of the group must iterate in lockstep. ZeRO-3 gathers the parameters of consecutive entries together,
    about ``gather_bytes`` of full parameters at a time (:func:`gather_chunks`): one all-gather per chunk instead of
    one per tensor, and memory bounded by the chunk.
    """
    entries = [(n, v) for n, v in module.state_dict(keep_vars=True).items() if keep is None or keep(n)]
    if zero_stage != 3:
        for name, value in entries:
            yield name, None if device is None else value.detach().to(device)
        return
    import deepspeed

    params = dict(module.named_parameters(remove_duplicate=False))  # tied weights appear under both names
    for chunk in gather_chunks(entries, params, gather_bytes):
        gathered = list({id(p): p for p in (params.get(name) for name, _ in chunk) if p is not None}.values())
        with deepspeed.zero.GatheredParameters(gathered, modifier_rank=None):
            for name, value in chunk:
                param = params.get(name)
                source = param.data if param is not None else value
                # a copy: the gathered storage is released when the context exits
                yield name, None if device is None else source.detach().to(device, copy=True)


def gather_chunks(
    entries: Sequence[Tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor], gather_bytes: int
) -> List[List[Tuple[str, torch.Tensor]]]:
    """``entries`` (a state dict's items, in order) cut into consecutive chunks whose parameters hold about
    ``gather_bytes`` when gathered (a ZeRO-3 parameter's full size is its ``ds_numel``); a parameter larger than that
    is a chunk of its own, a tied weight counts once per chunk."""
    chunks: List[List[Tuple[str, torch.Tensor]]] = [[]]
    size, seen = 0, set[int]()
    for name, value in entries:
        param = params.get(name)
        nbytes = 0
        if param is not None and id(param) not in seen:
            nbytes = int(getattr(param, "ds_numel", param.numel())) * param.element_size()
        if chunks[-1] and nbytes and size + nbytes > gather_bytes:
            chunks.append([])
            size, seen = 0, set()
        chunks[-1].append((name, value))
        if param is not None and id(param) not in seen:
            seen.add(id(param))
            size += nbytes
    return [c for c in chunks if c]
