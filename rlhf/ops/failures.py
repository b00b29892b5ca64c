"""The one rule for failed samples, applied wherever a step takes a statistic of its samples.

A sample *failed* when what should have scored it did not: a reward source (a reward function, the HTTP reward, the
LLM judge) under ``reward.on_error=drop``, or its environment or agent under ``env.on_error=drop``. What stands in
its reward is a placeholder, not a reward, so the failed sample is **out of every statistic of the step**: the group
baselines, batch whitening, dynamic sampling's filter and the logged reward metrics (counted apart, ``failed/*``).
A group estimator's baseline needs every sample of the group, so there the whole group is out (as in verl and
OpenRLHF, which score a group or drop it); an estimator that reads no groups (GAE, REINFORCE++) loses the sample
alone. A sample out of the step carries no advantage and no loss, and its placeholder is never read: its value
(0.0, 1.0, NaN) changes no trained or logged number (tests/unit/test_rl_failures_reference.py).

docs/algorithms/rl.md ("Failed samples") states the same rule for users. Pure maths on ``(B,)`` masks.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def rows_out(failed: Optional[Tensor], group_ids: Optional[Tensor], whole_groups: bool) -> Optional[Tensor]:
    """``(B,)`` bool: the rows out of the step, the ``failed`` ones and, with ``whole_groups`` (a group estimator),
    every row of a group that holds one; ``None`` when nothing failed.

    Args:
        failed: ``(B,)`` bool, or ``None`` (nothing failed).
        group_ids: ``(B,)`` integer group of each row (needed with ``whole_groups``).
        whole_groups: the estimator compares the samples of a group (``Estimator.needs_group_ids``).
    """
    if failed is None or not bool(failed.any()):
        return None
    if not whole_groups:
        return failed.clone()
    if group_ids is None:
        raise ValueError("rows_out: whole_groups needs group_ids (B,)")
    groups = torch.as_tensor(group_ids, dtype=torch.long)
    return torch.isin(groups, groups[failed])


def counted(failed: Optional[Tensor], n: int) -> Tensor:
    """``(n,)`` bool: the samples whose rewards are rewards (not placeholders), those that enter reward metrics."""
    return torch.ones(n, dtype=torch.bool) if failed is None else ~failed
