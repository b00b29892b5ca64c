"""A trainer worker: one data-parallel rank hosting a model and, when trainable, its DeepSpeed engine.

The same class hosts every model role (policy, reference, reward model, critic). It is a plain
class; :class:`rlhf.distributed.group.WorkerGroup` turns it into Ray actors, one per rank, and calls its
methods. Ray and DeepSpeed are imported inside the methods that need them (the rendezvous address, the process
group, a frozen ZeRO-3 engine), so that this module stays importable without them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

import torch

from rlhf.batch import Batch
from rlhf.distributed.cluster import actor_placement, load_cpu_comm_op
from rlhf.distributed.engine import (
    EngineSpec,
    OptimSpec,
    TrainEngine,
    build_ds_config,
    built_spec,
    iter_full_state,
)
from rlhf.distributed.rendezvous import arrive, connect_store, host_store
from rlhf.distributed.sleep import HostCopies, offload_state
from rlhf.models.host_layout import remember_row_lengths
from rlhf.models.loading import ModelSpec, load_model, persistent_numel
from rlhf.models.lora import (
    LoraSpec,
    adapter_named_tensors,
    adapter_sync_config,
    apply_lora,
    is_adapter_tensor,
    merged_named_tensors,
    save_adapter,
    save_merged,
)
from rlhf.models.packing import packed_attention
from rlhf.models.sequence_parallel import SequenceGroup, enable_sequence_parallel, new_sequence_group
from rlhf.objectives.base import DeviceSums, Objective, ScoreFn, Sums
from rlhf.ops.losses import normalize
from rlhf.utils.device import resolve_attn_implementation
from rlhf.utils.flops import ModelFlops, PerfMeter, held_pass, peak_tflops
from rlhf.utils.startup import collector_paused


def _awake(method):
    """A method that needs this rank's tensors: it wakes the rank first if it sleeps (:meth:`TrainerWorker.sleep`),
    whatever called it, so a sleeping rank is never used half-empty."""

    @functools.wraps(method)
    def woken(self: "TrainerWorker", *args, **kwargs):
        self.wake()
        return method(self, *args, **kwargs)

    return woken


class WeightSender(Protocol):
    """The policy side of a weight sync, as a trainer worker sees it (``rlhf.rollout.weights.senders`` implements it).

    ``listen`` runs when the sender is attached to its rank (it may host a rendezvous and return its address),
    ``connect`` once the peers were told that address, ``send`` at every sync with the full named tensors on
    ``device``: the model's, or a LoRA adapter's alone with its PEFT config (``adapter``, adapter-only sync).
    """

    device: torch.device

    def listen(self) -> Optional[object]: ...

    def connect(self) -> None: ...

    def send(
        self,
        named: Iterator[Tuple[str, torch.Tensor]],
        version: Optional[int] = None,
        adapter: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]: ...


@dataclass(frozen=True)
class RankStepResult:
    """What one rank reports for one optimizer step (:meth:`WorkerGroup.train_batch` merges the ranks')."""

    sums: Sums  # metric sums over this rank's micro-batches
    grad_norm: Optional[float]  # pre-clip global norm (identical on every rank)
    lr: float  # LR used by this step


class TrainerWorker:
    def __init__(self, role: str, rank: int, world_size: int, num_threads: int = 1) -> None:
        self.role, self.rank, self.world_size = role, rank, world_size
        torch.set_num_threads(max(1, num_threads))
        self.model: Optional[torch.nn.Module] = None
        self.engine: Optional[TrainEngine] = None
        self.zero_stage = 0
        self.device = torch.device("cpu")
        self.weight_sender: Optional[WeightSender] = None
        # model.lora.sync=adapter: a sync sends the LoRA adapter alone, with this PEFT config (None: the whole model)
        self.adapter_config: Optional[Dict[str, Any]] = None
        self._store = None  # the process group's rendezvous store (rank 0 hosts it; kept alive with the group)
        self.spec: Optional[ModelSpec] = None
        self.lora: Optional[LoraSpec] = None  # the adapters this trainable rank trains (model.lora.*)
        self.perf = PerfMeter()  # seconds, model FLOPs and real tokens of train_step / score (perf/* metrics)
        self.model_flops: Optional[ModelFlops] = None
        self.peak_tflops: Optional[float] = None
        self.sequence_parallel_size = 1  # ranks sharing each row (build() reads it from the engine spec)
        # this rank's sequence group under sequence parallelism (build() makes it)
        self._sequence: Optional[SequenceGroup] = None
        # frozen models held beside the trained one, by role (a reference: colocate.reference_in_policy,
        # dpo.ref_num_workers=0; a distillation teacher: colocate.teacher_in_policy), and their FLOP counts
        self.held: Dict[str, torch.nn.Module] = {}
        self.held_flops: Dict[str, ModelFlops] = {}
        # colocate.trainer_sleep: this rank's state in host memory while engines on its device generate (sleep())
        self.asleep: Optional[HostCopies] = None
        # colocate.offload_frozen: held models in host memory between their passes, by role (sleep_held())
        self.held_asleep: Dict[str, HostCopies] = {}

    def __repr__(self) -> str:
        # Ray prefixes the output it forwards from this actor with its repr: "(policy rank 0 pid=..., ip=...)"
        return f"{self.role} rank {self.rank}"

    # ------------------------------------------------------------------ set-up
    def rendezvous_address(self) -> Tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    @collector_paused()  # imports DeepSpeed
    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> None:
        """Join this role's process group, hosted by rank 0 at ``master_addr:master_port``.

        Bounded (``strategy.init_timeout_s``): a rank that cannot reach rank 0's store, or a group where a rank
        never arrives, fails after ``timeout_s`` naming the rank (:mod:`rlhf.distributed.rendezvous`). The backend
        is built only once every rank has arrived; DeepSpeed then adopts the group."""
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.constants import default_pg_timeout

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
        )
        members = [f"{self.role} rank {r}" for r in range(self.world_size)]
        if self.rank == 0:
            store = host_store(master_addr, master_port, self.world_size, timeout_s)
        else:
            store = connect_store(master_addr, master_port, self.world_size, timeout_s, members[self.rank], members[0])
        self._store = store
        arrive(store, self.rank, members, timeout_s, f"the {self.role}'s process group")
        # From here the store serves the group (its backend's and DeepSpeed's sub-groups' set-up): with the
        # collectives' timeout, as under torch's own env:// rendezvous, not the arrival bound.
        store.set_timeout(default_pg_timeout)
        options: Dict[str, Any] = {}
        if backend == "nccl":
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so it is device 0 here.
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
            # bound as DeepSpeed binds it: the NCCL communicator is built here, every peer present (not on torch
            # 2.6.x-2.7.0, where binding can hang, pytorch#153960: there it is built at the first collective)
            if self.world_size > 1 and not torch.__version__.startswith(("2.6.", "2.7.0")):
                options["device_id"] = self.device
        # The collectives' own timeout stays DeepSpeed's (DEEPSPEED_TIMEOUT, 10 minutes by default).
        torch.distributed.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=default_pg_timeout, **options
        )
        # DeepSpeed's CPU accelerator loads its communication op in init_distributed: loaded here first, bounded,
        # a dead build's lock cleared (a GPU rank, even on gloo, has no such op)
        if get_accelerator().device_name() == "cpu":
            load_cpu_comm_op()
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)

    @collector_paused()  # imports transformers, builds the model and its engine
    @_awake
    def build(self, model: ModelSpec, engine: EngineSpec, optim: Optional[OptimSpec]) -> Dict[str, int]:
        """Load the model; with ``optim`` wrap it in a training engine, else keep it frozen for scoring. A reference
        held for an earlier build is let go (:meth:`hold` follows the build it belongs to)."""
        self.held, self.held_flops, self.held_asleep = {}, {}, {}
        model = self._with_attention(model)
        engine = built_spec(engine, self.world_size)  # a one-rank group builds ZeRO 1 for 2 and 3
        zero3 = None
        if engine.zero_stage == 3:  # load straight into partitions, and reuse the config for a frozen engine
            engine = dataclasses.replace(engine, persist_numel=persistent_numel(model))
            zero3 = build_ds_config(engine, self.world_size, 0.0, trainable=optim is not None)
        module = load_model(model, zero3_config=zero3)
        self.zero_stage, self.spec = engine.zero_stage, model
        if optim is not None and model.lora is not None:
            # outside zero.Init (partitioned weights are loaded by now): the adapters start whole, B = 0, and the
            # engine partitions them like any parameter
            module = apply_lora(module, model.lora, model.kind, seed=model.seed)
            self.lora = model.lora
        self.sequence_parallel_size = engine.sequence_parallel_size
        if self.sequence_parallel_size > 1:  # collective: every rank makes every sequence group
            self._sequence = new_sequence_group(
                self.rank, self.world_size, self.sequence_parallel_size, model.attn_implementation
            )
            enable_sequence_parallel(module, self._sequence)
        if optim is not None:
            self.engine = TrainEngine(module, engine=engine, optim=optim, world_size=self.world_size)
            self.engine.train()
            self.model = self.engine.module
        else:
            self.model = self._frozen(module, zero3)
        self.model_flops = ModelFlops.of(self.model)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.peak_tflops = engine.peak_tflops or peak_tflops(device_name, model.precision)
        return _parameter_counts(self.model, trainable=optim is not None)

    @collector_paused()  # imports transformers, builds a frozen model (a frozen ZeRO-3 engine)
    @_awake
    def hold(self, role: str, model: ModelSpec, engine: EngineSpec) -> Dict[str, int]:
        """Load a frozen model of ``role`` (a reference, a teacher) into this trainable rank's own process, beside
        the model it trains (RL's ``colocate.reference_in_policy`` / ``teacher_in_policy``, as verl's fused
        actor-reference worker; DPO's ``dpo.ref_num_workers=0``, as TRL's ``ref_model``): no process of its own,
        and on a GPU no second CUDA context or communicator. Sharded as a frozen group's rank would be (ZeRO 3 over
        this group), run sequence-parallel in this rank's sequence group. Collective under ZeRO 3: every rank calls
        it. ``score(..., on=role)`` runs on it."""
        if self.engine is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: hold({role!r}) needs a built trainable worker")
        model = self._with_attention(model)
        engine = built_spec(engine, self.world_size)
        zero3 = None
        if engine.zero_stage == 3:
            engine = dataclasses.replace(engine, persist_numel=persistent_numel(model))
            zero3 = build_ds_config(engine, self.world_size, 0.0, trainable=False)
        module = load_model(model, zero3_config=zero3)
        if self._sequence is not None:
            enable_sequence_parallel(module, self._sequence)
        self.held[role] = self._frozen(module, zero3)
        self.held_flops[role] = ModelFlops.of(self.held[role])
        self.held_asleep.pop(role, None)  # the copies of a model held before under this role
        return _parameter_counts(self.held[role], trainable=False)

    @_awake
    def release(self, role: str) -> None:
        """Let the model held as ``role`` go (a precomputed reference is not scored again): its memory back to the
        device, or under ZeRO 3 its partitions with it."""
        self.held.pop(role, None)
        self.held_flops.pop(role, None)
        self.held_asleep.pop(role, None)  # asleep: its host copies go with it
        self.release_cached_memory()

    def _with_attention(self, model: ModelSpec) -> ModelSpec:
        """``model`` with its attention resolved where it runs: flash-attention 2 on a CUDA worker that has it,
        else sdpa; a packing run takes the variable-length form of either (rlhf.models.packing)."""
        attention = resolve_attn_implementation(model.attn_implementation, model.precision)
        return dataclasses.replace(
            model, attn_implementation=packed_attention(attention) if model.packing else attention
        )

    def _frozen(self, module: torch.nn.Module, zero3: Optional[Dict[str, Any]]) -> torch.nn.Module:
        """``module`` for scoring only: in eval mode without gradients, on this rank's device, or under ZeRO 3
        (``zero3``: its DeepSpeed config) in a frozen engine of its own that gathers its partitions at each use."""
        if zero3 is not None:
            import deepspeed

            frozen_engine, *_ = deepspeed.initialize(model=module, config=zero3)
            frozen_engine.eval()
            return frozen_engine.module
        module = module.to(self.device).eval()
        module.requires_grad_(False)
        return module

    # ------------------------------------------------------------------ work
    @_awake
    def train_step(
        self,
        micro_batches: List[Batch],
        objective: Objective,
        normalizer: int,
        schedule_step: Optional[int] = None,
        counted: Optional[List[bool]] = None,
    ) -> RankStepResult:
        """One optimizer step over this rank's micro-batches of a global batch.

        Args:
            micro_batches: this rank's share of the global batch: exactly ``grad_accum_steps`` micro-batches, or
                under a token budget as many as every rank of the step runs (at most ``grad_accum_steps``).
            objective: turns a micro-batch into a loss sum and metric sums.
            normalizer: the objective's count summed over the *whole* global batch (all ranks).
            schedule_step: the run's 0-based optimizer step this is, which sets its LR
                (:meth:`TrainEngine.position_schedule`); ``None`` continues from the previous step.
            counted: False for a lockstep filler (:mod:`rlhf.distributed.micro_batches`): its forward and backward
                run, as every rank's must under ZeRO, with its loss times 0 and its metrics dropped. Default: all.
        """
        if self.engine is None:
            raise RuntimeError(f"{self.role} rank {self.rank} is frozen: train_step needs a trainable worker")
        spec = self.engine.spec
        budget = spec.max_tokens_per_micro_batch
        if (
            (len(micro_batches) > spec.grad_accum_steps or not micro_batches)
            if budget
            else len(micro_batches) != spec.grad_accum_steps
        ):
            expected = f"1 to {spec.grad_accum_steps}" if budget else f"grad_accum_steps={spec.grad_accum_steps}"
            raise ValueError(
                f"{self.role} rank {self.rank} got {len(micro_batches)} micro-batches, expected {expected}"
            )
        counted = [True] * len(micro_batches) if counted is None else counted
        if len(counted) != len(micro_batches) or not any(counted):
            raise ValueError(
                f"{self.role} rank {self.rank}: {len(counted)} counted flags for {len(micro_batches)} "
                f"micro-batches, at least one counted"
            )
        started = time.perf_counter()
        if schedule_step is not None:
            self.engine.position_schedule(schedule_step)
        lr = self.engine.current_lr()
        sums = DeviceSums()  # the metrics stay on the device until the step's end: no host read per micro-batch
        last = len(micro_batches) - 1
        for i, (micro, keep) in enumerate(zip(self._upload(micro_batches), counted)):
            loss_sum, micro_sums = objective.loss(self.engine, micro)
            if keep:
                sums.add(micro_sums)
            else:
                loss_sum = loss_sum * 0.0  # a filler: the collectives run, the gradient gains exactly nothing
            self.engine.micro_step(normalize(loss_sum, normalizer, self.world_size), is_last=i == last)
        host = sums.read()
        # the step ended with the gradient norm and the metrics read back from the device: the clock has its work
        self._account("train", micro_batches, counted, time.perf_counter() - started)
        return RankStepResult(sums=host, grad_norm=self.engine.last_grad_norm, lr=lr)

    @torch.no_grad()
    @_awake
    def score(self, batches: List[Batch], fn: ScoreFn, on: Optional[str] = None) -> List[torch.Tensor]:
        """Forward-only ``fn`` over each batch (reference log-probs, rewards, values), results on CPU; ``on``: on
        the frozen model this rank holds as that role (:meth:`hold`), not its own model."""
        assert self.model is not None, "build() sets the model before any call that uses it"
        if on is not None and on not in self.held:
            raise RuntimeError(f"{self.role} rank {self.rank} holds no {on} (holds {sorted(self.held)}): hold() it")
        if on is not None:
            self._wake_held(on)
        model = self.held[on] if on is not None else (self.engine if self.engine is not None else self.model)
        was_training = self.model.training
        self.model.eval()
        started = time.perf_counter()
        try:
            scores = [fn(model, b) for b in self._upload(batches)]
            out = [s.cpu() for s in scores]  # the first read waits for every pass; the others are ready by then
        finally:
            self.model.train(was_training)
        kind = held_pass(on) if on is not None else "forward"
        self._account(kind, batches, [True] * len(batches), time.perf_counter() - started, on)
        return out

    def _upload(self, batches: List[Batch]) -> List[Batch]:
        """``batches`` on this rank's device, every one copied before the caller runs its first pass.

        A copy from (pageable) host memory is a synchronous one: on a GPU it waits until the device has run all it
        was given. Copied one before each pass, a batch would hold the host back until the previous backward had run,
        and the device would then idle while the host queued the next forward's first kernels; copied together at
        the start, when nothing is queued yet, the host queues the whole step ahead of the device. The batches are a
        few integer and float fields a token: small beside one pass's activations. Each copy's mask is told its row
        lengths from the host (:mod:`rlhf.models.host_layout`), so the forwards need not read them back either.
        Copies are compact (as a device copy is; on the CPU twin a trimmed micro-batch is a view until here).
        """
        copies = [b.to(self.device).contiguous() for b in batches]
        for host, copy in zip(batches, copies):
            remember_row_lengths(copy.attention_mask, host.attention_mask)
        return copies

    def _account(
        self, kind: str, batches: List[Batch], counted: List[bool], seconds: float, held: Optional[str] = None
    ) -> None:
        """Add a pass over ``batches`` (those ``counted``) to :attr:`perf`: its seconds, model FLOPs (the model held
        as ``held``'s, if given), real tokens (this rank's share of them under sequence parallelism, where each rank
        of a group runs a share of the positions of the same rows)."""
        model_flops = self.held_flops[held] if held is not None else self.model_flops
        assert model_flops is not None, "build() sets the model's FLOP count"
        lengths = [n for b, keep in zip(batches, counted) if keep for n in b.row_lengths()]
        share = 1 / self.sequence_parallel_size
        flops = model_flops.flops(lengths, training=kind == "train")
        self.perf.add(kind, seconds, flops * share, sum(lengths) * share)

    def take_perf(self) -> Dict[str, Any]:
        """This rank's work since the last call (:class:`rlhf.utils.flops.PerfMeter`) and its device's peak."""
        return {"work": self.perf.take(), "peak_tflops": self.peak_tflops}

    @torch.no_grad()
    @_awake
    def evaluate(self, batches: List[Batch], objective: Objective, counted: List[bool]) -> Sums:
        """Forward-only objective sums over ``batches`` (those with ``counted[i]`` False are lockstep fillers)."""
        assert self.model is not None, "build() sets the model before any call that uses it"
        model = self.engine if self.engine is not None else self.model
        was_training = self.model.training
        self.model.eval()
        sums = DeviceSums()
        try:
            for batch, keep in zip(self._upload(batches), counted):
                _, micro_sums = objective.loss(model, batch)
                if keep:
                    sums.add(micro_sums)
        finally:
            self.model.train(was_training)
        return sums.read()

    @_awake
    def save_pretrained(self, path: str, merged: bool = True) -> None:
        """Write the model as an HF directory (safetensors). Collective: call on every rank; rank 0 writes.

        With LoRA: the merged full model with the adapter in ``path/adapter`` (``merged``), or the adapter alone in
        ``path`` (loadable with ``peft.PeftModel.from_pretrained(base, path)``).
        """
        assert self.model is not None, "build() sets the model before any call that uses it"
        state: Dict[str, torch.Tensor] = {}
        for name, tensor in iter_full_state(self.model, self.zero_stage):
            if self.rank == 0:
                state[name] = tensor
        if self.rank == 0 and self.lora is None:
            # ignore: torch types nn.Module.__getattr__ as Tensor | Module; this is the HF model's method
            self.model.save_pretrained(path, state_dict=state)  # type: ignore[operator]
        elif self.rank == 0:
            assert self.lora is not None and self.spec is not None, "lora None took the branch above; build() set spec"
            if merged:
                save_merged(self.model, self.lora, path, named=state.items())
            save_adapter(
                state.items(),
                self.lora,
                os.path.join(path, "adapter") if merged else path,
                self.spec.kind,
                base_model_name_or_path=self.spec.path,
            )
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    # ------------------------------------------------------------------ weight sync
    @_awake
    def attach_weight_sender(self, sender: Optional[WeightSender], adapter_only: bool = False) -> Optional[object]:
        """Keep this rank's sender (``None``: the rank only takes part in ZeRO-3 gathers); returns the address
        its peers join at, if it hosts a group. ``adapter_only`` (``model.lora.sync=adapter``, every rank alike:
        the ZeRO-3 gathers run in lockstep): each sync sends the LoRA adapter's tensors, not the merged model."""
        self.weight_sender, self.adapter_config = sender, None
        if adapter_only:  # the adapter's names never change: its PEFT config is read once, not at every sync
            if self.lora is None or self.model is None:
                raise ValueError("an adapter-only weight sync needs a built LoRA policy (model.lora.r > 0)")
            self.adapter_config = adapter_sync_config(self.lora, self.model.state_dict(keep_vars=True))
        return sender.listen() if sender is not None else None

    def connect_weight_sender(self) -> None:
        """Join the sender's peers (blocks until they have joined too)."""
        if self.weight_sender is not None:
            self.weight_sender.connect()

    @_awake
    def push_weights(self, version: Optional[int] = None) -> Dict[str, float]:
        """Stream the full weights into this rank's sender, as weight ``version`` (the RL step they come from).

        Collective under ZeRO-3: every rank gathers each parameter in lockstep, whether or not it sends.
        """
        assert self.model is not None, "build() sets the model before any call that uses it"
        sender, keep = self.weight_sender, is_adapter_tensor if self.adapter_config else None
        if sender is None:
            for _ in iter_full_state(self.model, self.zero_stage, device=None, keep=keep):
                pass
            return {}
        named = iter_full_state(self.model, self.zero_stage, device=sender.device, keep=keep)
        if self.lora is None:
            return sender.send(named, version)
        if self.adapter_config:  # the engines keep the base and serve A, B (PEFT's saved names) as a LoRA adapter
            return sender.send(adapter_named_tensors(named), version, adapter=self.adapter_config)
        # the engines hold the base architecture; they get W + (alpha / r) B A under the base's names
        return sender.send(merged_named_tensors(named, self.lora), version)

    def release_cached_memory(self) -> None:
        """Hand the CUDA caching allocator's free blocks back to the driver (a no-op on CPU), so that a rollout
        engine on this device can map its memory back (the hybrid engine's wake-up): vLLM sizes what it maps from
        the device's free memory, which the allocator's cache would otherwise hold."""
        if torch.cuda.is_available():
            import gc

            gc.collect()  # tensors in reference cycles (the last step's graphs) give their blocks back first
            torch.cuda.empty_cache()

    def sleep(self) -> int:
        """Hand this rank's device memory to the engines that share its device (``colocate.trainer_sleep``): the
        storages of the trained model, its gradients and optimizer states, and of the frozen models it holds, wait
        in host memory (:mod:`rlhf.distributed.sleep`) until :meth:`wake` or any method that needs them. Returns the
        bytes moved (0 if already asleep)."""
        if self.asleep is not None:
            return 0
        models = [m for m in (self.model, *self.held.values()) if m is not None]
        engine = [self.engine.engine, self.engine.optimizer] if self.engine is not None else []
        self.asleep = offload_state(models, engine, self.device)
        self.release_cached_memory()
        return self.asleep.nbytes

    def wake(self) -> None:
        """Every storage :meth:`sleep` emptied back on the device, with its bytes (a no-op when awake). A held model
        :meth:`sleep_held` put to sleep stays so until it scores."""
        if self.asleep is not None:
            asleep, self.asleep = self.asleep, None
            asleep.restore()

    @_awake
    def sleep_held(self, roles: Sequence[str]) -> int:
        """Hold the frozen models this rank holds as ``roles`` in host memory until each next scores
        (``colocate.offload_frozen``): the trained model, its gradients and optimizer states stay, so the rank
        trains with the device memory the held weights took. Returns the bytes moved (a role asleep already: 0)."""
        moved = 0
        for role in roles:
            if role in self.held_asleep:
                continue
            self.held_asleep[role] = offload_state([self.held[role]], [], self.device)
            moved += self.held_asleep[role].nbytes
        self.release_cached_memory()
        return moved

    def _wake_held(self, role: str) -> None:
        """The held model of ``role`` back on the device, if :meth:`sleep_held` put it to sleep."""
        asleep = self.held_asleep.pop(role, None)
        if asleep is not None:
            asleep.restore()

    def ping(self) -> int:
        return self.rank

    @_awake
    def save_checkpoint(self, directory: str) -> None:
        self._trainable("save_checkpoint").save_checkpoint(directory)

    @_awake
    def load_checkpoint(self, directory: str) -> None:
        self._trainable("load_checkpoint").load_checkpoint(directory)

    def _trainable(self, call: str) -> TrainEngine:
        if self.engine is None:
            raise RuntimeError(
                f"{self.role} rank {self.rank}: {call} needs a trainable worker (built with an "
                f"optimizer); this one is frozen"
            )
        return self.engine

    def placement(self) -> dict:
        """This rank's placement group and resources (how colocation is checked)."""
        return actor_placement()


def _parameter_counts(model: torch.nn.Module, trainable: bool) -> Dict[str, int]:
    """``model``'s parameters (whole sizes, also of ZeRO-3 partitions) and, when ``trainable``, those it trains."""
    sizes = [(p.ds_numel if hasattr(p, "ds_numel") else p.numel(), p.requires_grad) for p in model.parameters()]
    return {
        "parameters": sum(n for n, _ in sizes),
        "trainable_parameters": sum(n for n, grad in sizes if grad) if trainable else 0,
    }
