"""How one global batch is cut into rank shards and micro-batches: by a row count, or by a token budget.

Pure functions over row lengths; :class:`~rlhf.distributed.group.WorkerGroup` applies the cut to a
:class:`~rlhf.batch.Batch`. Whatever the cut, the group counts the objective's normalizer over the whole global batch
before the first backward and each rank sums its micro-batches' loss sums, so the gradient is the same for every
cut (up to floating-point summation order): cutting decides the cost and the memory of a step, never its maths.

**By rows** (``train.micro_batch_size``): rank ``r`` takes the ``r``-th contiguous shard, cut into consecutive
micro-batches of ``micro_batch_size`` rows.

**By tokens** (``train.max_tokens_per_micro_batch = N``):

1. Ranks: every rank takes the same number of rows, balanced by tokens: rows longest first, each to the rank with
   the fewest tokens so far among those with room (the longest-processing-time rule).
2. Micro-batches: a rank's rows, longest first, each into the first of its micro-batches that stays within ``N``
   tokens, else into a new one (first-fit decreasing).
3. Lockstep: ranks may need different numbers of micro-batches, but every forward and backward of a ZeRO-2/3 rank
   is a collective, and DeepSpeed reduces gradients at the same boundary on every rank. A rank with fewer
   micro-batches runs *fillers* (its shortest row again) marked not counted: the worker multiplies their loss by 0,
   so they add exactly zero to the gradient and nothing to the metrics.

A micro-batch's tokens are what its forward holds: the sum of its sequences' lengths when packed (``train.packing``),
its sequences times the longest one when padded. A row of a preference batch holds two sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

RowLengths = Tuple[int, ...]  # the real lengths of a row's sequences (one, or chosen and rejected)


@dataclass(frozen=True)
class StepCut:
    """One optimizer step's rows: ``micro_batches[r][m]`` are the row indices of rank ``r``'s ``m``-th micro-batch,
    ``counted[r][m]`` False for a lockstep filler. Every rank has the same number of micro-batches."""

    micro_batches: Tuple[Tuple[Tuple[int, ...], ...], ...]
    counted: Tuple[Tuple[bool, ...], ...]

    @property
    def fillers(self) -> int:
        return sum(not c for rank in self.counted for c in rank)


def micro_batch_tokens(rows: Sequence[RowLengths], packing: bool) -> int:
    """Tokens a forward over ``rows`` holds: the sum of lengths packed, sequences x the longest padded."""
    lengths = [n for row in rows for n in row]
    if not lengths:
        return 0
    return sum(lengths) if packing else len(lengths) * max(lengths)


def cut_by_rows(num_rows: int, ranks: int, micro_batch_size: int) -> StepCut:
    """Contiguous rank shards of consecutive ``micro_batch_size``-row micro-batches (``num_rows`` must divide)."""
    per_rank = num_rows // ranks
    if per_rank * ranks != num_rows or per_rank % micro_batch_size:
        raise ValueError(f"{num_rows} rows do not cut into {ranks} ranks of micro-batches of {micro_batch_size}")
    shards = tuple(
        tuple(
            tuple(range(start, start + micro_batch_size))
            for start in range(r * per_rank, (r + 1) * per_rank, micro_batch_size)
        )
        for r in range(ranks)
    )
    return StepCut(micro_batches=shards, counted=tuple((True,) * len(s) for s in shards))


def cut_by_tokens(
    lengths: Sequence[RowLengths], ranks: int, max_tokens: int, packing: bool, sequence_parallel: int = 1
) -> StepCut:
    """Balanced rank shards cut into micro-batches of at most ``max_tokens`` tokens, topped up with fillers to one
    count (see the module docstring). With ``sequence_parallel = n`` the ``ranks`` are sequence groups whose ``n``
    ranks each hold ``1/n`` of a micro-batch's positions: a micro-batch may hold ``n x max_tokens``.

    Raises:
        ValueError: rows that do not divide over the ranks, or a row longer than the budget (naming it).
    """
    if len(lengths) % ranks:
        raise ValueError(f"{len(lengths)} rows do not divide over {ranks} ranks")
    capacity = max_tokens * sequence_parallel
    shared = f" x strategy.sequence_parallel_size={sequence_parallel}" if sequence_parallel > 1 else ""
    for index, row in enumerate(lengths):
        if micro_batch_tokens([row], packing) > capacity:
            raise ValueError(
                f"row {index} holds {micro_batch_tokens([row], packing)} tokens, more than "
                f"train.max_tokens_per_micro_batch={max_tokens}{shared}"
            )
    shards = [_first_fit_decreasing(rows, lengths, capacity, packing) for rows in _balanced_shards(lengths, ranks)]
    most = max(len(s) for s in shards)
    micro, counted = [], []
    for shard in shards:
        shortest = min((row for mb in shard for row in mb), key=lambda i: (sum(lengths[i]), i))
        micro.append(tuple(shard) + ((shortest,),) * (most - len(shard)))
        counted.append((True,) * len(shard) + (False,) * (most - len(shard)))
    return StepCut(micro_batches=tuple(micro), counted=tuple(counted))


def consecutive_by_tokens(lengths: Sequence[RowLengths], max_tokens: int, packing: bool) -> List[range]:
    """Consecutive row ranges of at most ``max_tokens`` tokens each (one row alone may exceed it), in order: the
    forward-only chunks of :meth:`~rlhf.distributed.group.WorkerGroup.score_batch` under a token budget."""
    chunks, start = [], 0
    for stop in range(1, len(lengths) + 1):
        if stop - start > 1 and micro_batch_tokens(lengths[start:stop], packing) > max_tokens:
            chunks.append(range(start, stop - 1))
            start = stop - 1
    if start < len(lengths):
        chunks.append(range(start, len(lengths)))
    return chunks


def _longest_first(rows: Sequence[int], lengths: Sequence[RowLengths]) -> List[int]:
    return sorted(rows, key=lambda i: (-max(lengths[i]), -sum(lengths[i]), i))


def _balanced_shards(lengths: Sequence[RowLengths], ranks: int) -> List[List[int]]:
    """Equal row counts per rank, tokens balanced longest first (ties: the lower rank)."""
    per_rank = len(lengths) // ranks
    shards: List[List[int]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for row in _longest_first(range(len(lengths)), lengths):
        rank = min((r for r in range(ranks) if len(shards[r]) < per_rank), key=lambda r: (tokens[r], r))
        shards[rank].append(row)
        tokens[rank] += sum(lengths[row])
    return shards


def _first_fit_decreasing(
    rows: Sequence[int], lengths: Sequence[RowLengths], max_tokens: int, packing: bool
) -> List[Tuple[int, ...]]:
    bins: List[List[int]] = []
    for row in _longest_first(rows, lengths):
        for members in bins:
            if micro_batch_tokens([lengths[i] for i in members + [row]], packing) <= max_tokens:
                members.append(row)
                break
        else:
            bins.append([row])
    return [tuple(members) for members in bins]
