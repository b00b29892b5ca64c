"""Loading HF models for the trainer workers.

Two kinds: a causal LM (policy, reference) and a scalar-head model (reward model, critic), the latter an
``AutoModelForSequenceClassification`` with one label so it saves and loads back as an ordinary HF directory.
Scores are read at the last real token through :func:`scalar_head_values`, which uses the attention mask rather
than the pad id (tokenizers whose pad id equals the EOS id would otherwise score the wrong token).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Set

import torch

from rlhf.hub import model_dir
from rlhf.models.compiled import compile_layers
from rlhf.models.forward import hidden_forward
from rlhf.models.head import enable_tiled_head
from rlhf.models.lora import LoraSpec
from rlhf.models.tiled_mlp import enable_tiled_mlp
from rlhf.ops.logprobs import at_least_float32
from rlhf.utils.device import torch_dtype

CAUSAL_LM = "causal_lm"
SCALAR_HEAD = "scalar_head"
_HALF = (torch.bfloat16, torch.float16)  # the dtypes zero.Init casts buffers to (float32 weights: none cast)


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
    tiled_head: bool = False  # log-probs from the LM head in token tiles (model.tiled_head, rlhf.models.head)
    tiled_mlp: bool = False  # each gated MLP in tiles of positions (model.tiled_mlp, rlhf.models.tiled_mlp)
    compile: bool = False  # torch.compile on each decoder layer (model.compile, rlhf.models.compiled)
    lora: Optional[LoraSpec] = None  # adapters for a trainable build (model.lora.*); frozen builds ignore it


def load_model(spec: ModelSpec, zero3_config: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """Load ``spec.path`` (a hub reference from this node's HF cache). With ``zero3_config`` (a DeepSpeed ZeRO-3
    config) the weights are partitioned while loading, so a model larger than one device's memory never
    materialises whole on any rank."""
    path = model_dir(spec.path)

    kwargs = dict(dtype=torch_dtype(spec.precision), attn_implementation=spec.attn_implementation)
    auto_class, extra = _auto_class(spec.kind)
    dtypes: Dict[str, torch.dtype] = {}
    if zero3_config and kwargs["dtype"] in _HALF:  # before seeding, so the seeded heads cannot depend on it
        dtypes = zero3_buffer_dtypes(_skeleton(auto_class, path, kwargs, extra), zero3_config)
        zero3_config = keep_fp32_buffers(zero3_config, dtypes)
    torch.manual_seed(spec.seed)
    with _zero3_init(zero3_config):
        model = auto_class.from_pretrained(path, **kwargs, **extra)
    check_buffer_dtypes(model, dtypes)
    if spec.kind == SCALAR_HEAD and model.config.pad_token_id is None:
        # HF pooling needs a pad id to find the last token when the model is used on its own later.
        model.config.pad_token_id = _pad_id_from_generation(model)
    if spec.disable_dropout:
        disable_dropout(model)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # The KV cache is for generation; training and scoring forwards should not build one.
    model.config.use_cache = False
    if spec.tiled_head and spec.kind == CAUSAL_LM:
        enable_tiled_head(model)
    if spec.tiled_mlp:
        enable_tiled_mlp(model)
    if spec.compile:
        compile_layers(model)
    return model


def _auto_class(kind: str):
    """``kind`` -> (the transformers auto class that loads it, its extra ``from_pretrained`` arguments)."""
    import transformers

    if kind == CAUSAL_LM:
        return transformers.AutoModelForCausalLM, {}
    if kind == SCALAR_HEAD:
        return transformers.AutoModelForSequenceClassification, {"num_labels": 1}
    raise ValueError(f"unknown model kind {kind!r}; valid: {CAUSAL_LM}, {SCALAR_HEAD}")


def _skeleton(auto_class: Any, path: str, kwargs: Dict[str, Any], extra: Dict[str, Any]) -> torch.nn.Module:
    """The model as an ordinary (non-ZeRO) ``from_pretrained`` constructs it before loading values: its class built
    under the load dtype on the meta device, so every buffer has the dtype the model's ``__init__`` gave it, at no
    memory cost. Must run outside ZeRO-3 (no live ``HfDeepSpeedConfig``), where ``from_config`` uses no zero.Init."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, **extra)
    with torch.device("meta"):
        return auto_class.from_config(config, **kwargs)


def persistent_numel(spec: ModelSpec) -> int:
    """The size of ``spec``'s largest 1-D parameter (a norm's or a bias's: the width), 0 if it has none: under ZeRO 3
    the parameters up to this size stay whole on every rank (``rlhf.distributed.engine.build_ds_config``). Read off
    the model built on the meta device, so no weight is loaded."""
    auto_class, extra = _auto_class(spec.kind)
    skeleton = _skeleton(auto_class, model_dir(spec.path), {"dtype": torch_dtype(spec.precision)}, extra)
    return max((p.numel() for p in skeleton.parameters() if p.dim() == 1), default=0)


def zero3_buffer_dtypes(skeleton: torch.nn.Module, zero3_config: Dict[str, Any]) -> Dict[str, torch.dtype]:
    """``name -> dtype`` every floating buffer of ``skeleton`` (:func:`_skeleton`, half-precision weights) must have
    after a ZeRO-3 build: float32 where the ordinary build has it, or where DeepSpeed's own
    ``data_types.keep_in_fp32_modules`` setting (its default ``"auto"``: the model's ``_keep_in_fp32_modules_strict``)
    keeps it; else the skeleton's dtype."""
    from deepspeed.runtime.keep_in_fp32 import keep_in_fp32_pattern

    weights = next(skeleton.parameters()).dtype
    setting = zero3_config.get("data_types", {}).get("keep_in_fp32_modules", "auto")
    dtypes = {name: buf.dtype for name, buf in skeleton.named_buffers() if buf.is_floating_point()}
    for prefix, module in skeleton.named_modules():  # as zero.Init applies the setting: per module, names relative
        pattern = keep_in_fp32_pattern(module, setting, weights)
        for name, buf in module.named_buffers() if pattern is not None else ():
            if buf.is_floating_point() and pattern.search(name):
                dtypes[f"{prefix}.{name}" if prefix else name] = torch.float32
    return dtypes


def keep_fp32_buffers(zero3_config: Dict[str, Any], dtypes: Dict[str, torch.dtype]) -> Dict[str, Any]:
    """``zero3_config`` whose zero.Init keeps in float32 exactly the buffers ``dtypes`` (:func:`zero3_buffer_dtypes`)
    says are float32; the same object when there are none.

    Why: zero.Init casts every floating tensor created inside a module's ``__init__`` to the training dtype, buffers
    included (its wrapped ``torch.arange`` & co. override an explicit ``dtype=torch.float``), so under bf16 the rotary
    ``inv_freq`` / ``original_inv_freq``, which transformers computes and keeps in float32 on every other stage,
    became bf16 and every ZeRO-3 forward differed from the other stages' (1.7e-5 relative at step 1, more on long
    rows). DeepSpeed's ``keep_in_fp32_modules`` upcasts the buffers it names as each module's ``__init__`` returns,
    before transformers writes their values (``_init_weights`` recomputes non-persistent ones such as ``inv_freq`` in
    float32, the checkpoint fills persistent ones), so they get the dtype and the values of an ordinary build. Any
    buffer the model creates in float32 is covered, not only rotary ones.

    DeepSpeed matches the patterns at every module it wraps, on names relative to that module, and not at every
    module (a class without its own ``__init__``, e.g. ``Qwen2ForSequenceClassification``, runs it on the empty
    module its base class has just built). So each kept buffer is named by every dotted suffix of its path (its own
    name at its owner, ``rotary_emb.inv_freq`` one level up, ...), less the suffixes of any buffer that is not kept:
    no other buffer can match, and :func:`check_buffer_dtypes` verifies that the kept ones were reached. The list
    replaces DeepSpeed's setting, which is why ``dtypes`` already holds what that setting keeps.
    """
    keep = {name for name, dtype in dtypes.items() if dtype == torch.float32}
    if not keep:
        return zero3_config
    patterns = _suffixes(keep) - _suffixes(dtypes.keys() - keep)
    # DeepSpeed turns each "*" into ".*" and searches; module paths hold no "*", so escaped names stay exact.
    data_types = {
        **zero3_config.get("data_types", {}),
        "keep_in_fp32_modules": sorted(f"^{re.escape(name)}$" for name in patterns),
    }
    return {**zero3_config, "data_types": data_types}


def _suffixes(names: Any) -> Set[str]:
    """Every dotted suffix of each name: ``a.b.c`` -> ``{a.b.c, b.c, c}``."""
    return {".".join(parts[i:]) for parts in (name.split(".") for name in names) for i in range(len(parts))}


def check_buffer_dtypes(model: torch.nn.Module, dtypes: Dict[str, torch.dtype]) -> None:
    """Raise unless every buffer named in ``dtypes`` has that dtype in ``model`` (a ZeRO-3 build)."""
    wrong = {name: buf.dtype for name, buf in model.named_buffers() if name in dtypes and buf.dtype != dtypes[name]}
    if wrong:
        raise RuntimeError(
            "DeepSpeed's zero.Init left buffers in another dtype than an ordinary build gives them: "
            + ", ".join(f"{name} is {dtype}, expected {dtypes[name]}" for name, dtype in sorted(wrong.items()))
            + "; this ZeRO-3 build would compute differently from ZeRO 0-2 (strategy.zero_stage): use "
            "strategy.zero_stage=2, or report the model"
        )


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


def scalar_head_values(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, packing: Optional[bool] = None
) -> torch.Tensor:
    """Per-token scalar outputs of a sequence-classification model, ``(B, T)`` float32 (float64 for a float64 model);
    the forward is laid out by :func:`rlhf.models.forward.hidden_forward` (packed: 0 at padding).

    ``model`` may be the HF module or a DeepSpeed engine around it. The forward goes through the engine so its
    backward bookkeeping (ZeRO hooks) sees an output the loss depends on (the final hidden states); the score head
    is then applied to every position (the critic needs per-token values; the reward model reads the last real
    token with :func:`last_token_values`).
    """
    head = getattr(model, "module", model).score
    return at_least_float32(hidden_forward(model, input_ids, attention_mask, head, packing).squeeze(-1))


def last_token_values(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``values (B, T)`` at each row's last real token (right padding) -> ``(B,)``."""
    last = attention_mask.long().sum(-1).clamp(min=1) - 1
    return values.gather(1, last.unsqueeze(1)).squeeze(1)
