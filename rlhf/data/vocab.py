"""Checking a tokenizer before a run relies on it.

``AutoTokenizer.from_pretrained`` on a model directory without tokenizer files does not fail: it can build an
empty tokenizer that encodes every row to nothing, and the run then dies much later with a zero normalizer. These
checks run on the driver before any actor starts and name the config key to fix.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from rlhf.config.schema import ConfigError, RunConfig
from rlhf.data.chat import load_template
from rlhf.hub import model_dir
from rlhf.utils.log import get_logger

log = get_logger(__name__)

#: A real vocabulary has thousands of tokens; fewer than this means the tokenizer files are missing or broken.
MIN_VOCAB = 32


def check_tokenizer(tokenizer, key: str, ref: str, model_vocab_size: Optional[int] = None):
    """Refuse a tokenizer that cannot serve training; give it a pad token (EOS) when it has none, saying so.

    Args:
        tokenizer: The loaded HF tokenizer.
        key: The config key it came from (``model.tokenizer_path`` or ``model.path``).
        ref: That key's value, for messages.
        model_vocab_size: The model's embedding rows (config.json ``vocab_size``), when known: every token id
            must have one.

    Returns:
        The tokenizer.

    Raises:
        ConfigError: Too few tokens (tokenizer files missing), no EOS, or ids beyond the model's embeddings.
    """
    size = len(tokenizer)
    if size < MIN_VOCAB:
        raise ConfigError(
            f"{key}: the tokenizer loaded from {ref!r} has {size} token(s): the directory has no usable "
            f"tokenizer files (tokenizer.json, or vocab + merges); add them or set "
            f"model.tokenizer_path to a directory or hub id that has them"
        )
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"{key}: the tokenizer loaded from {ref!r} has no eos_token: completions are ended and "
            f"generation is stopped with it; set eos_token in its tokenizer_config.json"
        )
    if model_vocab_size is not None and size > model_vocab_size:
        raise ConfigError(
            f"{key}: the tokenizer from {ref!r} has {size} tokens but the model has {model_vocab_size} "
            f"embedding rows (config.json vocab_size): ids past them would crash; use the model's own "
            f"tokenizer (model.tokenizer_path)"
        )
    if tokenizer.pad_token_id is None:
        # Attention masks, not the pad id, decide what is padding everywhere in this project, so EOS is safe.
        tokenizer.pad_token = tokenizer.eos_token
        log.info(
            f"[data] the tokenizer has no pad token; padding with its EOS {tokenizer.eos_token!r} "
            f"(attention masks mark the padding)"
        )
    return tokenizer


def config_vocab_size(model_dir: str) -> Optional[int]:
    """``vocab_size`` from a model directory's config.json (top level or ``text_config``), or None."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def load_tokenizer(cfg: RunConfig):
    """The run's tokenizer (``model.tokenizer_path``, else ``model.path``), checked before anything starts.

    A ``data.chat_template`` file becomes the tokenizer's own template, so ``final/`` carries it: the next stage
    (DPO or RL from this run's model, vLLM) renders the same turns without being told the file again."""
    from transformers import AutoTokenizer

    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    ref = cfg.model.tokenizer_path or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(model_dir(ref))
    template = load_template(cfg.data.chat_template)  # None for auto (the tokenizer's own) and none
    if template is not None:
        tokenizer.chat_template = template
    return check_tokenizer(tokenizer, key, ref, config_vocab_size(model_dir(cfg.model.path)))


def check_same_tokenizer(policy_ref: str, teacher_ref: str, key: str) -> int:
    """Refuse a model whose tokenizer reads token ids otherwise than the policy's: on-policy distillation scores the
    policy's token ids with it, so both must map every id to the same token. Compares the whole vocabularies (added
    tokens included), not config.json ``vocab_size``: models of one family share a tokenizer with different
    embedding rows.

    Args:
        policy_ref: the policy's tokenizer (``model.tokenizer_path`` or ``model.path``): a directory or hub id.
        teacher_ref: the other model (``key``'s value).
        key: the config key of the other model, for messages.

    Returns:
        The shared vocabulary's size.

    Raises:
        ConfigError: The vocabularies differ (the message names the first id read differently), or ids of the
            tokenizer lie past the other model's embedding rows.
    """
    from transformers import AutoTokenizer  # lazy: transformers is heavy

    ours = AutoTokenizer.from_pretrained(model_dir(policy_ref)).get_vocab()
    theirs = AutoTokenizer.from_pretrained(model_dir(teacher_ref)).get_vocab()
    if ours != theirs:
        by_id, other_by_id = ({i: t for t, i in v.items()} for v in (ours, theirs))
        first = min(i for i in set(by_id) | set(other_by_id) if by_id.get(i) != other_by_id.get(i))
        raise ConfigError(
            f"{key}: the tokenizer of {teacher_ref!r} reads id {first} as {other_by_id.get(first)!r}, the policy's "
            f"({policy_ref!r}) as {by_id.get(first)!r} ({len(theirs)} vs {len(ours)} tokens); distillation scores "
            f"the policy's token ids with this model, so both must read every id alike"
        )
    rows = config_vocab_size(model_dir(teacher_ref))
    if rows is not None and len(ours) > rows:
        raise ConfigError(f"{key}: {teacher_ref!r} has {rows} embedding rows for the tokenizer's {len(ours)} ids")
    return len(ours)
