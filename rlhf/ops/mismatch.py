"""The trainer's log-probs against the engine's on the same sampled tokens (same weights, same tokens): ~1e-7 when
every weight sync landed. ``(B, T)`` batches with ``old_logps``, ``rollout_logps`` and ``loss_mask``."""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.batch import Batch


def logp_mismatch(batch: Batch) -> Optional[float]:
    """Mean |trainer log-prob - vLLM log-prob| over response tokens (same weights, same tokens): ~1e-7 when
    every weight sync landed."""
    gap = _response_gaps(batch)
    if gap is None:
        return None
    assert batch.loss_mask is not None, "an experience batch carries its loss mask"
    return float(gap.sum() / batch.loss_mask.float().sum().clamp(min=1))


def logp_mismatch_max(batch: Batch) -> Optional[float]:
    """Max |trainer log-prob - vLLM log-prob| over response tokens (0.0 when there are none): beside the mean
    (:func:`logp_mismatch`), because a few tokens far off (one layer not synced, a kernel that differs on rare
    inputs) hide in a mean over thousands of tokens and still skew their ratios."""
    gap = _response_gaps(batch)
    if gap is None:
        return None
    assert batch.loss_mask is not None, "an experience batch carries its loss mask"
    kept = gap[batch.loss_mask != 0]  # (N,) the response tokens
    return float(kept.max()) if kept.numel() else 0.0


def _response_gaps(batch: Batch) -> Optional[torch.Tensor]:
    """``(B, T)`` |old_logps - rollout_logps|, 0 off the response tokens; ``None`` without both log-probs."""
    if batch.old_logps is None or batch.rollout_logps is None:
        return None
    assert batch.loss_mask is not None, "an experience batch carries its loss mask"
    return (batch.old_logps - batch.rollout_logps).abs() * batch.loss_mask.float()
