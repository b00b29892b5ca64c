"""DAPO's sampling-side techniques (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"): which groups of a dynamic-sampling draw enter the train batch (sec. 3.2), and the overlong reward shaping
(sec. 3.4, eq. 13). Pure maths and selection on the driver; the draws themselves are
:meth:`rlhf.trainers.rl_steps.RLTrainer.generate`'s.

Shapes: ``B = G * n`` samples, ``G`` groups of ``n`` consecutive samples of one prompt (the rollout's order).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

Tensor = torch.Tensor


def varied_groups(scores: Tensor, group_size: int) -> Tensor:
    """``(G,)`` bool: the groups whose ``(B,)`` scores are not all equal. A tied group has zero advantage under
    every group estimator (its baseline is its own score), so it carries no policy gradient."""
    if scores.dim() != 1 or len(scores) % group_size:
        raise ValueError(
            f"scores must be (B,) with B a multiple of the group size {group_size}, got {tuple(scores.shape)}"
        )
    grouped = scores.reshape(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def pick_groups(varied: Sequence[Tensor], wanted: int) -> Tuple[List[Tuple[int, int]], int]:
    """The train batch's groups from the draws' ``varied`` masks (``varied[d]``: ``(G_d,)`` of draw ``d``): the
    first ``wanted`` varied groups in draw order, then, when the draws ran out, tied groups in draw order, so the
    batch always holds ``wanted`` groups (the accumulation contract needs its fixed size).

    Returns:
        ``([(draw, group), ...], tied)``: ``wanted`` pairs, varied ones first, and how many tied groups filled it.

    Raises:
        ValueError: the draws hold fewer than ``wanted`` groups in all.
    """
    varied_pairs = [(d, g) for d, mask in enumerate(varied) for g in range(len(mask)) if bool(mask[g])]
    tied_pairs = [(d, g) for d, mask in enumerate(varied) for g in range(len(mask)) if not bool(mask[g])]
    if len(varied_pairs) + len(tied_pairs) < wanted:
        raise ValueError(f"{len(varied_pairs) + len(tied_pairs)} groups drawn, {wanted} wanted")
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
