"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for every trainer.

A wrapped ``Linear`` computes ``W x + (alpha / r) * B A x`` with ``W`` frozen, ``A (r, in)`` and ``B (out, r)``
trained; ``B`` starts at zero, so the wrapped model starts equal to its base. The wrapping is PEFT's (``peft``
``LoraConfig`` + ``get_peft_model``), so adapters save and load as PEFT adapters. Departures from the paper and from
PEFT's defaults:

* Only ``torch.nn.Linear`` layers are wrapped (PEFT also wraps embeddings and GPT-2's ``Conv1D``): the merge below
  is ``W + s * B @ A`` for an ``(out, in)`` weight and nothing else.
* The output head is never wrapped: ``lm_head`` is the output layer (and, tied, the input embedding too); a
  scalar head (reward model, critic) is a fresh ``(1, hidden)`` layer that is trained fully instead
  (PEFT's ``modules_to_save``: a trainable copy of ``score``, the original kept frozen).
* Every name in a list of ``target_modules`` must match something: PEFT only fails when nothing at all matches, so
  a typo next to a correct name would silently train fewer layers.
* Adapters take the base weights' dtype (PEFT's ``autocast_adapter_dtype`` would keep bf16 adapters in fp32, which
  a DeepSpeed bf16 engine casts back to bf16 anyway).

Weight sync and export work on *named tensors* (what :func:`rlhf.distributed.engine.iter_full_state` yields, ZeRO-3
shards gathered one parameter at a time): :func:`merged_named_tensors` turns the PEFT model's names into the base
model's names with ``W + s * B @ A`` merged, holding one module's pieces at a time; :func:`adapter_named_tensors`
keeps only what PEFT's ``save_pretrained`` writes.

``peft`` and ``transformers`` are imported inside the functions that need them: importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from rlhf.hub import model_dir

KEY = "model.lora"
ADAPTER = "default"  # PEFT's adapter name; the only one this project creates
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every Linear layer except the output head
CAUSAL_LM = "causal_lm"  # = rlhf.models.loading.CAUSAL_LM (loading imports this module)
SCALAR_HEAD = "scalar_head"
SCALAR_HEAD_NAMES = ("score", "classifier")  # PEFT's SEQ_CLS_HEAD_NAMES: the heads it keeps fully trainable
PEFT_PREFIX = "base_model.model."  # a PeftModel's state-dict names start with it
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

Named = Iterable[Tuple[str, torch.Tensor]]
Targets = Union[str, Tuple[str, ...]]


@dataclass(frozen=True)
class LoraSpec:
    """The ``model.lora`` keys. ``r == 0`` (the default) means no LoRA: the whole model trains.

    ``target_modules`` follows PEFT: a tuple of names matches every module whose path ends in ``.name`` (or equals
    it); a string is a regular expression the whole module path must match (``re.fullmatch``), or
    ``"all-linear"`` (also accepted as the one-name tuple ``("all-linear",)``, what a YAML list gives).
    """

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Targets = (ALL_LINEAR,)

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 0:
            raise ValueError(f"{KEY}.r must be an integer >= 0 (0 disables LoRA), got {self.r!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not (math.isfinite(self.alpha) and self.alpha > 0)
        ):
            raise ValueError(
                f"{KEY}.alpha must be a finite number > 0 (the adapter is scaled by alpha / r), got {self.alpha!r}"
            )
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not (0.0 <= self.dropout < 1.0)
        ):
            raise ValueError(f"{KEY}.dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "target_modules", _normalized_targets(self.target_modules))

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``: ``alpha / r`` (PEFT's ``scaling`` without rsLoRA)."""
        return self.alpha / self.r

    @property
    def all_linear(self) -> bool:
        return self.target_modules == ALL_LINEAR


def _normalized_targets(targets: Any) -> Targets:
    """A regex string or ``"all-linear"`` as it is; a list/tuple of names as a tuple; errors name the key."""
    key = f"{KEY}.target_modules"
    if isinstance(targets, str):
        if targets.lower() == ALL_LINEAR:
            return ALL_LINEAR
        if not targets:
            raise ValueError(f"{key} must not be empty")
        try:
            re.compile(targets)
        except re.error as exc:
            raise ValueError(
                f"{key}={targets!r} is a string, so a regular expression over module paths, and it "
                f"does not compile: {exc}"
            ) from None
        return targets
    if not isinstance(targets, (list, tuple)) or not targets:
        raise ValueError(
            f"{key} must be a non-empty list of module names, a regular expression string or "
            f"{ALL_LINEAR!r}, got {targets!r}"
        )
    names = tuple(targets)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"{key} entries must be non-empty strings, got {bad!r} in {list(names)!r}")
    if any(n.lower() == ALL_LINEAR for n in names):
        if len(names) > 1:
            raise ValueError(
                f"{key}: {ALL_LINEAR!r} already means every Linear layer; it cannot be combined with "
                f"other names ({list(names)!r})"
            )
        return ALL_LINEAR
    return names


def _targets_repr(targets: Targets) -> str:
    return repr(targets) if isinstance(targets, str) else repr(list(targets))


# ---------------------------------------------------------------------------------------------------- targets
def _linear_modules(model: torch.nn.Module) -> Tuple[List[str], List[str], Dict[str, str]]:
    """``(Linear module names, head names, {name: class} of every other module)`` of an HF model (or the HF model
    inside a PEFT model or DeepSpeed engine, with their prefixes removed)."""
    model = _hf_model(model)
    heads = []
    # ignore: torch types nn.Module.__getattr__ as Tensor | Module; this is the HF model's method
    output = (
        model.get_output_embeddings()  # type: ignore[operator]
        if hasattr(model, "get_output_embeddings")
        else None
    )
    for attr in SCALAR_HEAD_NAMES:
        if output is None and isinstance(getattr(model, attr, None), torch.nn.Module):
            output = getattr(model, attr)
    linear, other, inside = [], {}, None
    for name, module in model.named_modules():  # depth first: a module's descendants follow it
        if inside is not None and name.startswith(inside):
            continue  # inside a PEFT layer (base_layer, lora_A, ...) or a head's modules_to_save wrapper
        outer = module
        if hasattr(module, "base_layer") or hasattr(module, "original_module"):
            inside = f"{name}."
            module = getattr(module, "base_layer", None) or module.original_module
        if output is not None and output in (outer, module) and name:
            heads.append(name)
        if isinstance(module, torch.nn.Linear):
            linear.append(name)
        elif name:
            other[name] = type(module).__name__
    return linear, heads, other


def _hf_model(model: Any) -> torch.nn.Module:
    """The HF model under a DeepSpeed engine / TrainEngine (``.module``) and a PeftModel (``get_base_model``)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _matches(targets: Targets, name: str) -> bool:
    """PEFT's rule (``peft.tuners.tuners_utils.check_target_module_exists``): a string is ``re.fullmatch``ed
    against the module path; a name matches the path it equals or ends with after a dot."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets)


def matching_modules(model_or_names: Union[torch.nn.Module, Iterable[str]], target_modules: Targets) -> List[str]:
    """The Linear modules a LoRA spec would wrap, in module order, by PEFT's matching rule.

    Args:
        model_or_names: an HF model (meta-device or partitioned is fine: only names and types are read; a PeftModel
            or DeepSpeed engine around one works too), or the names of its Linear modules. With names, the head
            that ``"all-linear"`` leaves out is any top-level ``lm_head``, ``score`` or ``classifier``.
        target_modules: as :class:`LoraSpec` takes it.

    Returns:
        Module paths relative to the HF model (``model.layers.0.self_attn.q_proj``), possibly empty. The output
        head is included if a target names it (:func:`validate_targets` refuses that).
    """
    targets = _normalized_targets(target_modules)
    if isinstance(model_or_names, torch.nn.Module):
        linear, heads, _ = _linear_modules(model_or_names)
    else:
        linear = list(model_or_names)
        heads = [n for n in linear if n in ("lm_head",) + SCALAR_HEAD_NAMES]
    if targets == ALL_LINEAR:
        return [n for n in linear if n not in heads]
    return [n for n in linear if _matches(targets, n)]


def validate_targets(model: torch.nn.Module, target_modules: Targets, where: str = "the model") -> List[str]:
    """:func:`matching_modules` of ``model``, refusing a spec PEFT would take but this project should not.

    Raises:
        ValueError: naming ``model.lora.target_modules``, when nothing matches, when one of several names matches
            nothing (a typo), when a target would wrap the output head, or when it matches a module that is not a
            Linear layer (PEFT would wrap an embedding or fail on a block such as ``mlp``).
    """
    targets = _normalized_targets(target_modules)
    linear, heads, other = _linear_modules(model)
    key = f"{KEY}.target_modules={_targets_repr(targets)}"
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in linear if n not in heads})
    available = f"its Linear layers end in: {', '.join(suffixes)}"
    hit_heads = [] if targets == ALL_LINEAR else [h for h in heads if _matches(targets, h)]
    if hit_heads:
        why = (
            "a scalar head is a freshly initialised (1, hidden) layer: with LoRA it is trained fully instead "
            "(PEFT's modules_to_save)"
            if hit_heads[0] in SCALAR_HEAD_NAMES
            else "it maps hidden states to the vocabulary (and is often tied to the input embedding); train the head "
            "fully without LoRA if it must change"
        )
        raise ValueError(
            f"{key} would wrap the output head {hit_heads[0]!r} of {where}: the head is the output "
            f"layer, not a place for a low-rank update; {why}. Remove it; {available}"
        )
    if targets != ALL_LINEAR:
        not_linear = [f"{n} ({cls})" for n, cls in other.items() if _matches(targets, n)]
        if not_linear:
            raise ValueError(
                f"{key} matches modules of {where} that are not Linear layers: "
                f"{', '.join(not_linear[:5])}; LoRA here wraps Linear layers only, {available}"
            )
    found = matching_modules(model, targets)
    if not found:
        raise ValueError(f"{key} matches no Linear layer of {where}; {available}")
    if isinstance(targets, tuple):
        unused = [t for t in targets if not any(_matches((t,), n) for n in found)]
        if unused:
            raise ValueError(f"{key}: {unused!r} match no Linear layer of {where} (a typo?); {available}")
    return found


def meta_model(path: str, kind: str) -> torch.nn.Module:
    """The architecture of the model at ``path`` built from its config on the meta device: no weights are read
    or allocated. ``kind`` as :class:`rlhf.models.loading.ModelSpec` (a scalar head has one label)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir(path))
    with torch.device("meta"):
        if kind == CAUSAL_LM:
            return transformers.AutoModelForCausalLM.from_config(config)
        if kind == SCALAR_HEAD:
            config.num_labels = 1
            return transformers.AutoModelForSequenceClassification.from_config(config)
    raise ValueError(f"unknown model kind {kind!r}; valid: {CAUSAL_LM}, {SCALAR_HEAD}")


def check_targets(path: str, kind: str, target_modules: Targets) -> List[str]:
    """:func:`validate_targets` for the model at ``path`` without loading its weights (the driver's check before
    any worker starts). Returns the module paths LoRA would wrap."""
    return validate_targets(meta_model(path, kind), target_modules, where=f"{path} ({kind})")


# ---------------------------------------------------------------------------------------------------- wrapping
def lora_config(spec: LoraSpec, kind: str, **overrides: Any):
    """The ``peft.LoraConfig`` for ``spec`` on a model of ``kind``."""
    from peft import LoraConfig, TaskType

    if kind not in (CAUSAL_LM, SCALAR_HEAD):
        raise ValueError(f"unknown model kind {kind!r}; valid: {CAUSAL_LM}, {SCALAR_HEAD}")
    targets = spec.target_modules
    kwargs: Dict[str, Any] = dict(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        bias="none",
        target_modules=targets if isinstance(targets, str) else list(targets),
        task_type=TaskType.CAUSAL_LM if kind == CAUSAL_LM else TaskType.SEQ_CLS,
        # PEFT's SEQ_CLS model adds these itself; named here so the saved config says so whoever builds it.
        modules_to_save=list(SCALAR_HEAD_NAMES) if kind == SCALAR_HEAD else None,
    )
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


def apply_lora(model: torch.nn.Module, spec: LoraSpec, kind: str, seed: Optional[int] = None):
    """Wrap an HF model (as :func:`rlhf.models.loading.load_model` returns it) in PEFT LoRA adapters.

    The base weights are frozen (``requires_grad=False``); the adapters and, for a scalar head, a copy of the
    ``score`` head train. ``A`` is drawn from torch's global RNG (Kaiming-uniform), or from ``seed`` without
    moving the global RNG; ``B`` is zero, so the result computes exactly what the base computes.
    ``model.score`` stays reachable on the wrapper (PEFT forwards attribute lookups), so
    :func:`rlhf.models.loading.scalar_head_values` works on it unchanged, and applies the trainable copy.

    Returns:
        A ``peft.PeftModelForCausalLM`` (``causal_lm``) or ``PeftModelForSequenceClassification`` (``scalar_head``).
    """
    from peft import get_peft_model

    if not spec.enabled:
        raise ValueError(f"{KEY}.r is 0: LoRA is disabled, there is nothing to apply")
    found = validate_targets(model, spec.target_modules, where=f"the {kind} model")
    # "all-linear" as the exact list: PEFT's own expansion also takes layers that are not torch Linear (Conv1D).
    config = lora_config(spec, kind, **({"target_modules": found} if spec.all_linear else {}))
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER, autocast_adapter_dtype=False)
    if any(hasattr(p, "ds_id") for n, p in peft_model.named_parameters() if ".lora_" in n):
        # Under zero.Init the adapters are partitioned as they are created, before PEFT initialises them: PEFT's
        # in-place init then writes into empty placeholders and B keeps nn.Linear's random init (seen: the wrapped
        # model no longer starts at its base). Created outside, DeepSpeed partitions them at initialize().
        raise RuntimeError(
            "apply_lora ran inside deepspeed.zero.Init: call it after load_model returns (the base "
            "may be ZeRO-3 partitioned), outside any zero.Init context"
        )
    return peft_model


def _peft_model(model: Any):
    inner = getattr(model, "module", model)  # DeepSpeed engine / TrainEngine
    if not hasattr(inner, "disable_adapter"):
        raise TypeError(f"{type(inner).__name__} carries no LoRA adapters (not a PEFT model)")
    return inner


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """Within the block, forwards of ``model`` (a PEFT model, or a DeepSpeed engine / TrainEngine around one) are
    the frozen base model's: the adapters are skipped and a scalar head's original ``score`` is used. This is the
    reference model of DPO / KL-regularised RL without a second copy of the weights."""
    with _peft_model(model).disable_adapter():
        yield


@dataclass(frozen=True)
class OnBaseModel:
    """A score function (``(model, batch) -> tensor``) run on the frozen base of a LoRA model, adapters off: the
    DPO / RL reference scored by the policy's own workers (``rlhf.objectives.base.ScoreFn``)."""

    fn: Any

    def __call__(self, model: Any, batch: Any) -> torch.Tensor:
        with adapters_disabled(model):
            return self.fn(model, batch)


def is_lora_model(model: Any) -> bool:
    return hasattr(getattr(model, "module", model), "disable_adapter")


# ---------------------------------------------------------------------------------------------------- named tensors
_BASE = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<leaf>[^.]+)$")
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
_SAVED_COPY = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<leaf>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<leaf>.+)$")
_UNSUPPORTED = re.compile(r"\.(lora_embedding_[AB]|lora_magnitude_vector|lora_bias)\.")


def _strip_prefix(name: str) -> str:
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def _check_adapter(name: str, adapter: str) -> None:
    if adapter != ADAPTER:
        raise ValueError(f"{name}: adapter {adapter!r}, but only PEFT's single {ADAPTER!r} adapter is supported")


class _PendingModule:
    """One wrapped Linear's pieces while they arrive: the base layer's tensors (weight, bias) and A, B."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.base: List[Tuple[str, torch.Tensor]] = []
        self.lora: Dict[str, torch.Tensor] = {}

    def merged(self, scaling: float, rank: int) -> Iterator[Tuple[str, torch.Tensor]]:
        base = dict(self.base)
        if "weight" not in base or set(self.lora) != {"A", "B"}:
            raise ValueError(
                f"LoRA module {self.module!r} arrived incomplete (base {sorted(base)}, lora "
                f"{sorted(self.lora)}): its tensors must come together, as a state dict orders them"
            )
        a, b, w = self.lora["A"], self.lora["B"], base["weight"]
        if a.shape[0] != rank or b.shape[1] != rank or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(
                f"{self.module}: A {tuple(a.shape)}, B {tuple(b.shape)}, W {tuple(w.shape)} do not fit "
                f"W + B @ A with r={rank} (the spec is not the one the model was wrapped with)"
            )
        for leaf, tensor in self.base:
            yield f"{self.module}.{leaf}", merge_weight(w, a, b, scaling) if leaf == "weight" else tensor


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A`` in ``W``'s dtype, computed in float32 (float64 for a float64 ``W``) and rounded
    once.

    Args:
        weight: ``(out, in)``.
        lora_a: ``(r, in)``.
        lora_b: ``(out, r)``.
    """
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    delta = (lora_b.to(acc) @ lora_a.to(acc)).mul_(scaling)
    return delta.add_(weight.to(acc)).to(weight.dtype)


def merged_named_tensors(named: Named, spec: LoraSpec) -> Iterator[Tuple[str, torch.Tensor]]:
    """The base model's named weights with every adapter merged in, from a PEFT model's named tensors.

    Args:
        named: ``(name, full tensor)`` in state-dict order, as :func:`rlhf.distributed.engine.iter_full_state`
            yields them for the PEFT model (``base_model.model.<path>.base_layer.weight``, ``...lora_A.default.weight``,
            ``...lora_B.default.weight``, ``<head>.original_module.weight``, ``<head>.modules_to_save.default.weight``;
            the ``base_model.model.`` prefix may be absent, as in the inner HF model's own state dict).
        spec: the spec the model was wrapped with (its ``alpha / r`` scales ``B @ A``).

    Yields:
        ``(name, tensor)`` with exactly the names (and order and shapes) of the un-wrapped HF model's state dict:
        wrapped weights merged (:func:`merge_weight`), a scalar head's trained copy under the head's own name, the
        frozen original dropped, everything else as it came. At most one module's pieces are held at a time.

    Raises:
        ValueError: a module's pieces do not come together, or adapters this merge does not know (embedding LoRA,
            DoRA, LoRA biases, a second adapter).
    """
    pending: Optional[_PendingModule] = None
    finished: set = set()
    for full_name, tensor in named:
        name = _strip_prefix(full_name)
        if _UNSUPPORTED.search(name):
            raise ValueError(f"{full_name}: embedding LoRA, DoRA and LoRA biases are not supported by the merge")
        base, lora = _BASE.match(name), _LORA.match(name)
        module = base["module"] if base else lora["module"] if lora else None
        if pending is not None and module != pending.module:
            finished.add(pending.module)
            yield from pending.merged(spec.scaling, spec.r)
            pending = None
        if module is None:
            saved, original = _SAVED_COPY.match(name), _ORIGINAL.match(name)
            if saved:
                _check_adapter(full_name, saved["adapter"])
                yield f"{saved['module']}.{saved['leaf']}", tensor
            elif not original:
                yield name, tensor
            continue
        if module in finished:
            raise ValueError(
                f"{full_name} arrived after its module's other tensors: merging needs a module's "
                f"base_layer / lora_A / lora_B tensors together"
            )
        pending = pending or _PendingModule(module)
        if base:
            pending.base.append((base["leaf"], tensor))
        else:
            assert lora is not None, "module is set, so _BASE or _LORA matched"
            _check_adapter(full_name, lora["adapter"])
            pending.lora[lora["ab"]] = tensor
    if pending is not None:
        yield from pending.merged(spec.scaling, spec.r)


def adapter_named_tensors(named: Named) -> Iterator[Tuple[str, torch.Tensor]]:
    """Only the adapter's tensors, named as PEFT's ``save_pretrained`` writes them: ``base_model.model.<path>.
    lora_A.weight`` / ``lora_B.weight``, and a scalar head's trained copy as ``base_model.model.score.weight``.

    Args:
        named: a PEFT model's named tensors (see :func:`merged_named_tensors`).
    """
    for full_name, tensor in named:
        name = _strip_prefix(full_name)
        lora, saved = _LORA.match(name), _SAVED_COPY.match(name)
        if lora:
            _check_adapter(full_name, lora["adapter"])
            yield f"{PEFT_PREFIX}{lora['module']}.lora_{lora['ab']}.weight", tensor
        elif saved:
            _check_adapter(full_name, saved["adapter"])
            yield f"{PEFT_PREFIX}{saved['module']}.{saved['leaf']}", tensor
        elif _UNSUPPORTED.search(name):
            raise ValueError(f"{full_name}: embedding LoRA, DoRA and LoRA biases are not supported")


def is_adapter_tensor(name: str) -> bool:
    """Whether a PEFT model's state-dict entry ``name`` is one :func:`adapter_named_tensors` keeps (an adapter's
    ``A`` / ``B``, a scalar head's trained copy): the filter that gathers only those under ZeRO-3."""
    name = _strip_prefix(name)
    return bool(_LORA.match(name) or _SAVED_COPY.match(name))


_LORA_A = re.compile(r"(?:^|\.)(?P<suffix>[^.]+)\.lora_A(?:\.[^.]+)?\.weight$")


def wrapped_module_suffixes(names: Iterable[str]) -> List[str]:
    """The last name part (``q_proj``, ...) of every module an adapter wraps, sorted, from its ``A`` tensors' names:
    a PEFT model's (``...q_proj.lora_A.default.weight``) or as saved (``...q_proj.lora_A.weight``)."""
    return sorted({m["suffix"] for m in map(_LORA_A.search, names) if m})


def adapter_sync_config(spec: LoraSpec, names: Iterable[str]) -> Dict[str, Any]:
    """The PEFT ``adapter_config`` fields a rollout engine needs to serve the adapter of a model whose state-dict
    names are ``names`` (a PEFT model's): plain types only, for an RPC.

    ``target_modules`` lists the wrapped modules' suffixes (``q_proj``, ...), as :func:`save_adapter` writes them."""
    suffixes = wrapped_module_suffixes(names)
    if not suffixes:
        raise ValueError("no LoRA A tensors among the adapter's names: is the model wrapped with apply_lora?")
    return {"r": spec.r, "lora_alpha": spec.alpha, "target_modules": suffixes, "bias": "none", "use_rslora": False}


def _named(model_or_named: Union[torch.nn.Module, Named]) -> Named:
    """A module's state dict (not for a ZeRO-3 partitioned model: gather with ``iter_full_state``), or the
    named tensors as given."""
    if isinstance(model_or_named, torch.nn.Module):
        return ((n, t.detach()) for n, t in getattr(model_or_named, "module", model_or_named).state_dict().items())
    return model_or_named


# ---------------------------------------------------------------------------------------------------- saving
def save_adapter(
    model_or_named: Union[torch.nn.Module, Named],
    spec: LoraSpec,
    directory: str,
    kind: str,
    base_model_name_or_path: Optional[str] = None,
) -> str:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT's ``save_pretrained`` does, loadable
    with ``peft.PeftModel.from_pretrained(base, directory)`` (and by vLLM's LoRA loader for a causal LM).

    Args:
        model_or_named: the PEFT model (not ZeRO-3 partitioned) or its full named tensors.
        spec: the spec it was wrapped with; ``kind``: its model kind.
        base_model_name_or_path: recorded in the config (the base model a loader should use).

    Returns:
        ``directory``.
    """
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in adapter_named_tensors(_named(model_or_named))}
    if not tensors:
        raise ValueError("no LoRA tensors among the named tensors: is the model wrapped with apply_lora?")
    os.makedirs(directory, exist_ok=True)
    config = lora_config(spec, kind, inference_mode=True, base_model_name_or_path=base_model_name_or_path)
    if spec.all_linear:
        # The wrapped modules' suffixes: the same set as the shorthand ("all-linear" leaves only the head out) in
        # the plain form every loader reads. PEFT's own save writes every full path instead.
        config.target_modules = wrapped_module_suffixes(tensors)
    config.save_pretrained(directory)
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return directory


def save_merged(model: torch.nn.Module, spec: LoraSpec, directory: str, named: Optional[Named] = None) -> str:
    """Write the merged full model as an ordinary HF directory (``AutoModelFor*.from_pretrained`` loads it, no PEFT).

    Args:
        model: the PEFT model (its config and architecture name are written).
        spec: the spec it was wrapped with.
        named: its full named tensors (``iter_full_state`` under ZeRO-3); default: its state dict.

    Returns:
        ``directory``.
    """
    hf_model = _hf_model(model)
    state = dict(merged_named_tensors(named if named is not None else _named(model), spec))
    # ignore: torch types nn.Module.__getattr__ as Tensor | Module; this is the HF model's method
    hf_model.save_pretrained(directory, state_dict=state, safe_serialization=True)  # type: ignore[operator]
    return directory


def read_adapter_config(directory: str) -> Dict[str, Any]:
    with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
        return json.load(f)


def trainable_parameter_names(model: torch.nn.Module) -> Sequence[str]:
    """Names of the parameters that train (adapters and a scalar head's copy, once wrapped)."""
    return [n for n, p in getattr(model, "module", model).named_parameters() if p.requires_grad]
