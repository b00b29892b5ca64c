"""Per-token log-probabilities and entropies from causal-LM logits, and masked reductions.

Alignment follows :mod:`rlhf.batch`: column ``t`` of every ``(B, T)`` output belongs to token ``t``, whose
distribution is predicted by the logits at position ``t - 1``. Column 0 has no prediction and is 0; the logits
at the last position predict a token beyond the sequence and never enter any output (nor its gradient).

Memory: vocabularies are large (``V`` ~ 1e5), so a float32 ``log_softmax`` of ``(B, T, V)`` bf16 logits costs
twice the logits themselves, and plain autograd would also keep it alive until backward. The two functions here
therefore use hand-written autograd functions that work through the tokens in chunks, keep only the float32
log-normalizer per token for backward, and recompute the softmax chunk by chunk there.
"""
from __future__ import annotations

import math
from typing import Iterator, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor

# Upper bound on the float32 elements materialised per chunk (2**26 floats = 256 MiB). A module constant rather
# than an argument because it changes memory use only, never a result; tests shrink it to exercise chunking.
_CHUNK_ELEMENTS = 2**26


def _chunks(rows: int, vocab: int) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` row ranges of a ``(rows, vocab)`` matrix, each at most ``_CHUNK_ELEMENTS`` elements."""
    step = max(1, _CHUNK_ELEMENTS // max(1, vocab))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision (and float32) logits; float64 logits keep float64 (used by gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def at_least_float32(x: Tensor) -> Tensor:
    """``x`` upcast to float32 when it is half precision; float32 and float64 (an fp64 run) are kept as they are."""
    return x if x.dtype == torch.float64 else x.float()


def _scaled_upcast(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` in at least float32.

    For float32 logits and temperature 1 this is the caller's own tensor, so callers must not modify it in place.
    """
    x = logits.to(_compute_dtype(logits.dtype))
    return x / temperature if temperature != 1.0 else x


class _TargetLogProbs(torch.autograd.Function):
    """``log softmax(logits / temperature)[target]`` row by row for ``(N, V)`` logits; float32 (float64 for
    float64 logits) ``(N,)`` out."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:  # type: ignore[override]
        n, vocab = logits.shape
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for start, stop in _chunks(n, vocab):
            x = _scaled_upcast(logits[start:stop], temperature)
            lse[start:stop] = torch.logsumexp(x, dim=-1)
            # Gather-minus-logsumexp: only the target column of log-softmax is ever formed.
            out[start:stop] = x.gather(-1, targets[start:stop, None]).squeeze(-1) - lse[start:stop]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n, vocab = logits.shape
        for start, stop in _chunks(n, vocab):
            x = _scaled_upcast(logits[start:stop], ctx.temperature)
            g = grad_out[start:stop].to(x.dtype)[:, None]
            # d/dz [z_y - logsumexp(z)] = onehot(y) - softmax(z), and z = logits / temperature.
            chunk = torch.exp(x - lse[start:stop, None]).mul_(-g)
            chunk.scatter_add_(-1, targets[start:stop, None], g)
            grad[start:stop] = chunk.div_(ctx.temperature)
        return grad, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of ``softmax(logits)`` row by row for ``(N, V)`` logits; float32 (float64 for float64 logits)."""

    @staticmethod
    def forward(ctx, logits: Tensor) -> Tensor:  # type: ignore[override]
        n, vocab = logits.shape
        dtype = _compute_dtype(logits.dtype)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        for start, stop in _chunks(n, vocab):
            x = _scaled_upcast(logits[start:stop], 1.0)
            lse[start:stop] = torch.logsumexp(x, dim=-1)
            p = torch.exp(x - lse[start:stop, None])
            out[start:stop] = lse[start:stop] - _expected(p, x)
        ctx.save_for_backward(logits, lse, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n, vocab = logits.shape
        mean_logit = lse - entropy  # E_p[z] = logsumexp(z) - H
        for start, stop in _chunks(n, vocab):
            x = _scaled_upcast(logits[start:stop], 1.0)
            p = torch.exp(x - lse[start:stop, None])
            # dH/dz_i = -p_i (z_i - E_p[z]); where p_i == 0 the term is 0 even if z_i = -inf.
            centred = torch.where(p > 0, x - mean_logit[start:stop, None], 0.0)
            grad[start:stop] = p.mul_(centred).mul_(-grad_out[start:stop].to(x.dtype)[:, None])
        return (grad,)


def _expected(p: Tensor, x: Tensor) -> Tensor:
    """``sum_i p_i x_i`` over the last dim, with ``0 * -inf`` (a masked-out logit) counted as 0."""
    return torch.where(p > 0, p * x, 0.0).sum(-1)


def _check_logits(logits: Tensor, input_ids: Optional[Tensor] = None) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if input_ids is not None and input_ids.shape != logits.shape[:2]:
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} != logits (B, T) {tuple(logits.shape[:2])}")


def _align(per_position: Tensor) -> Tensor:
    """Shift ``(B, T)`` values computed at prediction positions onto the tokens they predict; column 0 = 0."""
    return torch.nn.functional.pad(per_position[:, :-1], (1, 0))


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each token under the distribution predicted at the previous position.

    ``out[:, t] = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]`` for ``t >= 1`` and
    ``out[:, 0] = 0``. Computed in (at least) float32 whatever the dtype of ``logits``: a bf16 log-softmax is off
    in the third significant digit, the size of a PPO ratio's deviation from 1. The gradient flows to ``logits``
    in their own dtype; the logits at the last position get a zero gradient.

    Args:
        logits: ``(B, T, V)`` causal-LM logits, any floating dtype.
        input_ids: ``(B, T)`` token ids (padding must still be a valid id; it is masked later by ``loss_mask``).
        temperature: the sampling temperature; the logits are divided by it, as the sampler did.

    Returns:
        ``(B, T)`` float32 (float64 for float64 logits) per-token log-probs, not summed; columns at padding hold
        meaningless values for ``loss_mask`` to drop.
    """
    _check_logits(logits, input_ids)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    batch, length, vocab = logits.shape
    # Pair position t with token t + 1 on the flat (B*T, V) view. The last position gets a dummy (valid) target;
    # its value is dropped by ``_align`` and so receives a zero upstream gradient.
    next_ids = input_ids.roll(-1, dims=1)
    flat = _TargetLogProbs.apply(logits.reshape(-1, vocab), next_ids.reshape(-1).long(), float(temperature))
    return _align(flat.view(batch, length))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution, aligned like :func:`token_logprobs`.

    ``out[:, t] = H(softmax(logits[:, t - 1]))`` for ``t >= 1`` and ``out[:, 0] = 0``, in nats, in (at least)
    float32.
    Differentiable (for an entropy bonus); logits of ``-inf`` (masked vocabulary) contribute 0, not NaN.

    Args:
        logits: ``(B, T, V)`` causal-LM logits, any floating dtype.

    Returns:
        ``(B, T)`` float32 (float64 for float64 logits) per-token entropies (not summed).
    """
    _check_logits(logits)
    batch, length, vocab = logits.shape
    flat = _Entropy.apply(logits.reshape(-1, vocab))
    return _align(flat.view(batch, length))


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values * mask`` where ``mask != 0`` and exactly 0 elsewhere, accumulated in at least float32.

    ``where`` rather than a bare product because padding may hold ``-inf``/NaN log-probs and ``0 * inf = NaN``.
    """
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(values.shape)}")
    if values.dtype in (torch.float16, torch.bfloat16):
        values = values.float()  # a sum over thousands of tokens in bf16 loses whole units
    return torch.where(mask != 0, values * mask.to(values.dtype), 0.0)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``values`` weighted by ``mask`` (the building block of every loss here).

    Args:
        values: any shape, e.g. ``(B, T)``.
        mask: same shape; 0/1 (or non-negative weights). Masked-out entries are ignored even if inf/NaN.

    Returns:
        0-dim tensor: the sum (float32 for half-precision ``values``).
    """
    return _masked(values, mask).sum()


def masked_mean(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is set. FOR METRICS ONLY.

    A loss must never be built from this: a per-micro-batch mean weights tokens by ``1 / (tokens in their
    micro-batch)``, which is not the global-batch mean (see :func:`rlhf.ops.losses.normalize`).

    Args:
        values: any shape, e.g. ``(B, T)``.
        mask: same shape, 0/1 or non-negative weights.
        dim: reduce over this dim only (e.g. ``-1`` for a per-sequence ``(B,)`` mean); ``None`` for all.

    Returns:
        The mean (0-dim, or ``values`` reduced over ``dim``); 0 where the mask is empty, instead of NaN.
    """
    masked = _masked(values, mask)
    weight = mask.to(masked.dtype)
    total = masked.sum() if dim is None else masked.sum(dim)
    count = weight.sum() if dim is None else weight.sum(dim)
    # Clamp before dividing: ``where`` alone would still send a 0/0 NaN into the gradient of an empty row.
    return torch.where(count > 0, total / count.clamp(min=torch.finfo(count.dtype).tiny), 0.0)


def sequence_logprobs(token_logps: Tensor, loss_mask: Tensor) -> Tensor:
    """Log-probability of each sequence's target tokens: ``sum_t token_logps[b, t] * loss_mask[b, t]``.

    Args:
        token_logps: ``(B, T)`` (or ``(..., T)``) per-token log-probs from :func:`token_logprobs`.
        loss_mask: same shape, 1 on target tokens.

    Returns:
        ``(B,)`` (or ``(...)``) per-sequence sums, not averaged over length.
    """
    return _masked(token_logps, loss_mask).sum(-1)
