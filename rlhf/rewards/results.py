"""What scoring a batch with rewards returns, failures included, and the failure policy (``on_error``) that turns
per-sample failures into rewards, dropped samples or an error. Shared by :mod:`rlhf.rewards.pool` and
:mod:`rlhf.rewards.remote`.

``on_error``:

* ``"fail"``: the first failure (in sample order) is raised as :class:`RewardFunctionError`, naming the source, the
  sample and the cause;
* ``"drop"``: the sample is marked in :attr:`ScoreResult.failed`; its rewards are placeholders (0.0), not rewards,
  and the caller must leave the sample (in practice its whole group) out of the loss;
* a number (``0.0``, ``-1.0``): that number stands in for each failed source's reward on that sample, and the
  sample is marked in :attr:`ScoreResult.substituted`.

Whatever the policy, every failure is counted and its message kept: a failure is never a silent 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from rlhf.rewards.functions import RewardFunctionError

__all__ = ["Failure", "OnError", "ScoreResult", "assemble", "check_on_error"]

OnError = Union[str, float]


def check_on_error(on_error: Any, where: str = "on_error") -> OnError:
    """``"fail"``, ``"drop"`` or a finite float; anything else is a ``ValueError`` naming ``where``."""
    if on_error in ("fail", "drop"):
        return str(on_error)
    if isinstance(on_error, bool) or not isinstance(on_error, numbers.Real) or not math.isfinite(float(on_error)):
        raise ValueError(f"{where} must be 'fail', 'drop' or a finite number (the stand-in reward), got {on_error!r}")
    return float(on_error)


@dataclass(frozen=True)
class Failure:
    """One function that failed on one sample: ``kind`` is ``"error"`` or ``"timeout"``; ``index`` is in the batch."""

    index: int
    source: str
    kind: str
    message: str


@dataclass(frozen=True)
class ScoreResult:
    """The rewards of a batch of ``N`` samples and what went wrong while scoring it.

    Attributes:
        total: float32 ``(N,)``, the weighted sum over sources (0.0 where ``failed``).
        per_source: each source's unweighted float32 ``(N,)`` values by name (placeholders 0.0 where ``failed``).
        failed: bool ``(N,)``, samples dropped by ``on_error="drop"``: leave them out of the loss.
        substituted: bool ``(N,)``, samples where the fixed ``on_error`` value stood in for a failed source.
        errors: (sample, source) pairs that failed by raising, returning a bad value or killing their worker.
        timeouts: (sample, source) pairs that hung past their timeout.
        retries: requests sent again (HTTP rewards; 0 for the pool).
        seconds: wall seconds spent scoring.
        failures: one :class:`Failure` per failed (sample, source), in sample order.
    """

    total: torch.Tensor
    per_source: Dict[str, torch.Tensor]
    failed: torch.Tensor
    substituted: torch.Tensor
    errors: int = 0
    timeouts: int = 0
    retries: int = 0
    seconds: float = 0.0
    failures: Tuple[Failure, ...] = field(default=())

    def metrics(self, prefix: str = "reward/") -> Dict[str, float]:
        """Counts to log every step (a failure must show up in the metrics, not only in a lost reward)."""
        return {
            f"{prefix}errors": float(self.errors),
            f"{prefix}timeouts": float(self.timeouts),
            f"{prefix}retries": float(self.retries),
            f"{prefix}failed_samples": float(self.failed.sum()),
            f"{prefix}substituted_samples": float(self.substituted.sum()),
            f"{prefix}score_seconds": self.seconds,
        }

    @staticmethod
    def merge(results: Sequence["ScoreResult"]) -> "ScoreResult":
        """Several scorers' results on the same batch as one: totals added (float64), sources side by side (names
        must differ), masks or-ed, counts and seconds added."""
        if not results:
            raise ValueError("ScoreResult.merge needs at least one result")
        per_source: Dict[str, torch.Tensor] = {}
        for r in results:
            clash = sorted(set(per_source) & set(r.per_source))
            if clash:
                raise RewardFunctionError(f"reward source names must be distinct; repeated: {', '.join(clash)}")
            per_source.update(r.per_source)
        failed = torch.stack([r.failed for r in results]).any(0)
        total = torch.stack([r.total.double() for r in results]).sum(0).masked_fill(failed, 0.0)
        return ScoreResult(
            total=total.float(),
            per_source=per_source,
            failed=failed,
            substituted=torch.stack([r.substituted for r in results]).any(0),
            errors=sum(r.errors for r in results),
            timeouts=sum(r.timeouts for r in results),
            retries=sum(r.retries for r in results),
            seconds=sum(r.seconds for r in results),
            failures=tuple(sorted((f for r in results for f in r.failures), key=lambda f: f.index)),
        )


def assemble(
    sources: Sequence[Tuple[str, float]],
    values: Mapping[str, Sequence[Optional[float]]],
    failures: Sequence[Failure],
    on_error: OnError,
    seconds: float,
    retries: int = 0,
) -> ScoreResult:
    """Apply ``on_error`` to per-sample values (``None`` where a source failed) and sum them by weight.

    Args:
        sources: ``(name, weight)`` in order. values: ``{name: N floats or None}``. failures: the failed pairs.

    Raises:
        RewardFunctionError: with ``on_error="fail"`` and a failure (the first in sample order, plus how many more),
            or when a weighted total overflows float32.
    """
    failures = sorted(failures, key=lambda f: f.index)
    if failures and on_error == "fail":
        more = f" (and {len(failures) - 1} more failed samples/functions)" if len(failures) > 1 else ""
        raise RewardFunctionError(failures[0].message + more)
    n = len(next(iter(values.values()))) if values else 0
    failed = torch.zeros(n, dtype=torch.bool)
    substituted = torch.zeros(n, dtype=torch.bool)
    for f in failures:
        (failed if on_error == "drop" else substituted)[f.index] = True
    stand_in = 0.0 if isinstance(on_error, str) else on_error  # "fail" has no failures left here
    per_source = {
        name: torch.tensor([stand_in if v is None else v for v in values[name]], dtype=torch.float32)
        for name, _ in sources
    }
    total = torch.zeros(n, dtype=torch.float64)
    for name, weight in sources:
        total += weight * per_source[name].to(torch.float64)
    total32 = total.masked_fill(failed, 0.0).to(torch.float32)
    if not bool(torch.isfinite(total32).all()):
        i = int((~torch.isfinite(total32)).nonzero()[0, 0])
        raise RewardFunctionError(f"the weighted total reward at index {i} overflows float32 ({float(total[i])})")
    kinds = [f.kind for f in failures]
    return ScoreResult(
        total32, per_source, failed, substituted, kinds.count("error"), kinds.count("timeout"), retries, seconds,
        tuple(failures),
    )  # fmt: skip
