"""One forward of a model over ``(B, T)`` right-padded rows, in whichever layout the worker runs it: padded, packed
(:mod:`rlhf.models.packing`) or sharded across a sequence group (:mod:`rlhf.models.sequence_parallel`).

One function runs the forward (:func:`_run`) and one puts every per-position result back into the padded ``(B, T)``
layout (:meth:`Layout.restore`), for the LM's log-probs (:class:`LMLogits`) and a scalar head's values
(:func:`hidden_forward`) alike, so the objectives never see the layout.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from rlhf.models.host_layout import row_lengths
from rlhf.models.packing import VARLEN_TORCH, PackedRows, attention_of, packed_forward, runs_packed
from rlhf.models.sequence_parallel import SequenceShard, sequence_group_of, shard_inputs
from rlhf.ops.logprobs import align_to_tokens

Tensor = torch.Tensor


@dataclass(frozen=True)
class Layout:
    """How a forward laid out ``(B, T)`` right-padded rows: padded, packed (``packed``) and/or this rank's positions
    of a sequence group (``shard``)."""

    packed: Optional[PackedRows] = None
    shard: Optional[SequenceShard] = None

    def restore(self, per_position: Tensor, token_aligned: bool) -> Tensor:
        """Per-position results of the forward in the padded ``(B, T, ...)`` layout: the group's shards gathered
        (differentiably), then with ``token_aligned`` shifted onto the tokens they predict (column 0 = 0), then
        unpacked (0 at padding)."""
        whole = per_position if self.shard is None else self.shard.gather(per_position)
        if token_aligned:
            whole = align_to_tokens(whole)
        return whole if self.packed is None else self.packed.unpack(whole, token_aligned=token_aligned)

    def place(self, per_token: Tensor) -> Tensor:
        """The inverse of :meth:`restore` for token-aligned values: ``(B, T, ...)`` values of the tokens (column t
        belongs to token t) -> the forward's layout, at the positions that predict them (``(B, T, ...)`` padded,
        ``(1, N, ...)`` packed). A row's last position (padded: also its padding) gets some other token's value,
        which :meth:`restore` drops again.

        Raises:
            NotImplementedError: a sequence-sharded layout (each rank would need its shard's positions only).
        """
        if self.shard is not None:
            raise NotImplementedError("placing per-token values on a sequence shard")
        if self.packed is not None:
            rows, width = per_token.shape[:2]
            per_token = per_token.reshape(rows * width, *per_token.shape[2:])[self.packed.index][None]
        return per_token.roll(-1, dims=1)


def _run(model: Any, input_ids: Tensor, attention_mask: Tensor, packing: Optional[bool], **kwargs: Any):
    """The model's forward over ``(B, T)`` right-padded rows, packed per :func:`rlhf.models.packing.runs_packed`,
    sharded when the model runs across a sequence group -> ``(output, ids in its layout, the token each position
    predicts, Layout)``; at the very last position that token is a dummy whose value :meth:`Layout.restore` drops."""
    packed = runs_packed(model, packing)
    sequence = sequence_group_of(model)
    lengths = row_lengths(attention_mask)  # from the host, when the batch was copied in by a trainer rank
    if sequence is not None:
        inputs = shard_inputs(sequence, input_ids, attention_mask, packed, lengths)
        out = model(**inputs.model_inputs, **kwargs)
        return out, inputs.input_ids, inputs.next_ids, Layout(inputs.packed, inputs.shard)
    if not packed:
        out = model(input_ids=input_ids, attention_mask=_mask_argument(model, attention_mask, lengths), **kwargs)
        return out, input_ids, input_ids.roll(-1, dims=1), Layout()
    out, rows = packed_forward(model, input_ids, attention_mask, host_lengths=lengths, **kwargs)
    return out, rows.input_ids, rows.input_ids.roll(-1, dims=1), Layout(rows)


# Attention implementations whose padding mask transformers builds with ``sdpa_mask``: a boolean (B, 1, T, T) mask,
# True where a query may attend to a key.
_BOOLEAN_MASKS = ("sdpa", VARLEN_TORCH)
# Attention implementations that run their causal kernel when a layer is handed no mask (what transformers hands
# each layer once it has read a 2-D mask of all ones): sdpa's ``is_causal``, rlhf_varlen unpacked (transformers'
# sdpa), flash-attention's causal flag.
_CAUSAL_WITHOUT_MASK = ("sdpa", VARLEN_TORCH, "flash_attention_2", "flash_attention_3")


def _mask_argument(model: Any, attention_mask: Tensor, lengths: Optional[List[int]]) -> Union[Tensor, Dict[str, None]]:
    """The attention mask the padded forward hands the model, built without reading the device when the row lengths
    are known on the host (rlhf.models.host_layout) and every attention layer of the model is full causal attention.

    transformers reads a 2-D mask back once when no row is padded (to find that the causal kernel alone will do) and
    twice when one is. Padded rows, for an implementation that takes a boolean mask: the mask it would then build
    (causal, no key in a row's padding), built here. Unpadded rows, for a model whose decoder takes its masks
    ready-made (:func:`_unmasked_layers`): a mapping that hands every layer no mask, as transformers hands them
    after its read, so the layers run the same causal kernel. Otherwise the 2-D mask, and transformers' reads (a
    ready-made 4-D mask would forgo the causal kernel; no mask at all makes transformers read the position ids
    instead, looking for packed rows)."""
    width = attention_mask.shape[-1]
    if lengths is None or not _causal_layers_only(model):
        return attention_mask
    implementation = attention_of(model)
    if all(n == width for n in lengths):
        unmasked = _unmasked_layers(model) if implementation in _CAUSAL_WITHOUT_MASK else None
        return attention_mask if unmasked is None else dict.fromkeys(unmasked)
    if implementation not in _BOOLEAN_MASKS:
        return attention_mask
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


_CAUSAL_ONLY: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _causal_layers_only(model: Any) -> bool:
    """Whether every attention layer of ``model`` is full causal attention: a prepared causal mask would replace the
    sliding-window or chunked mask transformers builds for the others, and would be wrong for a bidirectional one
    (an attention module whose ``is_causal`` is False). Worked out once per module."""
    module = getattr(model, "module", model)
    known = _CAUSAL_ONLY.get(module)
    if known is None:
        hf_config = getattr(module, "config", None)
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types is not None:
            full = all(kind == "full_attention" for kind in layer_types)
        else:
            windowed = getattr(hf_config, "sliding_window", None), getattr(hf_config, "attention_chunk_size", None)
            full = windowed == (None, None)
        known = _CAUSAL_ONLY[module] = full and all(getattr(m, "is_causal", True) for m in module.modules())
    return known


_UNMASKED: "weakref.WeakKeyDictionary[torch.nn.Module, Optional[Tuple[str, ...]]]" = weakref.WeakKeyDictionary()


def _unmasked_layers(model: Any) -> Optional[Tuple[str, ...]]:
    """The kinds of attention layer of ``model`` (``config.layer_types``, else ``full_attention``) when its decoder
    (``get_decoder()``, through a LoRA wrapper too) takes its masks ready-made, as a mapping of layer kind to mask
    (as ``generate`` hands them: the decoders of Qwen2, Qwen3, Gemma 2 and 3 and others check for one, named
    ``causal_mask_mapping``); None for one that builds its masks from whatever it is handed (Llama and Mistral in
    transformers 5.19, which a mapping would fail). Worked out once per module."""
    module = getattr(model, "module", model)
    if module not in _UNMASKED:
        try:  # transformers' lookup is best-effort: an exotic model may have no rule and raise
            decoder = module.get_decoder() if callable(getattr(module, "get_decoder", None)) else None
        except (AttributeError, NotImplementedError, ValueError):
            decoder = None
        forward = getattr(type(decoder), "forward", None)
        code = getattr(inspect.unwrap(forward), "__code__", None) if callable(forward) else None
        takes_mapping = code is not None and "causal_mask_mapping" in code.co_varnames
        kinds = getattr(getattr(module, "config", None), "layer_types", None) or ["full_attention"]
        _UNMASKED[module] = tuple(dict.fromkeys(kinds)) if takes_mapping else None
    return _UNMASKED[module]


@dataclass(frozen=True)
class LMLogits:
    """A causal LM's logits over a batch and the ids they score, in the forward's layout.

    Attributes:
        logits: ``(B, T, V)``; ``(1, N, V)`` packed; this rank's ``(R, T/n, V)`` positions sharded.
        input_ids: the ids in the same layout; ``next_ids``: the token each position predicts.
        layout: how the rows were laid out.
    """

    logits: Tensor
    input_ids: Tensor
    next_ids: Tensor
    layout: Layout

    def per_token(self, per_position: Tensor) -> Tensor:
        """Values computed at the prediction positions of :attr:`logits` (``next_ids=`` of
        :func:`rlhf.ops.logprobs.token_logprobs`) on the tokens they predict, in the padded ``(B, T)`` layout,
        column 0 = 0."""
        return self.layout.restore(per_position, token_aligned=True)


def lm_logits(model: Any, input_ids: Tensor, attention_mask: Tensor, packing: Optional[bool] = None) -> LMLogits:
    """A causal LM's forward over ``(B, T)`` right-padded rows, laid out as :func:`_run` lays it out."""
    out, ids, next_ids, layout = _run(model, input_ids, attention_mask, packing)
    return LMLogits(out.logits, ids, next_ids, layout)


def hidden_forward(model: Any, input_ids: Tensor, attention_mask: Tensor, head: Any, packing: Optional[bool]) -> Tensor:
    """``head`` on the model's last hidden states at every position of ``(B, T)`` right-padded rows -> ``(B, T,
    ...)`` in the padded layout (0 at padding when packed)."""
    out, _, _, layout = _run(model, input_ids, attention_mask, packing, output_hidden_states=True)
    return layout.restore(head(out.hidden_states[-1]), token_aligned=False)
