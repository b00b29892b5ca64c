"""The factorisations of one global batch that an audit trains: pure arithmetic.

A factorisation is ``(micro, accumulation, ranks)`` with ``micro x accumulation x ranks = global batch``. The
contract (docs/concepts.md) says every one of them trains the same; the audit picks three that differ from the
configured one along each axis without asking for more memory or devices than the run itself:

1. the configured one (the reference every other run is compared with);
2. micro-batch 1 on the same ranks (the accumulation grows: most micro-batches, least padding);
3. one rank with the configured micro-batch (the accumulation grows by the rank count: no cross-rank reduction).

When these coincide (a run on one rank, or with micro-batch 1), the next ones come from larger micro-batches on the
configured ranks, then on one rank, smallest first (micro 2, then 4 ...), until there are three or no other divisor
of the global batch is left.

A run with sequence parallelism (``strategy.sequence_parallel_size = n > 1``: each data-parallel rank is a group of
``n`` ranks sharing every row) is compared with the unsharded run of its split first (``sp 1``: the same micro-batch
and data-parallel ranks, whole rows on each rank), then with the others above, sharded as configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence


@dataclass(frozen=True)
class Factorization:
    """One way to cut the global batch: ``micro`` samples per forward, ``accum`` forwards per rank, ``ranks``."""

    micro: int
    accum: int
    ranks: int  # data-parallel ranks (train.num_workers)
    why: str = ""  # configured | sp 1 | micro 1 | one rank | another split | chosen
    sequence: int = 1  # ranks sharing each row (strategy.sequence_parallel_size)

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.ranks

    @property
    def label(self) -> str:
        """``micro x accumulation x ranks``, e.g. ``2x4x1``; ``2x4x1xsp2`` with rows shared by 2 ranks."""
        return f"{self.micro}x{self.accum}x{self.ranks}" + (f"xsp{self.sequence}" if self.sequence > 1 else "")

    def same_split(self, other: "Factorization") -> bool:
        return (self.micro, self.ranks, self.sequence) == (other.micro, other.ranks, other.sequence)


# ``fits(micro, ranks)``: a further constraint of the run (RL: the critic's ranks must divide the batch too).
Fits = Callable[[int, int], bool]


def split(global_batch: int, micro: int, ranks: int, why: str = "", sequence: int = 1) -> Optional[Factorization]:
    """The factorisation with this micro-batch and rank count, or ``None`` when they do not divide the batch."""
    if micro < 1 or ranks < 1 or global_batch % (micro * ranks):
        return None
    return Factorization(micro, global_batch // (micro * ranks), ranks, why, sequence)


def factorizations(
    global_batch: int, micro: int, ranks: int, count: int = 3, fits: Optional[Fits] = None, sequence: int = 1
) -> List[Factorization]:
    """The configured factorisation first, then up to ``count - 1`` distinct others (module docstring).

    Args:
        global_batch: ``train.global_batch_size``.
        micro: ``train.micro_batch_size`` of the configured run.
        ranks: ``train.num_workers`` of the configured run.
        count: How many factorisations to return at most.
        fits: Extra constraint on ``(micro, ranks)``; the configured split is kept regardless.
        sequence: ``strategy.sequence_parallel_size`` of the configured run.

    Returns:
        Distinct factorisations, the configured one first; fewer than ``count`` when the batch has no more.

    Raises:
        ValueError: The configured micro-batch and ranks do not divide the global batch.
    """
    configured = split(global_batch, micro, ranks, "configured", sequence)
    if configured is None:
        raise ValueError(f"global batch {global_batch} is not divisible by micro {micro} x ranks {ranks}")
    chosen = [configured]
    candidates = [(micro, ranks, 1, "sp 1")] if sequence > 1 else []
    candidates += [(1, ranks, sequence, "micro 1"), (micro, 1, sequence, "one rank")]
    for r in dict.fromkeys((ranks, 1)):  # larger micro-batches, smallest first: configured ranks, then one
        candidates += [(m, r, sequence, "another split") for m in _divisors(global_batch // r) if m > 1]
    for m, r, s, why in candidates:
        if len(chosen) >= count:
            break
        f = split(global_batch, m, r, why, s)
        if f is None or any(f.same_split(c) for c in chosen) or (fits is not None and not fits(m, r)):
            continue
        chosen.append(f)
    return chosen


def parse_factorizations(text: str, global_batch: int, fits: Optional[Fits] = None) -> List[Factorization]:
    """``--factorizations 1x8x1,2x2x2,2x2x2xsp2`` (``micro x accumulation x ranks``, optionally ``x spN``: rows
    shared by ``N`` ranks) checked against the global batch.

    Raises:
        ValueError: A malformed entry, or one whose product is not the global batch or that ``fits`` refuses.
    """
    out: List[Factorization] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        fields = part.lower().split("x")
        try:
            sequence = int(fields.pop()[2:]) if len(fields) == 4 and fields[-1].startswith("sp") else 1
            micro, accum, ranks = (int(x) for x in fields)
        except ValueError:
            raise ValueError(f"{part!r}: expected MICROxACCUMxRANKS[xspN], e.g. 2x4x1 or 2x4x1xsp2") from None
        if min(micro, accum, ranks, sequence) < 1 or micro * accum * ranks != global_batch:
            raise ValueError(
                f"{part!r}: {micro} x {accum} x {ranks} must be the global batch {global_batch} "
                f"(train.global_batch_size), every factor >= 1"
            )
        if fits is not None and not fits(micro, ranks):
            raise ValueError(f"{part!r}: does not fit the run (another group's ranks must divide the batch too)")
        out.append(Factorization(micro, accum, ranks, "chosen", sequence))
    return out


def with_configured(configured: Factorization, others: Sequence[Factorization]) -> List[Factorization]:
    """``configured`` first, then ``others`` without repeats of it or of each other."""
    out = [configured]
    for f in others:
        if not any(f.same_split(c) for c in out):
            out.append(f)
    return out


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
