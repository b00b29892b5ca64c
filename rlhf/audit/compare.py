"""Per-step differences between the runs of an audit, the table, and the verdict: pure (no run, no torch).

Every run trains the same global batches from the same weights, so every number it logs should agree with the
configured run's (the reference) up to float rounding:

* at step 1 the weights are identical and only reduction orders differ (padding widths, micro-batch sums, the
  cross-rank sum): ``Tolerances.first``;
* from step 2 on, each step's rounding has moved the weights a little and Adam amplifies it (it divides by the
  root of tiny second moments): ``Tolerances.later``;
* the final weights: ``Tolerances.weights``, per tensor, relative L2.

A metric of run ``b`` passes against the reference ``a`` when ``|a - b| / max(|a|, |b|, atol / tol) <= tol``
(the number the table shows): relative, except that numbers below ``atol / tol`` are compared absolutely, to
``atol``, so that numbers that are ~0 by construction (DPO's reward margin and the RL KL at step 1, an RL policy
loss near 0) do not fail on rounding. Integer counts (``num_samples``, ``num_tokens``, RL's ``optimizer_steps``)
must be equal. Timings are not compared.

Online RL: the rollouts of step 1 are identical in every run (the engines start from the same weights and vLLM
seeds every sample), so their numbers must agree like the rest. At a later step, rollout numbers that differ mean
the engines sampled other tokens from weights that differ: by more than rounding (a broken contract), or by
rounding that happened to flip a sampled token (rare in fp32, ~never in fp64). The audit cannot tell which, so it
fails the step as ``rollouts differ`` and says so; the steps after it train on other samples and are not compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

FAIL, OK, DIVERGED, NOT_COMPARED = "FAIL", "ok", "rollouts differ", "not compared"

SKIPPED_KEYS = frozenset(
    {
        "step",
        "epoch",
        "step_time_s",
        "samples_per_s",
        "sync_mb_per_s",
        "prompts_skipped",
        "prompts_truncated",
        "skipped",
        "micro_batches",
        "fillers",
        "critic_micro_batches",
        "critic_fillers",
    }
)  # how a step was cut
SKIPPED_PREFIXES = ("time/", "perf/")  # read off the clock
EXACT_KEYS = frozenset({"num_samples", "num_tokens", "optimizer_steps"})
# Numbers of an RL step's samples (not of its update): equal while the rollouts are.
ROLLOUT_KEYS = frozenset({"reward_mean", "reward_std", "accuracy", "response_length"})
ROLLOUT_PREFIXES = ("reward/",)


@dataclass(frozen=True)
class Tolerances:
    """Relative tolerances at step 1, at later steps and for the final weights, plus an absolute floor."""

    first: float
    later: float
    weights: float
    atol: float

    def at(self, step: int) -> float:
        return self.first if step <= 1 else self.later


# fp32: observed ~1e-7 (losses, grad norms) and ~1e-4 (weights after a few AdamW steps) on CPU, docs/concepts.md;
# bf16: tests/integration/test_precision.py's bounds (3e-3 + 5e-4 absolute; observed up to 7.7e-4);
# fp64: rounding at ~1e-16.
DEFAULT_TOLERANCES = {
    "fp32": Tolerances(first=1e-5, later=1e-3, weights=1e-3, atol=1e-5),
    "bf16": Tolerances(first=3e-3, later=1e-2, weights=1e-2, atol=5e-4),
    "fp64": Tolerances(first=1e-10, later=1e-10, weights=1e-8, atol=1e-12),
}


def tolerances_for(
    precision: str,
    first: Optional[float] = None,
    later: Optional[float] = None,
    weights: Optional[float] = None,
    atol: Optional[float] = None,
) -> Tolerances:
    """The defaults of a (resolved) precision, each overridable."""
    base = DEFAULT_TOLERANCES.get(precision, DEFAULT_TOLERANCES["fp32"])
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return Tolerances(
        first=pick(first, base.first),
        later=pick(later, base.later),
        weights=pick(weights, base.weights),
        atol=pick(atol, base.atol),
    )


@dataclass(frozen=True)
class Diff:
    """The worst difference of one metric at one step: run ``run`` against the reference."""

    step: int
    metric: str
    run: str
    ref: object
    value: object
    rel: float  # |a - b| / max(|a|, |b|, atol / tol); inf when a value is missing or not a number
    ok: bool
    tol: float


@dataclass
class StepReport:
    step: int
    status: str  # ok | FAIL | rollouts differ | not compared
    rows: Dict[str, Optional[dict]]  # run label -> its logged row (None: that run logged no such step)
    diffs: Dict[str, Diff] = field(default_factory=dict)  # metric -> worst run's difference
    tol: float = 0.0

    @property
    def failures(self) -> List[Diff]:
        return [d for d in self.diffs.values() if not d.ok]


@dataclass(frozen=True)
class WeightsDiff:
    """Run ``run``'s final weights against the reference's: the worst tensor, or why they cannot be compared."""

    run: str
    worst: float
    tensor: str
    problem: str = ""  # e.g. "tensor names differ"


# ------------------------------------------------------------------------------------------------ steps


def compared_keys(row: dict) -> List[str]:
    """The metrics of a row that must agree across factorisations."""
    return [
        k
        for k, v in row.items()
        if k not in SKIPPED_KEYS
        and not k.startswith(SKIPPED_PREFIXES)
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
    ]


def is_rollout_key(key: str) -> bool:
    return key in ROLLOUT_KEYS or key.startswith(ROLLOUT_PREFIXES)


def _diff(step: int, key: str, run: str, a, b, tol: float, atol: float) -> Diff:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if not numbers or not (math.isfinite(a) and math.isfinite(b)):
        return Diff(step, key, run, a, b, math.inf, False, tol)
    if key in EXACT_KEYS:
        scale = max(abs(a), abs(b))
        return Diff(step, key, run, a, b, abs(a - b) / scale if scale else 0.0, a == b, tol)
    # |a - b| <= max(tol x max(|a|, |b|), atol), written as one relative number that the table can show
    rel = abs(a - b) / max(abs(a), abs(b), atol / tol if tol > 0 else 0.0, 1e-300)
    return Diff(step, key, run, a, b, rel, rel <= tol, tol)


def _severity(d: Diff) -> float:
    """How far past its tolerance a difference is (> 1: fails), to pick the worst run and metric."""
    if math.isinf(d.rel):
        return math.inf
    return (0.0 if d.ok else 1.0) + d.rel / max(d.tol, 1e-300)


def compare_steps(runs: Dict[str, List[dict]], tol: Tolerances, rl: bool = False) -> List[StepReport]:
    """Each step of the reference run (the first of ``runs``) against the same step of every other run.

    Args:
        runs: Run label -> its ``metrics.jsonl`` rows, the reference first.
        tol: The tolerances.
        rl: Online RL rows: a later step whose rollout numbers differ ends the comparison (module docstring).
    """
    (ref_label, ref_rows), *others = runs.items()
    reports: List[StepReport] = []
    diverged = False
    for i, ref in enumerate(r for r in ref_rows if not r.get("skipped")):
        step = ref.get("step", i + 1)
        rows: Dict[str, Optional[dict]] = {ref_label: ref}
        for label, other_rows in others:
            rows[label] = next((r for r in other_rows if r.get("step") == step), None)
        report = StepReport(step=step, status=NOT_COMPARED if diverged else OK, rows=rows, tol=tol.at(step))
        reports.append(report)
        if diverged:
            continue
        for label, row in rows.items():
            if row is None:
                report.diffs["step"] = Diff(step, "step", label, step, None, math.inf, False, report.tol)
        for key in compared_keys(ref):
            worst = None
            for label, row in rows.items():
                if label == ref_label or row is None:
                    continue
                d = _diff(step, key, label, ref[key], row.get(key), report.tol, tol.atol)
                if worst is None or _severity(d) > _severity(worst):
                    worst = d
            if worst is not None:
                report.diffs[key] = worst
        if report.failures:
            diverged = rl and step > 1 and any(is_rollout_key(d.metric) for d in report.failures)
            report.status = DIVERGED if diverged else FAIL
    return reports + _missing_steps(runs, ref_label, ref_rows)


def _missing_steps(runs: Dict[str, List[dict]], ref_label: str, ref_rows: List[dict]) -> List[StepReport]:
    """Steps another run logged beyond the reference's last one (a run that trained more steps than it should)."""
    known = {r.get("step") for r in ref_rows}
    extra = sorted(
        {r.get("step") for label, rows in runs.items() if label != ref_label for r in rows} - known,
        key=lambda s: (s is None, s),
    )
    out = []
    for step in extra:
        rows = {label: next((r for r in rs if r.get("step") == step), None) for label, rs in runs.items()}
        run = next(label for label, row in rows.items() if row is not None)
        d = Diff(step if isinstance(step, int) else 0, "step", run, None, step, math.inf, False, 0.0)
        out.append(StepReport(step=d.step, status=FAIL, rows=rows, diffs={"step": d}))
    return out


# ------------------------------------------------------------------------------------------------ verdict


@dataclass(frozen=True)
class Verdict:
    code: int  # 0: contract kept; 1: a step or the weights past tolerance
    line: str


def verdict(
    steps: Sequence[StepReport], weights: Sequence[WeightsDiff], tol: Tolerances, labels: Dict[str, str]
) -> Verdict:
    """The audit's last line and exit code. ``labels``: run label -> its description (``1x4x2 (micro 1)``), the
    reference first."""
    name: Callable[[str], str] = lambda label: labels.get(label, label)  # noqa: E731
    ref = next(iter(labels), "the configured run")
    for report in steps:
        if report.status == FAIL:
            d = max(report.failures, key=_severity)
            return Verdict(1, f"VERDICT: FAIL at step {report.step}: {_failure(d, name(d.run), name(ref))}")
        if report.status == DIVERGED:
            d = next(d for d in report.failures if is_rollout_key(d.metric))
            return Verdict(
                1,
                f"VERDICT: FAIL at step {report.step}: the rollouts differ "
                f"({_failure(d, name(d.run), name(ref))}): "
                f"the engines sampled other tokens, so the weights after step {report.step - 1} "
                f"differ, by more than rounding or by rounding that flipped a sampled token; "
                f"--precision fp64 tells the two apart. Later steps were not compared",
            )
    for w in weights:
        if w.problem or not w.worst <= tol.weights:
            what = w.problem or f"{w.tensor} differs by {w.worst:.1e} (relative L2) > tolerance {tol.weights:.0e}"
            return Verdict(1, f"VERDICT: FAIL in the final weights: {name(w.run)} vs {name(ref)}: {what}")
    compared = [r for r in steps if r.status == OK]
    if not compared:
        return Verdict(1, "VERDICT: FAIL: no step was compared (the runs logged no trained step)")
    metrics = {k for r in compared for k in r.diffs}
    return Verdict(
        0,
        f"VERDICT: contract kept: {len(labels)} factorisations agree on {len(compared)} step(s) "
        f"({len(metrics)} metrics each) and on the final weights",
    )


def _failure(d: Diff, run: str, ref: str) -> str:
    if d.metric == "step":
        return (
            f"{run} logged no step {d.step}" if d.value is None else f"{run} logged step {d.value}, which {ref} did not"
        )
    if d.value is None:
        return f"{run} logged no {d.metric} (the reference {ref} did)"
    if d.metric in EXACT_KEYS:
        return f"{d.metric} of {run} is {d.value} vs {d.ref} in {ref} (counts must be equal)"
    return (
        f"{d.metric} of {run} is {_num(d.value)} vs {_num(d.ref)} in {ref}: relative difference {_rel(d)} > "
        f"tolerance {d.tol:.0e}"
    )


# ------------------------------------------------------------------------------------------------ table


def _num(value, digits: int = 6) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.{digits}g}"
        return f"{value:.{digits - 2}e}"
    return str(value)


def _rel(d: Optional[Diff]) -> str:
    if d is None:
        return "-"
    if math.isinf(d.rel):
        return "missing" if d.value is None else "not finite"
    return f"{d.rel:.1e}"


def table(steps: Sequence[StepReport], primary: str, labels: Sequence[str]) -> List[str]:
    """Aligned lines: step, lr, the primary metric of every run, its and grad_norm's worst relative difference,
    the worst other metric, the tolerance and the step's verdict."""
    header = (
        ["step", "lr"]
        + [f"{primary} {label}" for label in labels]
        + [f"{primary} rel", "grad_norm rel", "worst other (rel)", "tol", "verdict"]
    )
    cells = [header]
    for r in steps:
        ref = r.rows.get(labels[0]) or {}
        others = [
            d for k, d in r.diffs.items() if k not in (primary, "grad_norm") and (k not in EXACT_KEYS or not d.ok)
        ]
        worst = max(others, key=_severity) if others else None
        status = r.status if r.status != FAIL else "FAIL " + ", ".join(sorted({d.metric for d in r.failures}))
        cells.append(
            [str(r.step), _num(ref.get("lr"))]
            + [_num((r.rows.get(label) or {}).get(primary), digits=9) for label in labels]
            + [
                _rel(r.diffs.get(primary)),
                _rel(r.diffs.get("grad_norm")),
                f"{worst.metric} {_rel(worst)}" if worst is not None else "-",
                f"{r.tol:.0e}" if r.tol else "-",
                status,
            ]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
