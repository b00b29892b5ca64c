"""Checks on model directories that the driver runs before any actor starts."""

from __future__ import annotations

import json
import os

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
