"""Token-level losses returned as sums, and the one place where a sum becomes a mean.

Gradient accumulation is exact only if every target token (or sample) of the global batch carries the same
weight. A per-micro-batch mean gives each token the weight ``1 / (tokens in its micro-batch)``, so tokens in a
micro-batch of short answers count more than tokens in one of long answers. Therefore losses here return *sums*;
the trainer counts the normalizer (e.g. target tokens) over all micro-batches on all ranks before the step, and
every micro-batch calls :func:`normalize` with that same number.
"""

from __future__ import annotations

import math

import torch

from rlhf.ops.logprobs import masked_sum

Tensor = torch.Tensor


def sft_nll_sum(token_logps: Tensor, loss_mask: Tensor) -> Tensor:
    """Summed negative log-likelihood of the target tokens: ``-sum_{b,t} token_logps[b, t] * loss_mask[b, t]``.

    Standard supervised fine-tuning (maximum likelihood on the response tokens). The caller divides by the number
    of target tokens in the WHOLE global batch (``loss_mask.sum()`` over all micro-batches and ranks) through
    :func:`normalize`; the result is then the token-mean NLL of the global batch, independent of how it was split.

    Args:
        token_logps: ``(B, T)`` per-token log-probs from :func:`rlhf.ops.logprobs.token_logprobs`.
        loss_mask: ``(B, T)``, 1 on target tokens (entries at padding are ignored even if inf/NaN).

    Returns:
        0-dim tensor: the summed NLL of this micro-batch (float32 for half-precision inputs).
    """
    return -masked_sum(token_logps, loss_mask)


def normalize(total: Tensor, normalizer: float, world_size: int) -> Tensor:
    """Scale a micro-batch loss *sum* into its share of the global-batch mean: ``total / normalizer * world_size``.

    DeepSpeed and DDP all-reduce gradients by *averaging* over the ``world_size`` data-parallel ranks, i.e. they
    divide the summed gradient by ``world_size``. Multiplying by ``world_size`` here cancels that division, so after
    gradient accumulation and the all-reduce the gradient equals that of
    ``(sum over all ranks and micro-batches of total) / normalizer`` -- exactly one normalization, by a number
    counted over the whole global batch. (If the engine also divides by the number of accumulation steps, e.g.
    DeepSpeed's ``scale_wrt_gas``, that must be switched off or compensated by the caller.)

    Args:
        total: the loss summed over this micro-batch (any shape; usually 0-dim).
        normalizer: the global-batch count it is averaged over (target tokens, sequences or pairs), > 0.
        world_size: number of data-parallel ranks whose gradients are averaged, >= 1.

    Returns:
        ``total / normalizer * world_size``, same shape as ``total``.

    Raises:
        ValueError: if ``normalizer`` is not a positive finite number or ``world_size`` is not a positive int.
    """
    normalizer = float(normalizer)
    if not (normalizer > 0 and math.isfinite(normalizer)):
        raise ValueError(
            f"normalizer must be a positive finite count over the global batch, got {normalizer} "
            "(a global batch with no target tokens cannot be averaged)"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return total / normalizer * world_size
