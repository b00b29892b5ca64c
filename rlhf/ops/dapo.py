"""DAPO's sampling-side techniques (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"): which groups of a dynamic-sampling draw enter the train batch (sec. 3.2), and the overlong reward shaping
(sec. 3.4, eq. 13). Pure maths and selection on the driver; the draws themselves are
:meth:`rlhf.trainers.online.steps.RLTrainer.generate`'s.

Shapes: ``B = G * n`` samples, ``G`` groups of ``n`` consecutive samples of one prompt (the rollout's order).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


OVERLONG_SOURCE = "overlong"  # the per-source name of the overlong shaping term (reward/overlong)
SHAPING_SOURCES = (OVERLONG_SOURCE,)  # per-source rewards that shape, never say whether an answer is right
FILTER_METRICS = ("accuracy", "score")  # rollout.dynamic_sampling_metric, besides reward/<source>


def correct_samples(per_source: Dict[str, Tensor]) -> Optional[Tensor]:
    """``(B,)`` bool: the samples every verifiable source (0/1-valued on these samples, not a shaping term) calls
    correct; ``None`` when no source is verifiable (a learned reward says nothing right or wrong). Pass the samples
    whose rewards are real (:func:`rlhf.ops.failures.counted`): a placeholder is neither."""
    binary = [v for k, v in per_source.items() if k not in SHAPING_SOURCES and bool(((v == 0) | (v == 1)).all())]
    return torch.stack(binary).min(0).values.bool() if binary else None


def filter_values(metric: str, scores: Tensor, per_source: Dict[str, Tensor], real: Tensor) -> Tensor:
    """``(B,)`` the values dynamic sampling compares within a group (``rollout.dynamic_sampling_metric``):

    * ``accuracy`` (DAPO eq. 11, verl's ``filter_groups.metric=acc``): 1 for a correct sample, 0 otherwise
      (:func:`correct_samples`), so a group is varied when ``0 < #correct < G``;
    * ``score``: the summed reward, shaping included (a group differing only in its overlong penalty is varied);
    * ``reward/<source>``: that source's own reward.

    Args:
        real: ``(B,)`` bool, the samples whose rewards are real (failed ones hold placeholders; their values here
            are 0 and never read by :func:`varied_groups`, which is given them as failed).

    Raises:
        ValueError: naming ``rollout.dynamic_sampling_metric`` when the metric has nothing to read.
    """
    if metric == "score":
        return torch.where(real, scores.double(), 0.0)
    if metric == "accuracy":
        correct = correct_samples({k: v[real] for k, v in per_source.items()})
        if correct is None:
            raise ValueError(
                "rollout.dynamic_sampling_metric=accuracy: no reward source of the draw is 0/1-valued (sources: "
                f"{', '.join(sorted(per_source)) or 'none'}); name one as reward/<source> or use score"
            )
        out = torch.zeros(len(scores), dtype=torch.float64)
        out[real] = correct.double()
        return out
    source = metric.removeprefix("reward/")
    if source not in per_source:
        raise ValueError(
            f"rollout.dynamic_sampling_metric={metric}: no such reward source; the run's are "
            + ", ".join(f"reward/{k}" for k in sorted(per_source))
        )
    return torch.where(real, per_source[source].double(), 0.0)


def varied_groups(values: Tensor, group_size: int) -> Tensor:
    """``(G,)`` bool: the groups whose ``(B,)`` values (:func:`filter_values`) are not all equal. A tied group has
    zero advantage under every group estimator (its baseline is its own score), so it carries no policy gradient."""
    grouped = _grouped(values, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def failed_groups(failed: Tensor, group_size: int) -> Tensor:
    """``(G,)`` bool: the groups holding a failed sample: out of the step (:mod:`rlhf.ops.failures`), so never
    varied, whatever their placeholders."""
    return _grouped(failed, group_size).any(dim=1)


def _grouped(x: Tensor, group_size: int) -> Tensor:
    if x.dim() != 1 or len(x) % group_size:
        raise ValueError(f"need (B,) with B a multiple of the group size {group_size}, got {tuple(x.shape)}")
    return x.reshape(-1, group_size)


def pick_groups(
    varied: Sequence[Tensor], wanted: int, failed: Optional[Sequence[Tensor]] = None
) -> Tuple[List[Tuple[int, int]], int]:
    """The train batch's groups from the draws' ``varied`` masks (``varied[d]``: ``(G_d,)`` of draw ``d``): the
    first ``wanted`` varied groups in draw order, then, when the draws ran out, tied groups in draw order (those
    without a failed sample, per ``failed[d]`` ``(G_d,)``, before those with one: a failed group trains nothing at
    all), so the batch always holds ``wanted`` groups (the accumulation contract needs its fixed size).

    Returns:
        ``([(draw, group), ...], tied)``: ``wanted`` pairs, varied ones first, and how many other groups filled it.

    Raises:
        ValueError: the draws hold fewer than ``wanted`` groups in all.
    """
    pairs = [(d, g) for d, mask in enumerate(varied) for g in range(len(mask))]
    bad = {(d, g) for d, mask in enumerate(failed or []) for g in range(len(mask)) if bool(mask[g])}
    varied_pairs = [p for p in pairs if bool(varied[p[0]][p[1]])]
    tied_pairs = [p for p in pairs if not bool(varied[p[0]][p[1]]) and p not in bad]
    tied_pairs += [p for p in pairs if not bool(varied[p[0]][p[1]]) and p in bad]
    if len(pairs) < wanted:
        raise ValueError(f"{len(pairs)} groups drawn, {wanted} wanted")
    picked = varied_pairs[:wanted]
    filled = tied_pairs[: wanted - len(picked)]
    return picked + filled, len(filled)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (eq. 13), ``(B,)`` float32, added to each response's reward.

    With ``L_max = max_new_tokens`` and the buffer ``L_cache = buffer``: 0 for a response of at most
    ``L_max - L_cache`` tokens; ``penalty * ((L_max - L_cache) - |y|) / L_cache`` within the buffer, reaching
    ``-penalty`` at ``L_max``; ``-penalty`` beyond (a response is never longer than ``L_max`` here). ``buffer = 0``:
    no shaping (zeros).

    Args:
        lengths: ``(B,)`` response lengths in tokens.
    """
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    expected = max_new_tokens - buffer
    over = (lengths.to(torch.float32) - expected).clamp(min=0.0)
    return -penalty * (over / buffer).clamp(max=1.0)
