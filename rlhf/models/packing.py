"""Padding-free packing: the rows of a right-padded batch run as one sequence, attention kept within each row.

A micro-batch of ``B`` rows padded to ``T`` columns costs ``B x T`` tokens of compute in every projection and MLP;
on long-tailed data (a few 1,000-token rows among 50-token ones) most of that is padding. Packed, the ``N`` real
tokens of the rows are laid end to end as one ``(1, N)`` sequence with position ids restarting at 0 for each row,
and the attention kernel is told where each row starts (``cu_seqlens``, the cumulative row lengths), so no token
attends across a row boundary. Every per-token output is then moved back to the ``(B, T)`` layout, so losses,
masks and counts are computed exactly as unpacked: packing changes the cost, not the maths (results agree to
floating-point rounding: the matrix products run over differently shaped inputs).

Attention paths (selected by :func:`packed_attention`, per worker, from what it can run):

* GPU with flash-attn: ``flash_attention_2``. transformers passes ``cu_seq_lens_q/k`` and ``max_length_q/k`` to
  flash-attention's variable-length kernel.
* Everywhere else: :data:`VARLEN_TORCH`, registered here with transformers' attention interface. It takes the very
  same keyword arguments and picks its kernel from the tensors it is given (:func:`varlen_kernel`): on CUDA in
  bf16 / fp16, PyTorch's own Flash-Attention varlen kernel (``torch.nn.attention.varlen.varlen_attn``, no build,
  no extra package); on a CPU (the CPU twin) or in fp32, torch's ``scaled_dot_product_attention`` causally on each
  row's slice of the packed queries, keys and values. Both do ``sum_i L_i^2`` attention work, not the ``N^2`` of one
  masked attention over the whole packed sequence. Given no ``cu_seq_lens_q`` (an unpacked forward) it is
  transformers' own sdpa with the usual padding mask.

Only the attention kernel differs between the paths: the packing, the model call and the unpacking are this
module's, on every device.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

Tensor = torch.Tensor

VARLEN_TORCH = "rlhf_varlen"  # transformers attn_implementation name of torch's varlen kernel and its CPU twin
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", VARLEN_TORCH)  # implementations that honour cu_seqlens
_HALF = (torch.bfloat16, torch.float16)
# set on an HF module whose attention wraps another (rlhf.models.sequence_parallel): the implementation it wraps
CORE_ATTENTION = "_rlhf_core_attention"


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of a right-padded ``(B, T)`` batch laid end to end: ``N = sum_b L_b`` tokens.

    Attributes:
        input_ids: ``(1, N)`` the rows' tokens, row after row.
        position_ids: ``(1, N)`` each token's position within its own row (0 at every row's first token).
        cu_seqlens: ``(R + 1,)`` int32 offsets of the ``R`` non-empty rows in the packed sequence (0 first, N last).
        bounds: the same offsets on the host (what a layout that adds rows of its own extends without a read).
        max_length: the longest row, ``max_b L_b``.
        rows, width: ``B`` and ``T`` of the padded layout.
        index: ``(N,)`` int64 flat index ``b * T + t`` of every packed token in the padded layout.
        row_start: ``(N,)`` bool, True at each row's first token.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    bounds: Tuple[int, ...]
    max_length: int
    rows: int
    width: int
    index: Tensor
    row_start: Tensor

    @classmethod
    def from_padded(
        cls, input_ids: Tensor, attention_mask: Tensor, host_lengths: Optional[List[int]] = None
    ) -> "PackedRows":
        """Pack ``(B, T)`` right-padded ids whose ``attention_mask`` is 1 on each row's first ``L_b`` columns.

        ``host_lengths``: the ``L_b``, known on the host (:func:`rlhf.models.host_layout.row_lengths`, which
        checked the layout there): no read of the device. Without them, the mask is read back once.

        Raises:
            ValueError: a mask that is not a prefix of ones (left padding or holes cannot be packed this way).
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"packing takes (B, T) ids and mask, got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        rows, width = input_ids.shape
        device = input_ids.device
        lengths = attention_mask.long().sum(-1)
        if host_lengths is None:
            prefix = torch.arange(width, device=device)[None, :] < lengths[:, None]
            holes = (prefix != attention_mask.bool()).sum()
            # The one host read of a packed forward: the row lengths size everything below, and the layout check
            # rides along (separate reads for the check, the index, the row starts and the longest row each made
            # the GPU wait).
            *host_lengths, bad = torch.cat([lengths, holes[None]]).tolist()
            if bad:
                raise ValueError("packing needs right-padded rows (attention_mask 1 on a prefix of each row)")
        elif len(host_lengths) != rows:
            raise ValueError(f"{len(host_lengths)} host row lengths for {rows} rows")
        total = sum(host_lengths)
        starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))[:-1]  # each row's offset in the packed run
        # per packed token, its row's offset in the packed run and in the padded layout; output_size: no host read
        row_offset = torch.repeat_interleave(starts, lengths, output_size=total)
        row_base = torch.repeat_interleave(torch.arange(rows, device=device) * width, lengths, output_size=total)
        positions = torch.arange(total, device=device) - row_offset
        index = row_base + positions
        bounds = [0]
        for length in host_lengths:
            if length:
                bounds.append(bounds[-1] + length)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)  # a copy in, no wait
        return cls(
            input_ids=input_ids.reshape(-1)[index][None],
            position_ids=positions[None],
            cu_seqlens=cu_seqlens,
            bounds=tuple(bounds),
            max_length=max(host_lengths, default=0),
            rows=rows,
            width=width,
            index=index,
            row_start=positions == 0,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.index.numel())

    def model_inputs(self) -> Dict[str, Any]:
        """Keyword arguments of the model forward: the packed ids, their positions and the row boundaries in the
        form transformers hands to the attention function (flash-attention's variable-length arguments)."""
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            cu_seq_lens_q=self.cu_seqlens,
            cu_seq_lens_k=self.cu_seqlens,
            max_length_q=self.max_length,
            max_length_k=self.max_length,
        )

    def unpack(self, values: Tensor, *, token_aligned: bool) -> Tensor:
        """Per-position outputs of the packed forward back in the padded layout, 0 at padding.

        Args:
            values: ``(1, N, ...)`` computed on the packed sequence.
            token_aligned: ``values`` belong to the token each position predicts (log-probs, entropies computed
                with :func:`rlhf.ops.logprobs.token_logprobs` on the packed sequence). At a row's first token that
                value was predicted from the previous row's last position: it is set to 0, as column 0 is in the
                padded layout (no gradient flows through it).

        Returns:
            ``(B, T, ...)``; differentiable with respect to ``values``.
        """
        if values.shape[:2] != (1, self.num_tokens):
            raise ValueError(f"packed values must be (1, {self.num_tokens}, ...), got {tuple(values.shape)}")
        flat = values[0]
        if token_aligned:
            flat = torch.where(self.row_start.view(-1, *([1] * (flat.dim() - 1))), torch.zeros_like(flat), flat)
        out = flat.new_zeros((self.rows * self.width, *flat.shape[1:])).index_copy(0, self.index, flat)
        return out.view(self.rows, self.width, *flat.shape[1:])


def attention_of(model: Any) -> Optional[str]:
    """The attention implementation ``model`` (an HF module or a DeepSpeed engine around one) runs (under sequence
    parallelism, the one its sharded attention wraps)."""
    module = getattr(model, "module", model)
    return getattr(module, CORE_ATTENTION, None) or getattr(
        getattr(module, "config", None), "_attn_implementation", None
    )


def runs_packed(model: Any, packing: Optional[bool]) -> bool:
    """Whether a forward of ``model`` packs its rows: ``packing`` when given, else whenever the model was loaded
    with a variable-length attention (a worker built with ``ModelSpec.packing``, i.e. ``train.packing``), so
    objectives and score functions follow the run's setting without being told."""
    return attention_of(model) in VARLEN_ATTENTION if packing is None else packing


def packed_forward(
    model: Any, input_ids: Tensor, attention_mask: Tensor, host_lengths: Optional[List[int]] = None, **kwargs: Any
):
    """``model`` (an HF module or a DeepSpeed engine around one) on the packed rows -> ``(output, PackedRows)``;
    ``host_lengths`` as :meth:`PackedRows.from_padded` takes them.

    Raises:
        RuntimeError: the model's attention cannot keep packed rows apart (it was loaded without
            ``ModelSpec.packing``, see :func:`packed_attention`).
    """
    implementation = attention_of(model)
    if implementation not in VARLEN_ATTENTION:
        raise RuntimeError(
            f"a packed forward needs a variable-length attention ({', '.join(VARLEN_ATTENTION)}); "
            f"this model runs {implementation!r} (built without packing)"
        )
    rows = PackedRows.from_padded(input_ids, attention_mask, host_lengths)
    if implementation == VARLEN_TORCH:  # the row bounds keep the rows apart; flash_attention_2 would read a mask
        kwargs["attention_mask"] = unread_mask(input_ids.device)
    return model(**rows.model_inputs(), **kwargs), rows


def unread_mask(device: torch.device) -> Tensor:
    """A placeholder for an attention that needs no mask (rlhf_varlen on packed rows, a sequence-parallel core).
    Given no mask, transformers reads the position ids back to look for packed rows, for a mask such an attention
    would not use; a 4-D mask it takes as ready-made, unread, and hands every layer as it is."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)


def packed_attention(resolved: str) -> str:
    """The attention implementation a packing worker loads, given the one it would load unpacked.

    ``flash_attention_2`` (a CUDA worker with flash-attn) keeps its variable-length kernel; ``sdpa`` becomes
    :data:`VARLEN_TORCH`. ``eager`` has no variable-length path (``TrainConfig`` refuses it with packing).
    """
    if resolved in VARLEN_ATTENTION:
        return resolved
    if resolved == "sdpa":
        register_varlen_attention()
        return VARLEN_TORCH
    raise ValueError(f"train.packing needs model.attn_implementation auto, sdpa or flash_attention_2, got {resolved!r}")


def register_varlen_attention() -> None:
    """Make :data:`VARLEN_TORCH` a transformers attention implementation (idempotent; per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_TORCH, _varlen_attention)
    AttentionMaskInterface.register(VARLEN_TORCH, _varlen_mask)


@functools.lru_cache(maxsize=None)
def _torch_varlen() -> tuple:
    """torch's varlen flash kernel and how to ask it for causal attention: ``(varlen_attn, causal kwargs, gqa)``, or
    ``()`` when this torch has none. The signature moved between releases (2.11: ``window_size=(-1, 0)`` for causal;
    2.13 adds ``enable_gqa``), so it is read, not assumed."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return ()
    parameters = inspect.signature(varlen_attn).parameters
    causal: Dict[str, Any]
    if "window_size" in parameters:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        return ()
    return varlen_attn, causal, "enable_gqa" in parameters


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel :data:`VARLEN_TORCH` runs for packed tensors on ``device`` in ``dtype``: ``"torch varlen_attn"``
    (Flash-Attention, CUDA and half precision) or ``"sdpa per row"`` (the CPU twin, and fp32 anywhere)."""
    usable = device.type == "cuda" and dtype in _HALF and bool(_torch_varlen())
    return "torch varlen_attn" if usable else "sdpa per row"


def _varlen_mask(*args: Any, attention_mask: Optional[Tensor] = None, **kwargs: Any):
    """No mask for a packed forward (``cu_seq_lens`` keep the rows apart; transformers would otherwise build a dense
    ``N x N`` one from the position ids); sdpa's own padding mask for an unpacked one."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    # Typed as Callable[..., ...]: mypy cannot tell that *args (transformers' positional ones) stop before
    # attention_mask, and would report it given twice.
    mask_fn: Callable[..., Optional[Tensor]] = sdpa_mask
    return mask_fn(*args, attention_mask=attention_mask, **kwargs)


def _varlen_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    cu_seq_lens_q: Optional[Tensor] = None,
    cu_seq_lens_k: Optional[Tensor] = None,
    max_length_q: Optional[int] = None,
    max_length_k: Optional[int] = None,
    **kwargs: Any,
):
    """Causal attention within each row of a packed ``(1, heads, N, head_dim)`` query/key/value, by
    :func:`varlen_kernel`'s choice; ``(1, N, heads, head_dim)`` out, as transformers' attention functions return.
    Unpacked (no ``cu_seq_lens_q``): plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("position_ids", None)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # PackedRows hands the same tensor for both: compared only when they differ (torch.equal reads to the host)
    same = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q or torch.equal(cu_seq_lens_q, cu_seq_lens_k)
    if query.shape[0] != 1 or not same:
        raise ValueError("varlen sdpa takes one packed sequence with the same row boundaries for queries and keys")
    window = kwargs.get("sliding_window")
    if window is not None and max_length_q is not None and max_length_q > window:
        # flash-attention applies the window; this loop would not, and rows would see more than they should
        raise NotImplementedError(
            f"rlhf_varlen has no sliding window: a {max_length_q}-token row exceeds the "
            f"model's {window}-token window (use flash_attention_2 or shorter rows)"
        )
    if varlen_kernel(query.device, query.dtype) == "torch varlen_attn":
        return _flash_varlen(module, query, key, value, cu_seq_lens_q, max_length_q, **kwargs), None
    kwargs["is_causal"] = True
    bounds = cu_seq_lens_q.tolist()
    parts = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs)[0]
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts, dim=1), None


def _flash_varlen(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    max_length: Optional[int],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **_: Any,
) -> Tensor:
    """torch's Flash-Attention varlen kernel on packed ``(1, heads, N, head_dim)`` tensors -> ``(1, N, heads,
    head_dim)``; grouped-query keys and values are shared by the kernel when it can (``enable_gqa``), else repeated."""
    if dropout and module.training:
        raise NotImplementedError("rlhf_varlen on CUDA runs without attention dropout (model.disable_dropout)")
    varlen_attn, causal, gqa = _torch_varlen()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, heads, head_dim), last dim contiguous
    extra = dict(causal)
    if k.shape[1] != q.shape[1]:
        if gqa:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int(max_length) if max_length is not None else int((cu[1:] - cu[:-1]).max())
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)
    return out.unsqueeze(0)
