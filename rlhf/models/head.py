"""Per-token log-probs and entropies of a causal LM, from its whole logits or from its LM head in tiles.

A micro-batch's logits are ``(tokens, vocabulary)``: with a 151,936-token vocabulary, 16 rows of 1,024 tokens are
5 GB in bf16 before any float32 copy, which caps the micro-batch and the context length. With ``model.tiled_head``
the model's forward stops at its last hidden states (its LM head is swapped for the identity for the call) and
:func:`rlhf.ops.logprobs.head_token_logprobs` applies the head to tiles of tokens, computing each tile's log-probs,
kept set (top-k / top-p replay) and, when asked, entropy, then dropping the tile; its backward recomputes the logits
in tiles (of the vocabulary, or with a kept set of the tokens again). Without it
the forward returns the whole logits and :func:`rlhf.ops.logprobs.token_logprobs` works on them, as every release
before did; an entropy, a metric or a bonus, comes from the log-probs' own pass
(:func:`rlhf.ops.logprobs.token_logprobs_with_entropy`). The two agree to rounding (float64: 1e-12,
tests/unit/test_tiled_head.py).

The head's weight must be whole on the rank (not ZeRO 3; refused by key) and the head a plain ``nn.Linear`` (no
LoRA on it; refused too).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Tuple

import torch

from rlhf.models.forward import lm_logits
from rlhf.ops.logprobs import (
    SamplingFilter,
    head_token_logprobs,
    logprobs_at,
    token_logprobs,
    token_logprobs_with_entropy,
)

Tensor = torch.Tensor
_FLAG = "_rlhf_tiled_head"  # set on the HF module a worker loaded with ModelSpec.tiled_head
ENTROPY_MODES = ("none", "value", "grad")  # no entropy; its value (no gradient); differentiable


def enable_tiled_head(module: torch.nn.Module) -> None:
    """Mark an HF causal LM so that :func:`token_logprobs_and_entropy` applies its head in tiles."""
    head = module.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"model.tiled_head needs a plain nn.Linear LM head, got {type(head).__name__}")
    setattr(module, _FLAG, True)


def uses_tiled_head(model: Any) -> bool:
    """Whether ``model`` (an HF module or a DeepSpeed engine around one) was loaded with ``model.tiled_head``."""
    return bool(getattr(getattr(model, "module", model), _FLAG, False))


@contextlib.contextmanager
def _head_off(model: Any) -> Iterator[torch.nn.Linear]:
    """The model's forward returns its last hidden states as "logits" inside the block (its head swapped for the
    identity; the parameters are untouched: a tied weight is still the embedding's); yields the head."""
    module = getattr(model, "module", model)
    head = module.get_output_embeddings()
    module.set_output_embeddings(torch.nn.Identity())
    try:
        yield head
    finally:
        module.set_output_embeddings(head)


def token_logprobs_and_entropy(model: Any, *args: Any, **kwargs: Any) -> Tuple[Tensor, Optional[Tensor]]:
    """Per-token log-probs ``(B, T)`` of ``input_ids`` (column 0 is 0) at ``temperature`` over the sampler's kept
    set, and with ``entropy`` ``"value"`` (no gradient) or ``"grad"`` the entropy ``(B, T)`` of the same
    distribution (else ``None``); packed per :func:`rlhf.models.packing.runs_packed`, tiled per
    :func:`uses_tiled_head`. The arguments are :func:`token_outputs`' (``input_ids, attention_mask, packing=None,
    temperature=1.0, sampling_filter=None, entropy="none"``)."""
    out = token_outputs(model, *args, **kwargs)
    return out.logps, out.entropy


@dataclass(frozen=True)
class TokenOutputs:
    """What one forward of a causal LM gives per token, in the padded layout (column 0 is 0).

    Attributes:
        logps: ``(B, T)`` log-probs of the tokens.
        entropy: ``(B, T)`` entropy of each token's predicting distribution, or ``None``.
        at_ids: ``(B, T, K)`` log-probs of K given tokens under each token's predicting distribution (a
            distillation teacher's top-k, :mod:`rlhf.ops.distill`), or ``None``.
    """

    logps: Tensor
    entropy: Optional[Tensor] = None
    at_ids: Optional[Tensor] = None


def token_outputs(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    packing: Optional[bool] = None,
    temperature: float = 1.0,
    sampling_filter: Optional[SamplingFilter] = None,
    entropy: str = "none",
    at_ids: Optional[Tensor] = None,
) -> TokenOutputs:
    """:func:`token_logprobs_and_entropy`, and with ``at_ids`` (``(B, T, K)`` token ids per token, aligned like the
    tokens: column t holds ids of the distribution that predicts token t) the log-probs ``(B, T, K)`` of those ids
    under the same tempered distribution, from the same forward.

    Raises:
        ValueError: ``at_ids`` with the head in tiles or with an active sampling filter (the kept set of the
            sampler holds none of the other ids: refused by key, ``algo.teacher.divergence``).
    """
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    if at_ids is not None and uses_tiled_head(model):
        raise ValueError("log-probs at given ids need the whole logits: not with model.tiled_head")
    if uses_tiled_head(model):
        with _head_off(model) as head:
            hidden = lm_logits(model, input_ids, attention_mask, packing)  # .logits: the last hidden states
        logps, ent = head_token_logprobs(
            hidden.logits,
            head.weight,
            head.bias,
            hidden.input_ids,
            temperature,
            sampling_filter,
            next_ids=hidden.next_ids,
            entropy=entropy != "none",
        )
        if entropy == "value" and ent is not None:
            ent = ent.detach()  # a metric: its gradient is never asked for, and the backward makes no pass for it
        return TokenOutputs(hidden.per_token(logps), None if ent is None else hidden.per_token(ent))
    out = lm_logits(model, input_ids, attention_mask, packing)
    filtered = sampling_filter is not None and sampling_filter.active(out.logits.shape[-1])
    if at_ids is not None and filtered:
        raise ValueError("log-probs at given ids are of the whole vocabulary's softmax: not with a sampling filter")
    if entropy == "none":
        logps = token_logprobs(out.logits, out.input_ids, temperature, sampling_filter, next_ids=out.next_ids)
        per_token_entropy: Optional[Tensor] = None
    else:  # one pass for both, the entropy differentiable for a bonus
        logps, per_token_entropy = token_logprobs_with_entropy(
            out.logits,
            out.input_ids,
            temperature,
            sampling_filter,
            next_ids=out.next_ids,
            entropy_grad=entropy == "grad",
        )
    at = None if at_ids is None else out.per_token(logprobs_at(out.logits, out.layout.place(at_ids), temperature))
    entropies = None if per_token_entropy is None else out.per_token(per_token_entropy)
    return TokenOutputs(out.per_token(logps), entropies, at)
