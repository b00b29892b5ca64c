"""The trainers an audit can run, and which one a config is for.

``--trainer sft|rm|dpo|ppo`` says it; without it the config tells, in this order:

1. a ``config.yaml`` a run saved names its config class in its first line;
2. the trainer-specific sections: ``dpo`` (DPO), ``rm`` (reward model), ``rollout`` / ``reward`` / ``algo`` /
   ``critic`` / ``colocate`` (online RL): the one config class that accepts every key;
3. a shipped preset as ``--config`` or in the file's ``defaults:`` (``sft_tiny`` -> sft, ``grpo_tiny`` -> ppo).

A config with none of these (only ``model`` / ``data`` / ``train`` ...) fits SFT, the reward model and DPO alike:
the audit refuses to guess and asks for ``--trainer``.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import yaml

from rlhf.config.loader import available_presets, is_saved_config, load_config
from rlhf.config.schema import ConfigError
from rlhf.trainers.kinds import TrainerKind, kinds

# The trainers an audit runs: their descriptors (config class, train function, the loss column, what tells their
# configs apart), in the order a config is tried against them.
TRAINERS: Dict[str, TrainerKind] = {kind.name: kind for kind in kinds()}
TRAINER_NAMES = tuple(TRAINERS)
_SECTIONS = {name: kind.sections for name, kind in TRAINERS.items() if kind.sections}
_PRESET_PREFIXES = {prefix: name for name, kind in TRAINERS.items() for prefix in kind.preset_prefixes}
_CLASS_NAMES = {kind.config_cls.__name__: name for name, kind in TRAINERS.items()}


def infer_trainer(config_ref: Optional[str], overrides: Sequence[str] = ()) -> str:
    """The trainer ``config_ref`` + ``overrides`` is for (module docstring).

    Raises:
        ConfigError: The config fits no trainer (the error of the closest one: an unknown key, a bad file), or
            several, with no saved-config line or preset to decide; the message asks for ``--trainer``.
    """
    saved = _saved_trainer(config_ref)
    if saved is not None:
        return saved
    fits: List[str] = []
    errors: Dict[str, str] = {}
    for name in TRAINER_NAMES:
        try:
            load_config(TRAINERS[name].config_cls, config_ref, overrides)
        except ConfigError as exc:
            errors[name] = str(exc)
            if str(exc).startswith("unknown config key"):
                continue
        fits.append(name)
    if len(fits) == 1:
        return fits[0]
    if not fits:  # every class refused a key: the error that is not about another trainer's section
        raise ConfigError(next((e for e in errors.values() if not _other_section(e)), errors["sft"]))
    preset = _preset_trainer(config_ref)
    if preset in fits:
        return preset
    if len(errors) == len(TRAINER_NAMES) and len(set(errors.values())) == 1:
        raise ConfigError(errors["sft"])  # the same error whatever the trainer (a missing file, bad YAML)
    raise ConfigError(
        "cannot tell which trainer this config is for: it has no dpo, rm or rollout/reward/algo "
        "section and names no preset; pass --trainer " + "|".join(fits)
    )


def _other_section(message: str) -> bool:
    """An unknown-key error about a section that belongs to another trainer."""
    quoted = message.split("'")[1] if message.count("'") >= 2 else ""
    return quoted.split(".")[0] in {s for sections in _SECTIONS.values() for s in sections}


def _saved_trainer(config_ref: Optional[str]) -> Optional[str]:
    if not config_ref or not os.path.isfile(config_ref) or not is_saved_config(config_ref):
        return None
    with open(config_ref, encoding="utf-8") as f:
        first = f.readline()
    return _CLASS_NAMES.get(first.lstrip("# ").split(",")[0])


def _preset_trainer(config_ref: Optional[str]) -> Optional[str]:
    """The trainer of a shipped preset given as ``--config`` or in the file's own ``defaults:``."""
    if not config_ref:
        return None
    names = [config_ref]
    if os.path.isfile(config_ref):
        try:
            with open(config_ref, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            return None
        refs = data.get("defaults", []) if isinstance(data, dict) else []
        names = [refs] if isinstance(refs, str) else [r for r in refs if isinstance(r, str)]
    presets = set(available_presets())
    for ref in names:
        stem = ref[: -len(".yaml")] if ref.endswith(".yaml") else ref
        if stem in presets:
            return _PRESET_PREFIXES.get(stem.split("_")[0])
    return None
