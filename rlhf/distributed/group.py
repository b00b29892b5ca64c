"""Worker groups: one Ray actor per data-parallel rank of a role, in one placement group, one process group.

The group is the only place that talks to the actors. It owns the sharding: :meth:`WorkerGroup.train_batch`
takes one global batch and an objective, cuts it into rank shards and micro-batches, counts the objective's
normalizer over the whole batch before the first backward, steps, and returns the global metrics;
:meth:`WorkerGroup.score_batch` runs a forward-only function over a batch in chunks and returns one ``(B, ...)``
tensor at the batch's width. Results come back in rank order, and any actor failure becomes a
:class:`WorkerError` naming the role, the rank and the call.

Under sequence parallelism (``EngineSpec.sequence_parallel_size = n``) the ``W`` ranks form ``W / n`` sequence
groups of ``n`` consecutive ranks: the batch is cut over the groups as it would be over ``W / n`` ranks, every rank
of a group gets its group's micro-batches (each runs its share of their positions,
:mod:`rlhf.models.sequence_parallel`), and a group's results are read from its first rank (they hold the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch

from rlhf.batch import Batch, pad_along
from rlhf.config.schema import StrategyConfig
from rlhf.distributed.engine import EngineSpec, OptimSpec
from rlhf.distributed.errors import WorkerError, gather
from rlhf.distributed.micro_batches import StepCut, consecutive_by_tokens, cut_by_rows, cut_by_tokens
from rlhf.distributed.placement import Placement
from rlhf.distributed.rendezvous import DRIVER_GRACE_S
from rlhf.distributed.worker import RankStepResult, TrainerWorker
from rlhf.models.loading import ModelSpec
from rlhf.objectives.base import Objective, ScoreFn, Sums, Totals
from rlhf.utils.flops import perf_metrics

__all__ = ["GroupResources", "StepResult", "WorkerError", "WorkerGroup"]


@dataclass(frozen=True)
class StepResult:
    """One optimizer step of a group on one global batch.

    ``metrics`` is the objective's :meth:`~rlhf.objectives.base.Objective.finalize` of ``sums`` (added over every
    rank and micro-batch) by ``normalizer`` (counted over the whole batch): the step's global numbers, whatever
    the split. Keep ``sums`` / ``normalizer`` to finalize over several steps at once (:class:`Totals`).
    """

    metrics: Dict[str, float]
    sums: Sums
    normalizer: int
    grad_norm: Optional[float]  # pre-clip global norm (None when the engine did not measure one)
    lr: float  # the LR this step used
    num_samples: int
    # Under a token budget: micro-batches each rank ran (the lockstep count) and how many of all ranks' were
    # zero-weight fillers. None when cut by rows (micro_batch_size x grad_accum_steps, no fillers).
    micro_batches: Optional[int] = None
    fillers: Optional[int] = None

    def cut_metrics(self) -> Dict[str, int]:
        """``micro_batches`` and ``fillers`` for a metrics row, under a token budget; empty otherwise."""
        if self.micro_batches is None:
            return {}
        # cast: train_batch sets fillers together with micro_batches
        return {"micro_batches": self.micro_batches, "fillers": cast(int, self.fillers)}


@dataclass(frozen=True)
class GroupResources:
    num_workers: int
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    env_vars: Dict[str, str] = field(default_factory=dict)


class WorkerGroup:
    """``resources.num_workers`` :class:`TrainerWorker` actors for one ``role``."""

    worker_class = TrainerWorker  # what each rank's actor hosts (a subclass may extend it)

    def __init__(
        self,
        role: str,
        resources: GroupResources,
        backend: str,
        placement: Optional[Placement] = None,
        init_timeout_s: float = StrategyConfig.init_timeout_s,
    ) -> None:
        """``placement``: a placement group shared with colocated roles (rank r on its bundle r); by default
        the group makes and owns one of its own. ``init_timeout_s`` (``strategy.init_timeout_s``) bounds forming
        the process group: a rank that never arrives is named, and the group's actors are stopped."""
        import ray

        self.role = role
        self.size = resources.num_workers
        self._owns_placement = placement is None
        if placement is None:
            placement = Placement(role, self.size, resources.cpus_per_worker, resources.gpus_per_worker)
        elif placement.num_bundles != self.size:
            raise ValueError(
                f"{role}: {self.size} workers cannot share {placement.name}'s {placement.num_bundles} bundles"
            )
        self.placement = placement
        self.engine_spec: Optional[EngineSpec] = None  # set by build(): the micro-batch and accumulation shape
        self.trainable = False
        self.held: Set[str] = set()  # the roles of the frozen models its ranks hold beside their own (hold)
        actor_cls = ray.remote(self.worker_class)
        # ray.actor.ActorHandle[TrainerWorker]; Any: ray's annotations give its methods no typed .remote
        self.workers: List[Any] = [
            actor_cls.options(
                **placement.actor_options(rank), runtime_env={"env_vars": dict(resources.env_vars)}
            ).remote(role, rank, self.size, placement.threads_per_actor)
            for rank in range(self.size)
        ]
        try:
            # started first, without the bound: a busy cluster may take long to start an actor (its runtime
            # environment, imports), which is not a peer failing to arrive
            self._gather([w.__ray_ready__.remote() for w in self.workers], "start")
            addr, port = self._gather(
                [self.workers[0].rendezvous_address.remote()], "rendezvous_address", init_timeout_s
            )[0]
            # the ranks' own bound names the rank they waited for; the driver's, longer, one that never answered
            self._gather(
                [w.init_process_group.remote(addr, port, backend, init_timeout_s) for w in self.workers],
                "init_process_group",
                init_timeout_s + DRIVER_GRACE_S,
            )
        except WorkerError:
            self.shutdown()  # nothing stays blocked: the ranks still waiting, or stuck, are stopped
            raise

    # ------------------------------------------------------------------ calls
    def build(self, model: ModelSpec, engine: EngineSpec, optim: Optional[OptimSpec]) -> List[Dict[str, int]]:
        """Load ``model`` on every rank; with ``optim``, under a training engine shaped by ``engine`` (one optimizer
        step = ``engine.micro_batch_size x engine.grad_accum_steps x`` ranks rows), else frozen for scoring (in
        chunks of ``engine.micro_batch_size`` rows)."""
        if self.size % engine.sequence_parallel_size:
            raise ValueError(
                f"{self.role}: {self.size} ranks do not form sequence groups of "
                f"strategy.sequence_parallel_size={engine.sequence_parallel_size}"
            )
        self.engine_spec, self.trainable, self.held = engine, optim is not None, set()
        return self._gather([w.build.remote(model, engine, optim) for w in self.workers], "build")

    def hold(self, role: str, model: ModelSpec, engine: EngineSpec) -> List[Dict[str, int]]:
        """Load the frozen ``model`` of ``role`` (a reference, a teacher) into every rank's own process beside the
        model it trains (:meth:`TrainerWorker.hold`), sharded as a frozen group of as many ranks shaped by
        ``engine`` would be; :meth:`score_batch` with ``on=role`` scores on it, in the same chunks as on the
        trained model."""
        if not self.trainable:
            raise RuntimeError(f"{self.role}: hold({role!r}) needs a group built trainable")
        built = self._gather([w.hold.remote(role, model, engine) for w in self.workers], "hold")
        self.held.add(role)
        return built

    def release(self, role: str) -> None:
        """Every rank lets the model it holds as ``role`` go (:meth:`TrainerWorker.release`)."""
        self._gather([w.release.remote(role) for w in self.workers], "release")
        self.held.discard(role)

    @property
    def global_batch_size(self) -> int:
        """Rows :meth:`train_batch` takes: micro-batch size x accumulation steps x data-parallel ranks."""
        return self._spec("global_batch_size").global_batch_size(self.size)

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks sharing each row (1 before build())."""
        return self.engine_spec.sequence_parallel_size if self.engine_spec is not None else 1

    @property
    def data_parallel_size(self) -> int:
        """Sequence groups: the ranks a batch is cut over."""
        return self.size // self.sequence_parallel_size

    def _ranks_text(self) -> str:
        """``2 ranks``, or ``2 sequence groups of 2 ranks`` under sequence parallelism."""
        n = self.sequence_parallel_size
        return f"{self.size} ranks" if n == 1 else f"{self.data_parallel_size} sequence groups of {n} ranks"

    def _to_ranks(self, per_group: Sequence[Any]) -> List[Any]:
        """Each sequence group's item given to every rank of the group (identity without sequence parallelism)."""
        return [per_group[r // self.sequence_parallel_size] for r in range(self.size)]

    def _of_groups(self, per_rank: Sequence[Any]) -> List[Any]:
        """Each sequence group's first rank's result."""
        return list(per_rank[:: self.sequence_parallel_size])

    # ------------------------------------------------------------------ training
    def train_batch(self, batch: Batch, objective: Objective, schedule_step: Optional[int] = None) -> StepResult:
        """One optimizer step on one global batch of exactly :attr:`global_batch_size` rows.

        The rows are cut into rank shards and micro-batches by the build's spec (:mod:`rlhf.distributed.micro_batches`):
        by default rank ``r`` takes the ``r``-th contiguous shard in ``grad_accum_steps`` micro-batches of
        ``micro_batch_size`` rows; under ``max_tokens_per_micro_batch`` the shards are balanced by tokens and cut
        by the budget, with zero-weight fillers keeping the ranks in lockstep. Each micro-batch is trimmed to its
        own longest row. ``objective.count`` is added over all of them before the first backward, so every cut of
        the same rows gives the same gradient. ``schedule_step`` is the run's 0-based optimizer step, which sets
        the LR (:meth:`TrainerWorker.train_step`); ``None`` continues from the previous step.
        """
        spec = self._spec("train_batch")
        if not self.trainable:
            raise ValueError(f"{self.role}: train_batch needs a trainable group (built with an optimizer)")
        if len(batch) != self.global_batch_size:
            shape = (
                f"{self.global_batch_size // self.data_parallel_size} rows per rank in micro-batches of at most "
                f"{spec.max_tokens_per_micro_batch} tokens"
                if spec.max_tokens_per_micro_batch
                else f"micro_batch_size {spec.micro_batch_size} x grad_accum_steps {spec.grad_accum_steps}"
            )
            raise ValueError(
                f"{self.role}: train_batch got {len(batch)} rows; one optimizer step takes "
                f"{shape} x {self._ranks_text()} = {self.global_batch_size}"
            )
        cut = self._cut(batch, spec)
        per_rank = [[_piece(batch, rows) for rows in shard] for shard in cut.micro_batches]
        # the whole global batch, before any backward (fillers repeat a row: not counted)
        normalizer = sum(
            objective.count(mb) for mbs, counted in zip(per_rank, cut.counted) for mb, keep in zip(mbs, counted) if keep
        )
        results = self.train_step(
            self._to_ranks(per_rank),
            objective,
            normalizer,
            schedule_step,
            counted=self._to_ranks([list(c) for c in cut.counted]) if cut.fillers else None,
        )
        norms = {repr(r.grad_norm) for r in results}  # repr: a NaN equals itself here
        if len(norms) > 1:  # the norm is all-reduced: ranks that disagree trained different models
            raise RuntimeError(f"{self.role}: ranks report different grad norms {[r.grad_norm for r in results]}")
        totals = Totals(normalizer=normalizer)
        for result in self._of_groups(results):
            totals.add(result.sums, 0)
        by_tokens = bool(spec.max_tokens_per_micro_batch)
        return StepResult(
            metrics=totals.finalize(objective),
            sums=totals.sums,
            normalizer=normalizer,
            grad_norm=results[0].grad_norm,
            lr=results[0].lr,
            num_samples=len(batch),
            micro_batches=len(cut.micro_batches[0]) if by_tokens else None,
            fillers=cut.fillers if by_tokens else None,
        )

    def train_step(
        self,
        per_rank: Sequence[List[Batch]],
        objective: Objective,
        normalizer: int,
        schedule_step: Optional[int] = None,
        counted: Optional[Sequence[List[bool]]] = None,
    ) -> List[RankStepResult]:
        """The primitive under :meth:`train_batch`: one optimizer step on micro-batches the caller placed
        (``per_rank[r]`` for rank r) with a ``normalizer`` the caller counted over all of them; ``counted[r][m]``
        False marks a lockstep filler (default: every micro-batch counts). Prefer :meth:`train_batch`; this is for
        tests that place rows on ranks by hand."""
        if len(per_rank) != self.size:
            raise ValueError(f"{self.role}: {len(per_rank)} rank shards for {self.size} workers")
        flags: Sequence[Optional[List[bool]]] = counted or [None] * self.size  # None: the rank's default, all count
        refs = [
            w.train_step.remote(mb, objective, normalizer, schedule_step, c)
            for w, mb, c in zip(self.workers, per_rank, flags)
        ]
        return self._gather(refs, "train_step")

    def _cut(self, batch: Batch, spec: EngineSpec) -> StepCut:
        if not spec.max_tokens_per_micro_batch:
            return cut_by_rows(len(batch), self.data_parallel_size, spec.micro_batch_size)
        try:
            return cut_by_tokens(
                row_lengths(batch),
                self.data_parallel_size,
                spec.max_tokens_per_micro_batch,
                spec.packing,
                spec.sequence_parallel_size,
            )
        except ValueError as err:  # name the sample, not just its row in this batch
            raise ValueError(f"{self.role}: {_with_sample(err, batch)}") from None

    # ------------------------------------------------------------------ forward only
    def score_batch(
        self, batch: Batch, fn: ScoreFn, rows_per_forward: Optional[int] = None, on: Optional[str] = None
    ) -> torch.Tensor:
        """``fn`` over ``batch`` in chunks of ``rows_per_forward`` rows (default: the build's micro-batch size),
        each trimmed to its own longest row, spread over the ranks -> one ``(B, ...)`` tensor; ``on``: on the frozen
        model the ranks hold as that role (:meth:`hold`), not on their own model.

        Per-token results (``(B, T)``, ``(B, 2, T)`` for pairs, or with trailing axes ``(B, T, ...)``) are
        right-padded with zeros along the time axis back to the batch's width ``T``; per-row results (``(B,)``,
        ``(B, 2)``) are concatenated. Floating results are at least float32 (float64 stays float64: an fp64 run's
        models score in float64).
        """
        if not len(batch):
            raise ValueError(f"{self.role}: score_batch of an empty batch")
        parts = self.score(self._chunks(batch, rows_per_forward, "score_batch"), fn, on)
        width, time_axis = batch.input_ids.shape[-1], batch.input_ids.dim() - 1
        # per-token results have input_ids' rank, or more (a trailing axis: a teacher's top-k, (B, T, K, 2))
        per_token = [p.dim() >= batch.input_ids.dim() for p in parts]
        out = torch.cat([pad_along(p, width, time_axis) if token else p for p, token in zip(parts, per_token)])
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out

    def evaluate_batch(self, batch: Batch, objective: Objective, rows_per_forward: Optional[int] = None) -> Totals:
        """Forward-only ``objective`` over ``batch`` in chunks (as :meth:`score_batch`) -> its sums and normalizer,
        to be added over every chunk of a held-out set and finalized once."""
        chunks = self._chunks(batch, rows_per_forward, "evaluate_batch")
        totals = Totals()
        totals.add(self.evaluate(chunks, objective), sum(objective.count(c) for c in chunks))
        return totals

    def score(self, batches: Sequence[Batch], fn: ScoreFn, on: Optional[str] = None) -> List[Any]:
        """Run ``fn`` over ``batches`` spread across the ranks (``on``: on the model they hold as that role);
        results in the order of ``batches``.

        Every rank runs the same number of forwards (see :meth:`_spread`); filler results are dropped.
        """
        if not batches:
            return []
        shards, _ = self._spread(batches)
        calls = [w.score.remote(s, fn, on) for w, s in zip(self.workers, shards)]
        results = self._gather(calls, "score")
        return [out for shard in self._of_groups(results) for out in shard][: len(batches)]

    def evaluate(self, batches: Sequence[Batch], objective: Objective) -> Sums:
        """Forward-only objective sums over ``batches`` spread across the ranks, added over ranks."""
        shards, counted = self._spread(batches)
        results = self._gather(
            [w.evaluate.remote(s, objective, c) for w, s, c in zip(self.workers, shards, counted)], "evaluate"
        )
        totals = Totals()
        for sums in self._of_groups(results):
            totals.add(sums, 0)
        return totals.sums

    def perf_metrics(self) -> Dict[str, float]:
        """``perf/<role>/tokens_per_s`` and ``perf/<role>/mfu`` of this group's optimizer steps, and the
        ``forward_`` pair of its scoring passes, since the last call (:func:`rlhf.utils.flops.perf_metrics`)."""
        ranks = self._gather([w.take_perf.remote() for w in self.workers], "take_perf")
        return perf_metrics(self.role, [r["work"] for r in ranks], ranks[0]["peak_tflops"])

    def _spread(self, batches: Sequence[Batch]):
        """Contiguous equal shards per sequence group (per rank without sequence parallelism), given to each of
        its ranks. Under ZeRO-3 every forward is a collective, so ranks must run the same number of them: short
        shards are topped up with a repeat of the last batch, marked not counted."""
        groups = self.data_parallel_size
        per_group = -(-len(batches) // groups)
        filler = per_group * groups - len(batches)
        padded = list(batches) + [batches[-1]] * filler
        counted = [True] * len(batches) + [False] * filler
        cut = lambda xs: self._to_ranks([xs[g * per_group : (g + 1) * per_group] for g in range(groups)])  # noqa: E731
        return cut(padded), cut(counted)

    def attach_weight_senders(self, senders: Sequence[Any], adapter_only: bool = False) -> List[Any]:
        """Give rank r ``senders[r]`` (a ``WeightSender`` or ``None``); returns what each one's ``listen`` gave.
        ``adapter_only``: every sync sends the LoRA adapter alone (``model.lora.sync=adapter``)."""
        if len(senders) != self.size:
            raise ValueError(f"{self.role}: {len(senders)} weight senders for {self.size} workers")
        return self._gather(
            [w.attach_weight_sender.remote(s, adapter_only) for w, s in zip(self.workers, senders)],
            "attach_weight_sender",
        )

    def connect_weight_senders_async(self) -> List[Any]:
        """Start every rank's ``connect``; the caller gathers the refs after telling the peers to join."""
        return [w.connect_weight_sender.remote() for w in self.workers]

    def push_weights(self, version: Optional[int] = None) -> Dict[str, Any]:
        """Full weights (or the LoRA adapter alone) -> the rollout engines through the attached senders, as weight
        ``version`` (checked on arrival: :func:`rlhf.rollout.weights.senders.check_delivery`); the sending ranks'
        stats merged (bytes and tensors per engine as rank 0 saw them, seconds of the slowest rank)."""
        refs = [w.push_weights.remote(version) for w in self.workers]
        stats = [s for s in self._gather(refs, "push_weights") if s]
        if not stats:
            return {}
        return {**stats[0], "seconds": max(s["seconds"] for s in stats)}

    def release_cached_memory(self) -> None:
        """Every rank empties its CUDA cache (a no-op on CPU): before colocated rollout engines wake up."""
        self._gather([w.release_cached_memory.remote() for w in self.workers], "release_cached_memory")

    def sleep(self) -> List[int]:
        """Every rank's state to host memory while engines on its device generate (:meth:`TrainerWorker.sleep`);
        the bytes each moved."""
        return self._gather([w.sleep.remote() for w in self.workers], "sleep")

    def sleep_held(self, roles: Sequence[str]) -> List[int]:
        """Every rank's held models of ``roles`` to host memory until they next score (``colocate.offload_frozen``,
        :meth:`TrainerWorker.sleep_held`); the bytes each rank moved."""
        return self._gather([w.sleep_held.remote(list(roles)) for w in self.workers], "sleep_held")

    def wake(self) -> None:
        """Every rank's state back on its device (:meth:`TrainerWorker.wake`)."""
        self._gather([w.wake.remote() for w in self.workers], "wake")

    def ping(self) -> List[int]:
        """Every rank's number, in order: a liveness check."""
        return self._gather([w.ping.remote() for w in self.workers], "ping")

    def save_checkpoint(self, directory: str) -> None:
        """Every rank's model / optimizer / schedule / RNG state under ``directory`` (shared storage)."""
        self._gather([w.save_checkpoint.remote(directory) for w in self.workers], "save_checkpoint")

    def load_checkpoint(self, directory: str) -> None:
        self._gather([w.load_checkpoint.remote(directory) for w in self.workers], "load_checkpoint")

    def placements(self) -> List[dict]:
        """Every rank's placement group id and assigned resources, in rank order."""
        return self._gather([w.placement.remote() for w in self.workers], "placement")

    def save_pretrained(self, path: str, merged: bool = True) -> None:
        """The model as an HF directory (:meth:`TrainerWorker.save_pretrained`; ``merged``: a LoRA model's merged
        weights plus ``adapter/``, else its adapter alone)."""
        self._gather([w.save_pretrained.remote(path, merged) for w in self.workers], "save_pretrained")

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        if self._owns_placement:
            self.placement.remove()
        self.workers = []

    # ------------------------------------------------------------------ helpers
    def _chunks(self, batch: Batch, rows_per_forward: Optional[int], call: str) -> List[Batch]:
        """Forward-only chunks in order: ``rows_per_forward`` rows each, by default the build's micro-batch size,
        or under a token budget consecutive rows within ``max_tokens_per_micro_batch``."""
        spec = self._spec(call)
        if rows_per_forward is None and spec.max_tokens_per_micro_batch:
            budget = spec.max_tokens_per_micro_batch * spec.sequence_parallel_size  # a group holds n ranks' share
            ranges = consecutive_by_tokens(row_lengths(batch), budget, spec.packing)
            return [_piece(batch, rows) for rows in ranges]
        return _pieces(batch, rows_per_forward or spec.micro_batch_size)

    def _spec(self, call: str) -> EngineSpec:
        if self.engine_spec is None:
            raise RuntimeError(f"{self.role}: {call} before build()")
        return self.engine_spec

    def _gather(self, refs: List[Any], call: str, timeout_s: Optional[float] = None) -> List[Any]:
        """``ray.get`` in rank order; the first failure raises a :class:`WorkerError` naming role and rank."""
        return gather(refs, [f"{self.role} rank {r}" for r in range(len(refs))], call, timeout_s)


def _pieces(batch: Batch, size: int) -> List[Batch]:
    """Consecutive pieces of ``size`` rows (the last may be shorter), as :func:`_piece` makes them."""
    return [_piece(batch, range(i, min(i + size, len(batch)))) for i in range(0, len(batch), size)]


def _piece(batch: Batch, rows: Sequence[int]) -> Batch:
    """``rows`` of ``batch``, trimmed to their longest row and in their own memory (a view would ship the whole
    batch's storage to the actor)."""
    return batch.select(rows).trim().contiguous()


def row_lengths(batch: Batch) -> List[Tuple[int, ...]]:
    """The real length of each row's sequences, from the attention mask: ``(L,)`` or ``(L_chosen, L_rejected)``."""
    lengths = batch.attention_mask.long().sum(-1)
    return [tuple(row) for row in lengths.reshape(len(batch), -1).tolist()]


def _with_sample(err: ValueError, batch: Batch) -> str:
    """``err``'s message with "row i" followed by that row's dataset index, when the batch carries it."""
    text = str(err)
    if batch.sample_index is None or not text.startswith("row "):
        return text
    row = int(text.split()[1])
    return f"row {row} (sample {int(batch.sample_index[row])})" + text[len(f"row {row}") :]
