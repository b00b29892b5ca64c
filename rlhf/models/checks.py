"""Checks on model directories that the driver runs before any actor starts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple, TypeGuard

from rlhf.config.schema import ConfigError


def check_scalar_head(model_dir: str, key: str, ref: str) -> None:
    """A reward model must be a trained scalar-head model (``*ForSequenceClassification`` with one label).

    Loading a plain causal LM as a sequence classifier does not fail: transformers initialises a random score head
    and the run would optimise against noise. ``train_rm`` saves the right kind of directory.

    Raises:
        ConfigError: Naming ``key`` when the directory's config.json declares another architecture or label count.
    """
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot read config.json of {ref!r}: {e}") from None
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        found = ", ".join(architectures) or "none declared"
        raise ConfigError(
            f"{key}: {ref!r} is not a reward model: its config.json declares {found}, not a "
            f"*ForSequenceClassification with a scalar head (a causal LM would get a random score "
            f"head); train one with python -m rlhf.cli.train_rm"
        )
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if labels != 1:
        raise ConfigError(
            f"{key}: {ref!r} has a {labels}-label classification head; a reward model has one (a scalar score)"
        )


# The config keys vLLM derives a model's positions from, in its order (vllm.transformers_utils.
# model_arch_config_convertor, derive_max_model_len_and_key): the smallest present wins.
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length: vLLM applies no factor to them.
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


@dataclass(frozen=True)
class Positions:
    """The longest context an engine of a model may be started with, as vLLM derives it from the model's files
    (``limit``), and where that number comes from (``source``, for a message)."""

    limit: int
    source: str


def model_positions(folder: str) -> Optional[Positions]:
    """The positions a model holds, read as vLLM reads them, so that a context it would refuse at engine start
    (inside a Ray actor, suggesting ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``) is refused by key before Ray starts.

    The smallest length key of ``config.json`` (its ``text_config`` for a multimodal model; ``model_max_length``
    there overrides, as for Cohere), times the RoPE scaling ``factor`` unless the RoPE type already counts it
    (YaRN, Llama 3, LongRoPE) or the model is a Gemma 3. (vLLM reads ``tokenizer_config.json``'s
    ``model_max_length`` for pooling models only; the engines here generate.)

    Returns:
        ``None`` when ``config.json`` cannot be read or names no length: vLLM then assumes a length itself, and
        there is nothing to compare with.
    """
    config = _read_json(os.path.join(folder, "config.json"))
    if config is None:
        return None
    text, prefix = _text_config(config)
    found = [(text[key], key) for key in _LENGTH_KEYS if _is_count(text.get(key))]
    if not found:
        return None
    if _is_count(text.get("model_max_length")):  # vLLM: it overrides the others (Cohere's configs)
        limit, key = text["model_max_length"], "model_max_length"
    else:
        limit, key = min(found, key=lambda f: f[0])  # the first of the smallest, in vLLM's order
    source = f"{prefix}{key} {limit}"
    factor = _rope_factor(text)
    if factor != 1.0 and "gemma3" not in str(text.get("model_type", config.get("model_type", ""))):
        limit = int(limit * factor)
        source += f" x RoPE scaling factor {factor:g}"
    return Positions(limit, f"{source} in its config.json")


def _rope_factor(config: dict) -> float:
    """The RoPE scaling factor vLLM multiplies the positions by: ``rope_parameters`` (transformers 5) or
    ``rope_scaling``, one dict or one per layer type; 1 for the types that count it already."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(rope, dict):
        return 1.0
    layers = (
        [p for p in rope.values() if isinstance(p, dict)] if all(isinstance(p, dict) for p in rope.values()) else [rope]
    )
    factor = 1.0
    for params in layers:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in _PRESCALED_ROPE and isinstance(params.get("factor"), (int, float)):
            factor = float(params["factor"])
    return factor


def model_heads(folder: str) -> Optional[Tuple[int, int]]:
    """``(attention heads, key/value heads)`` of the model in ``folder`` from its ``config.json`` (its
    ``text_config`` for a multimodal model; key/value heads default to the attention heads), or ``None`` when the
    file cannot be read or names no head count."""
    config = _read_json(os.path.join(folder, "config.json"))
    if config is None:
        return None
    text, _ = _text_config(config)
    heads, kv_heads = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if not _is_count(heads):
        return None
    return heads, kv_heads if _is_count(kv_heads) else heads


def _text_config(config: dict) -> Tuple[dict, str]:
    """The language model's part of a ``config.json`` and its key prefix (``text_config.`` for a multimodal one)."""
    if isinstance(config.get("text_config"), dict):
        return config["text_config"], "text_config."
    return config, ""


def _is_count(value) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
