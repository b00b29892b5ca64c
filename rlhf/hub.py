"""Model and dataset references: a local path, or a Hugging Face Hub id resolved through the HF cache.

A reference is an existing local path (it always wins) or a hub repository id ``org/name`` or ``name``, optionally
with ``@revision`` (a branch, tag or commit sha): ``Qwen/Qwen2.5-0.5B-Instruct@main``.

The runners call :func:`pin_run_sources` before anything else: each hub reference of the run config is resolved
through the HF cache (downloaded when online; under ``HF_HUB_OFFLINE=1`` read from the cache, and an uncached one
is refused, naming the id and the cache) and rewritten to the commit it resolved to, ``org/name@<sha>``. That
config is what ``config.yaml`` records and what the actors receive, so every worker of every node loads the same
snapshot: :func:`model_dir` turns a pinned reference into the snapshot directory on the node it runs on (from that
node's cache, downloading the pinned commit there when online). A dataset id is read by
:func:`rlhf.data.io.read_rows`, from :func:`dataset_dir`.

The cache directory and the offline switch are read from the environment at each call (``HF_HUB_CACHE``,
``HF_HOME``, ``HF_HUB_OFFLINE``) rather than from ``huggingface_hub.constants``, which freezes them when first
imported: a driver may set them later, and :func:`hub_env` forwards them to the actors.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from rlhf.config.schema import ConfigError, RunConfig, RunConfigT
from rlhf.utils.log import get_logger

log = get_logger(__name__)

MODEL = "model"
DATASET = "dataset"

# Config keys naming hub repositories. A trainer may load more models (online RL: critic.path, reward.model_path):
# its descriptor lists them (rlhf.trainers.kinds, model_keys) and passes them to pin_run_sources.
RUN_MODEL_KEYS = ("model.path", "model.ref_path")  # the model keys of every trainer's config
TOKENIZER_KEYS = ("model.tokenizer_path",)
DATA_KEYS = ("data.train_path", "data.eval_path")

_NAME = r"[A-Za-z0-9_][\w.-]*"
_HUB_REF = re.compile(rf"^(?:{_NAME}/)?{_NAME}(?:@[^\s@]+)?$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
DEFAULT_REVISION = "main"

# A missing `train.jsonl` is a missing file, not a dataset repository of that name.
_DATA_FILE_EXTS = (".json", ".jsonl", ".parquet", ".csv", ".tsv", ".arrow", ".txt", ".gz", ".zst", ".zip")
# Files of a model repository that transformers and vLLM never read here (other frameworks' weights, exports,
# the original non-HF checkpoints): not downloaded.
_NOT_LOADED = (
    "*.onnx",
    "*.onnx_data",
    "onnx/*",
    "*.gguf",
    "*.h5",
    "*.msgpack",
    "*.tflite",
    "*.ot",
    "*.mlmodel",
    "coreml/*",
    "openvino/*",
    "original/*",
)
# PyTorch pickles duplicate the safetensors weights when a repository has both; transformers loads safetensors.
_PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")
_CARD_FILES = ("README.md",)
# Any one of these makes a directory a tokenizer (fast tokenizer, its config, or a slow tokenizer's vocabulary).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


class HubError(ValueError):
    """A hub reference that cannot be resolved here; the message names the id, the cache and the offline state.

    ``not_found`` is True when the hub itself answered that the repository, revision or configuration does not
    exist (the reference is wrong everywhere), False when it is only absent from this machine's cache or the hub
    could not be reached. ``of_repository`` is False when the repository resolved but the configuration asked of
    it does not exist (the reference was meant as a hub id, not a mistyped local path).
    """

    def __init__(self, message: str, not_found: bool = False, of_repository: bool = True) -> None:
        super().__init__(message)
        self.not_found = not_found
        self.of_repository = of_repository


# ---------------------------------------------------------------------------------------------- references


def parse_ref(ref: str) -> Tuple[str, str]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; the revision defaults to ``main``."""
    repo_id, _, revision = ref.partition("@")
    return repo_id, revision or DEFAULT_REVISION


def is_hub_ref(ref: str, repo_type: str = MODEL) -> bool:
    """Whether ``ref`` names a hub repository: it is no existing local path and has the form ``[org/]name[@rev]``
    (for datasets, a name ending like a data file, ``train.jsonl``, is taken for a missing file)."""
    if not ref or os.path.exists(ref) or not _HUB_REF.match(ref):
        return False
    repo_id = parse_ref(ref)[0]
    return not (repo_type == DATASET and repo_id.lower().endswith(_DATA_FILE_EXTS))


def is_pinned(ref: str) -> bool:
    """A hub reference whose revision is a full commit sha (what :func:`pin_run_sources` writes)."""
    return bool(_SHA.match(parse_ref(ref)[1]))


def cache_dir() -> str:
    """The hub cache huggingface_hub uses: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else its default."""
    env = os.environ
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not path and env.get("HF_HOME"):
        path = os.path.join(env["HF_HOME"], "hub")
    if not path:
        from huggingface_hub import constants

        path = constants.HF_HUB_CACHE
    return os.path.abspath(os.path.expanduser(os.path.expandvars(path)))


def offline() -> bool:
    """``HF_HUB_OFFLINE`` now, or when huggingface_hub was imported (it then refuses every request anyway)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE") or bool(
        constants.HF_HUB_OFFLINE
    )


#: What a worker needs to resolve references as the driver does: the same cache location, the same offline switch
#: and endpoint. (Credentials are not forwarded: Ray records actor environments; log in on each node instead.)
HUB_ENV_KEYS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT")


def hub_env() -> Dict[str, str]:
    """The hub settings of this process that actors must share (only those set here; a node keeps its own
    defaults for the rest)."""
    return {key: os.environ[key] for key in HUB_ENV_KEYS if os.environ.get(key)}


# -------------------------------------------------------------------------------------------- the run config


def pin_run_sources(cfg: RunConfigT, model_keys: Sequence[str] = RUN_MODEL_KEYS) -> RunConfigT:
    """Resolve every hub reference of a run config and pin it to the commit it resolved to.

    Keys: ``model_keys`` (model repositories: the trainer's, e.g. online RL adds ``critic.path`` and
    ``reward.model_path``), ``model.tokenizer_path`` and ``data.train_path``, ``data.eval_path`` (dataset
    repositories, read with ``data.config_name``). Local paths are left as they are (the runners' path checks judge
    them). A resumed run (``train.resume``) keeps the commits its ``config.yaml`` pinned for references given
    without a revision, so its reference model and data do not move to a newer commit between invocations.

    Returns:
        ``cfg`` with each hub reference rewritten to ``org/name@<sha>`` (``cfg`` itself when there is none).

    Raises:
        ConfigError: Naming the key, the id, the offline state and the cache directory, when a reference is
            neither a local path nor resolvable, or resolves to a repository without a model's ``config.json``
            (a tokenizer's files for ``model.tokenizer_path``).
    """
    recorded = _pins_of_resumed_run(cfg, model_keys)
    config_name = cfg.data.config_name
    snapshots: Dict[Tuple[str, str], str] = {}  # (repo type, reference) -> snapshot, when two keys share one
    changes: Dict[str, str] = {}  # key -> pinned reference
    for keys, repo_type in ((tuple(model_keys) + TOKENIZER_KEYS, MODEL), (DATA_KEYS, DATASET)):
        for key in keys:
            ref = config_value(cfg, key)
            if not is_hub_ref(ref, repo_type):
                continue
            ref = _keep_recorded_pin(key, ref, recorded.get(key, ""))
            if (repo_type, ref) not in snapshots:
                try:
                    snapshots[(repo_type, ref)] = _snapshot(ref, repo_type, config_name if repo_type == DATASET else "")
                except HubError as e:
                    kind = "file or directory" if repo_type == DATASET else "directory"
                    local = f"{ref!r} is not a local {kind}, and " if e.of_repository else ""
                    raise ConfigError(f"{key}: {local}{e}") from None
            snapshot = snapshots[(repo_type, ref)]
            _check_snapshot(key, ref, snapshot)
            pinned = f"{parse_ref(ref)[0]}@{os.path.basename(snapshot)}"
            log.info(f"[hub] {key}: {ref} -> {pinned} ({snapshot})")
            changes[key] = pinned
    for key, pinned in changes.items():
        cfg = with_value(cfg, key, pinned)
    return cfg


def config_value(cfg: Any, key: str) -> Any:
    """The setting a dotted key names (``model.path``, ``algo.teacher.path``)."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def with_value(cfg: Any, key: str, value: Any) -> Any:
    """A copy of the frozen config ``cfg`` with the dotted ``key`` set to ``value`` (nested sections replaced)."""
    head, _, rest = key.partition(".")
    inner = with_value(getattr(cfg, head), rest, value) if rest else value
    return dataclasses.replace(cfg, **{head: inner})


def _check_snapshot(key: str, ref: str, snapshot: str) -> None:
    if key in TOKENIZER_KEYS:
        if not any(os.path.isfile(os.path.join(snapshot, f)) for f in _TOKENIZER_FILES):
            raise ConfigError(
                f"{key}: hub repository {ref!r} (snapshot {snapshot}) has no tokenizer files "
                f"({', '.join(_TOKENIZER_FILES)})"
            )
    elif key not in DATA_KEYS:
        check_model_folder(key, ref, snapshot)


# What transformers loads a model's weights from (single file, sharded with an index, safetensors or pickled).
WEIGHT_FILE_ENDINGS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def check_model_folder(key: str, ref: str, folder: str) -> None:
    """Refuse a model directory without ``config.json`` or without weights, naming ``key``: ``folder`` is ``ref``
    itself (a local path) or the snapshot the hub reference ``ref`` resolved to. The one "is this a model" check of
    the hub's pinning, the runs' preflight and ``--dry-run``."""
    where = repr(ref) if folder == ref else f"hub repository {ref!r} (snapshot {folder})"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        what = "an HF model directory" if folder == ref else "an HF model"
        raise ConfigError(f"{key}: {where} is not {what} (no config.json)")
    if not any(name.endswith(WEIGHT_FILE_ENDINGS) for name in os.listdir(folder)):
        raise ConfigError(
            f"{key}: {where} has a config.json but no weights (*.safetensors, pytorch_model*.bin or their sharded "
            f"index): an unfinished download or copy?"
        )


def _pins_of_resumed_run(cfg: RunConfig, model_keys: Sequence[str]) -> Dict[str, str]:
    """``{key: pinned reference}`` from the ``config.yaml`` of the run ``train.resume`` continues, if any."""
    train = cfg.train
    if not train.resume or not train.output_dir:
        return {}
    path = os.path.join(train.output_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return {}  # the runner's own reading of the output directory reports a broken one
    out = {}
    for key in tuple(model_keys) + TOKENIZER_KEYS + DATA_KEYS:
        value: Any = tree
        for name in key.split("."):
            value = value.get(name) if isinstance(value, dict) else None
        if isinstance(value, str) and is_hub_ref(value) and is_pinned(value):
            out[key] = value
    return out


def _keep_recorded_pin(key: str, ref: str, recorded: str) -> str:
    """The resumed run's pin when ``ref`` is the same repository given without a revision, else ``ref``."""
    if "@" in ref or not recorded or parse_ref(recorded)[0] != ref:
        return ref
    log.info(f"[hub] {key}: {ref} stays at {recorded}, the commit the resumed run was pinned to")
    return recorded


# ------------------------------------------------------------------------------------------ local directories


def model_dir(ref: str) -> str:
    """The local directory of a model reference: a local path as it is, a hub id's snapshot in this node's cache.

    A pinned reference (``org/name@<sha>``) found in the cache is used without asking the hub; one that is not
    is downloaded when online. Whatever loads weights or tokenizers calls this on the node it runs on.

    Raises:
        HubError: A hub reference this node can neither find in its cache nor download.
    """
    return _snapshot(ref, MODEL) if is_hub_ref(ref, MODEL) else ref


def cached_model_dir(ref: str) -> Optional[str]:
    """The local directory of a model reference if this machine already has it (a local directory, or the hub
    cache's snapshot of the revision), asking the hub nothing: for checks that read a model's files where they can
    and leave the rest to the run."""
    if os.path.isdir(ref):
        return ref
    if not is_hub_ref(ref, MODEL):
        return None
    return _cached(*parse_ref(ref), MODEL)


def dataset_dir(ref: str, config_name: str = "") -> str:
    """The snapshot directory of a hub dataset reference, with the data files of ``config_name`` (its default
    configuration when empty) present: downloaded when online (only that configuration's files when the dataset
    card declares them), from the cache offline.

    Raises:
        HubError: Not resolvable here (id, revision, cache directory and offline state in the message), or the
            card declares no such configuration.
    """
    return _snapshot(ref, DATASET, config_name)


def locate(ref: str, repo_type: str = MODEL) -> Tuple[str, Optional[str]]:
    """``(commit sha, snapshot directory or None)`` of a hub reference, downloading nothing: from the cache
    offline (or for a pinned commit that is cached), else by asking the hub which commit the revision is.

    Raises:
        HubError: Offline and not cached, the hub unreachable and not cached, or no such repository / revision.
    """
    repo_id, revision = parse_ref(ref)
    found = _cached(repo_id, revision, repo_type)
    if found and (is_pinned(ref) or offline()):
        return os.path.basename(found), found
    if offline():
        raise HubError(_uncached(repo_id, revision, repo_type))
    from huggingface_hub import HfApi

    try:
        sha = _ask_hub(
            repo_id, revision, repo_type, lambda: HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision).sha
        )
    except HubError as e:
        if found and not e.not_found:  # unreachable, but cached: what a run here would use
            return os.path.basename(found), found
        raise
    return sha, _cached(repo_id, sha, repo_type)


def _snapshot(ref: str, repo_type: str, config_name: str = "") -> str:
    """The snapshot directory of a hub reference: from the cache offline; online through ``snapshot_download``,
    which completes a partial snapshot and, for a commit whose files are all cached, asks the hub nothing."""
    repo_id, revision = parse_ref(ref)
    if offline():
        found = _cached(repo_id, revision, repo_type)
        if found is None:
            raise HubError(_uncached(repo_id, revision, repo_type))
        if repo_type == DATASET:  # the configuration must exist (the card says which do)
            _config_patterns(found, config_name, f"{repo_id}@{os.path.basename(found)}")
        return found
    if repo_type == DATASET:
        return _fetch_dataset(repo_id, revision, config_name)
    return _fetch_model(repo_id, revision)


def _storage(repo_id: str, repo_type: str) -> str:
    from huggingface_hub.file_download import repo_folder_name

    return os.path.join(cache_dir(), repo_folder_name(repo_id=repo_id, repo_type=repo_type))


def _cached(repo_id: str, revision: str, repo_type: str) -> Optional[str]:
    """The cache's snapshot directory of ``revision`` (a commit, or a branch / tag through ``refs/``), or None."""
    storage = _storage(repo_id, repo_type)
    sha = revision if _SHA.match(revision) else _read_text(os.path.join(storage, "refs", revision))
    path = os.path.join(storage, "snapshots", sha) if sha else ""
    return path if sha and os.path.isdir(path) else None


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _uncached(repo_id: str, revision: str, repo_type: str) -> str:
    storage = _storage(repo_id, repo_type)
    refs = os.path.join(storage, "refs")
    have = sorted(os.listdir(refs)) if os.path.isdir(refs) else []
    snapshots = os.path.join(storage, "snapshots")
    commits = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    held = ""
    if have or commits:
        held = (
            f" (it holds other revisions of it: {', '.join(have) or 'no branch'}; "
            f"commits {', '.join(c[:12] for c in commits) or 'none'})"
        )
    flag = " --repo-type dataset" if repo_type == DATASET else ""
    return (
        f"hub {repo_type} {repo_id} (revision {revision}) is not in the Hugging Face cache {cache_dir()} on "
        f"{socket.gethostname()}{held}, and HF_HUB_OFFLINE=1 forbids downloading it: download it where the hub "
        f"is reachable (hf download {repo_id}{flag} --revision {revision}) into that cache, or point "
        f"HF_HUB_CACHE / HF_HOME at a cache that holds it"
    )


def _ask_hub(repo_id: str, revision: str, repo_type: str, call: Callable):
    """``call()`` with huggingface_hub's errors turned into :class:`HubError` naming the reference and the cache."""
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    what = f"hub {repo_type} {repo_id} (revision {revision})"
    try:
        return call()
    except HFValidationError as e:
        raise HubError(f"{repo_id!r} is not a valid hub {repo_type} id: {e}", not_found=True) from None
    except GatedRepoError:
        raise HubError(
            f"{what} is gated: accept its terms on huggingface.co, then log in on every node "
            f"(hf auth login, or HF_TOKEN)",
            not_found=True,
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{what}: no such repository on the hub {_endpoint()} (a private one needs a login: "
            f"hf auth login, or HF_TOKEN)",
            not_found=True,
        ) from None
    except RevisionNotFoundError:
        raise HubError(f"{what}: the repository has no revision {revision!r}", not_found=True) from None
    except (OSError, ConnectionError) as e:  # unreachable hub and nothing cached; HfHubHTTPError is an OSError too
        raise HubError(
            f"{what} is not in the Hugging Face cache {cache_dir()} on {socket.gethostname()} and the "
            f"hub {_endpoint()} could not provide it ({type(e).__name__}: {_first_line(e)})"
        ) from None


def _endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _download(
    repo_id: str, revision: str, repo_type: str, allow: Optional[List[str]] = None, ignore: Optional[List[str]] = None
) -> str:
    from huggingface_hub import snapshot_download

    return _ask_hub(
        repo_id,
        revision,
        repo_type,
        lambda: snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision,
            cache_dir=cache_dir(),
            allow_patterns=allow,
            ignore_patterns=ignore,
        ),
    )


def _fetch_model(repo_id: str, revision: str) -> str:
    """Download the files of a model repository that loading reads (resumes a partial download).

    Which weights those are depends on the repository's files: a cached commit's own snapshot says (every node
    then selects the same files without asking the hub), else the hub's listing of the revision.
    """
    from huggingface_hub import HfApi

    found = _cached(repo_id, revision, MODEL) if _SHA.match(revision) else None
    if found:
        files = [f for _, _, names in os.walk(found) for f in names]
    else:
        try:
            files = HfApi().list_repo_files(repo_id, revision=revision)
        except Exception:  # noqa: BLE001 - the download below reports what is wrong (or falls back to the cache)
            files = []
    ignore = list(_NOT_LOADED) + (list(_PICKLED_WEIGHTS) if any(f.endswith(".safetensors") for f in files) else [])
    return _download(repo_id, revision, MODEL, ignore=ignore)


def _fetch_dataset(repo_id: str, revision: str, config_name: str) -> str:
    """Download a dataset's card first, then only the files of the configuration read (all of them when the card
    declares no configurations: then the repository's layout decides which files are data)."""
    card = _download(repo_id, revision, DATASET, allow=list(_CARD_FILES))  # also writes refs/<revision>
    sha = os.path.basename(card)
    patterns = _config_patterns(card, config_name, f"{repo_id}@{sha}")
    return _download(repo_id, sha, DATASET, allow=None if patterns is None else [*_CARD_FILES, *patterns])


def _config_patterns(snapshot: str, config_name: str, what: str) -> Optional[List[str]]:
    """Repository-relative patterns of the data files of ``config_name`` (the default one when empty), as the
    dataset card's ``configs:`` declares them; None when it declares none for it.

    Raises:
        HubError: The card declares configurations but not ``config_name``, or several and no default.
    """
    from huggingface_hub import metadata_load

    readme = os.path.join(snapshot, "README.md")
    try:
        meta = metadata_load(readme) if os.path.isfile(readme) else None
    except Exception:  # noqa: BLE001 - a card datasets cannot parse either; the reader reports the data files
        meta = None
    configs = [c for c in ((meta or {}).get("configs") or []) if isinstance(c, dict)]
    if not configs:
        return None
    names = [str(c.get("config_name", "default")) for c in configs]
    if config_name:
        if config_name not in names:
            raise HubError(
                f"hub dataset {what}: no config {config_name!r} (available configs: {', '.join(names)})",
                not_found=True,
                of_repository=False,
            )
        chosen = configs[names.index(config_name)]
    else:
        defaults = (
            [c for c in configs if c.get("default")]
            or [c for c, n in zip(configs, names) if n == "default"]
            or (configs if len(configs) == 1 else [])
        )
        if not defaults:
            raise HubError(
                f"hub dataset {what} has several configs and none is the default: choose one with "
                f"data.config_name (available configs: {', '.join(names)})",
                not_found=True,
                of_repository=False,
            )
        chosen = defaults[0]
    return _data_file_patterns(chosen)


def _data_file_patterns(config: dict) -> Optional[List[str]]:
    data_files = config.get("data_files")
    if data_files is None:
        data_dir = config.get("data_dir")
        return [f"{str(data_dir).strip('/')}/*"] if data_dir else None
    items = data_files if isinstance(data_files, list) else [data_files]
    patterns: List[str] = []
    for item in items:
        paths = item.get("path", []) if isinstance(item, dict) else item
        patterns += [str(p) for p in (paths if isinstance(paths, list) else [paths])]
    return patterns or None
