"""Loading HF models for the trainer workers.

Two kinds: a causal LM (policy, reference) and a scalar-head model (reward model, critic), the latter an
``AutoModelForSequenceClassification`` with one label so it saves and loads back as an ordinary HF directory.
Scores are read at the last real token through :func:`scalar_head_values`, which uses the attention mask rather
than the pad id (tokenizers whose pad id equals the EOS id would otherwise score the wrong token).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from rlhf.hub import model_dir
from rlhf.models.lora import LoraSpec
from rlhf.models.packing import packed_forward, runs_packed
from rlhf.ops.logprobs import at_least_float32
from rlhf.utils.device import torch_dtype

CAUSAL_LM = "causal_lm"
SCALAR_HEAD = "scalar_head"


@dataclass(frozen=True)
class ModelSpec:
    """What a worker loads. ``precision`` and ``attn_implementation`` are already resolved for the worker."""

    path: str  # a local HF directory or a hub reference (org/name@sha, see rlhf.hub), resolved where it loads
    kind: str = CAUSAL_LM
    precision: str = "fp32"
    attn_implementation: str = "sdpa"
    disable_dropout: bool = True
    gradient_checkpointing: bool = False
    seed: int = 0  # seeds freshly initialised heads identically on every rank
    packing: bool = False  # load a variable-length attention so forwards can run padding-free (train.packing)
    lora: Optional[LoraSpec] = None  # adapters for a trainable build (model.lora.*); frozen builds ignore it


def load_model(spec: ModelSpec, zero3_config: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """Load ``spec.path`` (a hub reference from this node's HF cache). With ``zero3_config`` (a DeepSpeed ZeRO-3
    config) the weights are partitioned while loading, so a model larger than one device's memory never
    materialises whole on any rank."""
    import transformers

    path = model_dir(spec.path)

    kwargs = dict(dtype=torch_dtype(spec.precision), attn_implementation=spec.attn_implementation)
    torch.manual_seed(spec.seed)
    with _zero3_init(zero3_config):
        if spec.kind == CAUSAL_LM:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        elif spec.kind == SCALAR_HEAD:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
            if model.config.pad_token_id is None:
                # HF pooling needs a pad id to find the last token when the model is used on its own later.
                model.config.pad_token_id = _pad_id_from_generation(model)
        else:
            raise ValueError(f"unknown model kind {spec.kind!r}; valid: {CAUSAL_LM}, {SCALAR_HEAD}")
    if spec.disable_dropout:
        disable_dropout(model)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # The KV cache is for generation; training and scoring forwards should not build one.
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def _zero3_init(zero3_config: Optional[Dict[str, Any]]):
    if not zero3_config:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(zero3_config)  # must outlive from_pretrained: transformers holds a weakref
    try:
        yield
    finally:
        del keep_alive


def _pad_id_from_generation(model: torch.nn.Module) -> Optional[int]:
    eos = getattr(model.config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout probability: dropout makes the same batch give different gradients when split
    differently (it consumes the RNG per micro-batch), and breaks RL log-prob ratios."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, key) and isinstance(getattr(model.config, key), float):
            setattr(model.config, key, 0.0)


def scalar_head_values(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       packing: Optional[bool] = None) -> torch.Tensor:
    """Per-token scalar outputs of a sequence-classification model, ``(B, T)`` float32 (float64 for a float64 model);
    the forward runs on the packed rows per :func:`rlhf.models.packing.runs_packed` (0 at padding then).

    ``model`` may be the HF module or a DeepSpeed engine around it. The forward goes through the engine so its
    backward bookkeeping (ZeRO hooks) sees an output the loss depends on (the final hidden states); the score head
    is then applied to every position (the critic needs per-token values; the reward model reads the last real
    token with :func:`last_token_values`).
    """
    head = getattr(model, "module", model).score
    if not runs_packed(model, packing):
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return at_least_float32(head(out.hidden_states[-1]).squeeze(-1))
    out, rows = packed_forward(model, input_ids, attention_mask, output_hidden_states=True)
    return at_least_float32(rows.unpack(head(out.hidden_states[-1]).squeeze(-1), token_aligned=False))


def last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``values (B, T)`` at each row's last real token (right padding) -> ``(B,)``."""
    last = attention_mask.long().sum(-1).clamp(min=1) - 1
    return values.gather(1, last.unsqueeze(1)).squeeze(1)
