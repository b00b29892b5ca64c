"""What a run checks before its first actor starts: one preflight, run by the runners, ``--dry-run`` and the audit.

Checked, for the trainer's descriptor (:mod:`rlhf.trainers.descriptor`): the model folders of its model keys (a
``config.json``, :func:`rlhf.hub.check_model_folder`), the tokenizer and data paths, ``strategy.deepspeed_config``
against the run's settings, LoRA's target modules against each trained model, and what the trainer's own
``checks`` hook checks (online RL, :func:`rlhf.trainers.online.checks.start_up_checks`: each vLLM engine's context
against its model's positions, the reward functions, the environment class, the judge, a reward model's scalar
head, the critic's batch arithmetic). The config's own validation ran when it was built; the cluster fit is the plan's
(:meth:`rlhf.trainers.descriptor.TrainerKind.plan`, packed by ``--dry-run``, placed by the run).

Two strictnesses, one wording: a run (``here=True``) refuses a path missing on this machine; ``--dry-run``
(``here=False``) lists it as :data:`NOT_HERE` (a model or data set that exists only on the cluster) and checks all
it can read here. Hub references (``org/name@sha``) were resolved and checked by
:func:`rlhf.hub.pin_run_sources` in a run; ``--dry-run`` looks them up without downloading. A refusal is a
:class:`~rlhf.config.schema.ConfigError` naming the key, which the command lines exit with status 2 on.

``--dry-run`` also reads the data rows this machine has, each checked against the trainer's layouts (its
descriptor's ``row_fields``); the run reads them itself right after, with its tokenizer, as it reads its reward
functions, each refusing bad input with its file and row (:mod:`rlhf.trainers.offline.loop`,
:mod:`rlhf.trainers.online.runner`).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

from rlhf.config.deepspeed_check import check_user_config
from rlhf.config.schema import ConfigError, RunConfig
from rlhf.data.formats import located
from rlhf.data.io import read_rows
from rlhf.hub import (
    DATASET,
    MODEL,
    HubError,
    cache_dir,
    check_model_folder,
    config_value,
    is_hub_ref,
    locate,
    model_dir,
    offline,
)
from rlhf.models.checks import model_heads
from rlhf.models.sequence_parallel import check_heads
from rlhf.trainers.descriptor import Row, TrainerKind
from rlhf.trainers.output_dir import output_dir_status

NOT_HERE = "not on this machine (checked at run time)"


def preflight(cfg: RunConfig, kind: TrainerKind, here: bool = True, precision: Optional[str] = None) -> List[Row]:
    """Every check of the module docstring; ``(key, path, status)`` of each path the run reads.

    Args:
        cfg: A run config of any trainer.
        kind: Its trainer's descriptor, whose ``checks`` hook makes the checks only that trainer makes.
        here: A run on this machine (a missing path is refused); ``False`` for ``--dry-run``.
        precision: The resolved precision (``strategy.precision=auto`` depends on the cluster), for the DeepSpeed
            config's precision fields; ``None`` checks the others (a run checks these once Ray is up).

    Raises:
        ConfigError: Naming the key of the first setting a run would refuse.
    """
    models = [(key, path) for key, path in _values(cfg, kind.model_keys) if path]
    rows = [(key, path, model_status(key, path, here)) for key, path in models]
    _check_sequence_parallel(cfg, models, here)
    own = kind.checks(cfg, here)  # before the data is read: a refusal costs nothing here (online RL: its engines)
    rows += [
        (key, path, _path_status(key, path, repo_type, here))
        for key, path, repo_type in (
            ("model.tokenizer_path", cfg.model.tokenizer_path, MODEL),
            ("data.train_path", cfg.data.train_path, DATASET),
            ("data.eval_path", cfg.data.eval_path, DATASET),
        )
        if path
    ]
    # a run reads its data right after, with its tokenizer (rlhf.trainers.offline.loop, rlhf.trainers.online.prompts)
    if not here:
        rows = _with_data_read(cfg, kind, rows)
    rows += _deepspeed_rows(cfg, here, precision)
    rows += own
    _check_lora(cfg, kind, here)
    rows.append(
        (
            "train.output_dir",
            cfg.train.output_dir or '""',
            output_dir_status(cfg, kind.run_name)
            + ("" if not cfg.train.output_dir else ", on storage every node writes"),
        )
    )
    return rows


# ------------------------------------------------------------------------------------------ engine contexts


def _values(cfg: RunConfig, keys: Sequence[str]) -> List[Tuple[str, str]]:
    return [(key, config_value(cfg, key)) for key in keys]


# ------------------------------------------------------------------------------------------------------ paths


def model_status(key: str, path: str, here: bool) -> str:
    if is_hub_ref(path, MODEL):
        return "hub model, resolved by the run" if here else hub_status(key, path, MODEL)
    if not os.path.exists(path) and not here:
        return NOT_HERE
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is not a directory")
    check_model_folder(key, path, path)
    return "found"


def _path_status(key: str, path: str, repo_type: str, here: bool) -> str:
    """A tokenizer directory or a data file / directory / hub id."""
    if is_hub_ref(path, repo_type):
        return f"hub {repo_type}, resolved by the run" if here else hub_status(key, path, repo_type)
    if not os.path.exists(path):
        if here:
            raise ConfigError(f"{key}: {path!r} " + ("is not a directory" if repo_type == MODEL else "does not exist"))
        return NOT_HERE
    if repo_type == MODEL and not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is not a directory")
    return "found"


def _with_data_read(cfg: RunConfig, kind: TrainerKind, rows: List[Row]) -> List[Row]:
    """``--dry-run``: the data this machine has, read as the run reads it. With the model's tokenizer here too, the
    data is tokenized by the trainer's own reader (the tokenizer's checks, the chat template, every row's layout
    and length, ``reward.columns``: :meth:`~rlhf.trainers.descriptor.TrainerKind.read_data`); else every row's layout
    is checked without it. A bad row is refused with its file and line. Each file is read once either way."""
    data = [status for key, _, status in rows if key in ("data.train_path", "data.eval_path")]
    if not data or not all(_here(status) for status in data) or not _tokenizer_here(cfg):
        # the reader reads both sets: with one that only the cluster has, the rows here are checked without it
        return [_with_rows_read(cfg, kind, row) for row in rows]
    from rlhf.data.vocab import load_tokenizer  # lazy: transformers, only when there is data to tokenize

    summary = kind.read_data(cfg, load_tokenizer(cfg))
    return [
        (key, path, f"{status}; " + (summary if key == "data.train_path" else "read with data.train_path"))
        if key in ("data.train_path", "data.eval_path")
        else (key, path, status)
        for key, path, status in rows
    ]


def _here(status: str) -> bool:
    """Whether a data path's preflight status says this machine has it."""
    return status == "found" or "cached here" in status


def _tokenizer_here(cfg: RunConfig) -> bool:
    m = cfg.model
    return readable(m.path, here=False) and (not m.tokenizer_path or readable(m.tokenizer_path, here=False))


def _with_rows_read(cfg: RunConfig, kind: TrainerKind, row: Row) -> Row:
    """``--dry-run``: a data file this machine has is read as the run reads it, every row checked against the
    trainer's layouts (its fields, ``reward.columns``); a bad row is refused with its file and line."""
    key, path, status = row
    if key not in ("data.train_path", "data.eval_path") or not _here(status):
        return row
    d = cfg.data
    split = d.split if key == "data.train_path" else (d.eval_split or d.split)
    with located(key, path):
        count = len(read_rows(path, split=split, config_name=d.config_name, **kind.row_fields(cfg)))
    return key, path, f"{status}; {count} rows read, each in a layout the trainer reads"


def hub_status(key: str, ref: str, repo_type: str) -> str:
    """Where a hub reference stands, downloading nothing: the commit it resolves to (from the cache offline, else
    from the hub) and whether this machine's cache holds it. One the hub says does not exist is refused."""
    try:
        sha, snapshot = locate(ref, repo_type)
    except HubError as exc:
        if exc.not_found:
            raise ConfigError(f"{key}: {ref!r} is not a local path, and {exc}") from None
        if offline():
            return (
                f"hub {repo_type}, not in the HF cache here ({cache_dir()}; HF_HUB_OFFLINE=1): a run resolves it "
                f"at start, through the cache of the machine it starts on"
            )
        return f"hub {repo_type}, the hub is not reachable from here: resolved when a run starts"
    if snapshot and repo_type == MODEL and key != "model.tokenizer_path":
        check_model_folder(key, ref, snapshot)
    where = "cached here" if snapshot else "downloaded when a run starts"
    return f"hub {repo_type} at commit {sha[:12]}, {where} (a run pins it in config.yaml)"


def _deepspeed_rows(cfg: RunConfig, here: bool, precision: Optional[str]) -> List[Row]:
    """``strategy.deepspeed_config`` against the run's settings (a run reads it once more when ``auto`` precision is
    resolved, rlhf.trainers.context.start_cluster)."""
    ds = cfg.strategy.deepspeed_config
    if here or (ds and os.path.isfile(ds)):
        check_user_config(cfg, precision)
    if not ds:
        return []
    return [("strategy.deepspeed_config", ds, "found, consistent with the run" if os.path.isfile(ds) else NOT_HERE)]


def readable(ref: str, here: bool) -> bool:
    """Whether a model's files can be read on this machine (a run's always can: its preflight checked them)."""
    if here:
        return True
    if not is_hub_ref(ref, MODEL):
        return os.path.isdir(ref)
    try:
        model_dir(ref)  # from this machine's cache, downloading nothing offline
    except (OSError, HubError):
        return False
    return True


# ------------------------------------------------------------------------------------------- code and models


def _check_sequence_parallel(cfg: RunConfig, models: Sequence[Tuple[str, str]], here: bool) -> None:
    """``strategy.sequence_parallel_size`` against the attention heads of each model the trainer roles load (those
    whose ``config.json`` can be read here), :func:`rlhf.models.sequence_parallel.check_heads`."""
    size = cfg.strategy.sequence_parallel_size
    if size == 1:
        return
    for key, path in models:
        heads = model_heads(model_dir(path)) if readable(path, here) else None
        why = check_heads(heads[0], heads[1], size) if heads else None
        if why:
            raise ConfigError(f"strategy.sequence_parallel_size={size}: {why} ({key}={path!r})")


def _check_lora(cfg: RunConfig, kind: TrainerKind, here: bool) -> None:
    """``model.lora.target_modules`` against the layers of each model LoRA wraps (under ``--dry-run``, those whose
    config can be read here; the paths table says why not otherwise), and an adapter sync only where there are
    engines to sync."""
    if not cfg.model.lora.enabled:
        return
    if cfg.model.lora.adapter_only and not kind.online:
        raise ConfigError(
            f"model.lora.sync is adapter, but {kind.cli_module} has no rollout engines to sync weights into "
            f"(online RL only); leave it at merged"
        )
    from rlhf.trainers.context import check_lora_targets  # lazy: torch and transformers, only when LoRA is asked for

    trained = kind.trained_models(cfg)
    check_lora_targets(cfg, [(path, kind) for path, kind in trained if readable(path, here)])
