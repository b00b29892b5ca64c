"""Hub ids for models and datasets, offline, from a hub-layout HF cache the tests build (``models--org--name/``:
``refs/main``, ``snapshots/<sha>/`` files linked to ``blobs/``, as huggingface_hub writes it).

A cached id resolves and is pinned to its commit; an uncached one is refused before anything starts, naming the id
and the cache; a hub dataset's bad row names its file and line; an unknown split or config lists the real ones; a
tiny SFT run from a hub model and a hub dataset, through the CLI with Ray and DeepSpeed, records the pins.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from shared_helpers import uneven_pair_rows, uneven_sft_rows

from rlhf.config.loader import load_config, save_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError, SFTRunConfig
from rlhf.data.io import DataError, read_rows
from rlhf.hub import is_hub_ref, model_dir, parse_ref, pin_run_sources

SHA = "1" * 40  # main of org/tiny and org/data
OLD_SHA = "0" * 40  # an older commit of org/tiny (tag v0)
DATA_SHA = "2" * 40
BAD_SHA = "3" * 40
PQ_SHA = "4" * 40

CARD = """---
configs:
- config_name: sft
  default: true
  data_files:
  - split: train
    path: sft/train.jsonl
  - split: test
    path: sft/test.jsonl
- config_name: pairs
  data_files:
  - split: train
    path: pairs/train-*.jsonl
---
# org/data: SFT rows and preference pairs
"""


def put_repo(cache: Path, repo_type: str, repo_id: str, sha: str, files: dict, refs=("main",)) -> Path:
    """A snapshot in huggingface_hub's cache layout; ``files`` maps repo paths to bytes. Returns its directory."""
    storage = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / sha
    for rel, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(sha)
    return snapshot


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(rows, tmp: Path) -> bytes:
    import datasets

    path = tmp / "rows.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path.read_bytes()


@pytest.fixture(scope="module")
def hub_cache(tiny_model, tmp_path_factory) -> Path:
    """org/tiny (main and tag v0); org/data: a card with configs sft (train, test) and pairs; org/bad and org/pq:
    no card (datasets infers the layout), JSON lines with a bad line 3 and Parquet."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    model_files = {name: (Path(tiny_model) / name).read_bytes() for name in os.listdir(tiny_model)}
    put_repo(cache, "model", "org/tiny", SHA, model_files)
    put_repo(cache, "model", "org/tiny", OLD_SHA, model_files, refs=("v0",))
    put_repo(cache, "model", "org/no-config", SHA, {"README.md": b"# not a model\n"})
    tmp = tmp_path_factory.mktemp("parquet")
    put_repo(
        cache,
        "dataset",
        "org/data",
        DATA_SHA,
        {
            "README.md": CARD.encode(),
            "sft/train.jsonl": _jsonl(uneven_sft_rows(12, seed=1)),
            "sft/test.jsonl": _jsonl(uneven_sft_rows(4, seed=2)),
            "pairs/train-00000.jsonl": _jsonl(uneven_pair_rows(3, seed=3)),
            "pairs/train-00001.jsonl": _jsonl(uneven_pair_rows(2, seed=5)),
        },
    )
    put_repo(
        cache,
        "dataset",
        "org/pq",
        PQ_SHA,
        {"data/train-00000-of-00001.parquet": _parquet([{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2="}], tmp)},
    )
    bad = uneven_sft_rows(4, seed=4)
    del bad[2]["response"]  # line 3
    put_repo(cache, "dataset", "org/bad", BAD_SHA, {"data/train.jsonl": _jsonl(bad)})
    return cache


@pytest.fixture
def offline_hub(hub_cache, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _sft(*overrides, data="org/data") -> SFTRunConfig:
    return load_config(SFTRunConfig, overrides=["model.path=org/tiny", f"data.train_path={data}", *overrides])


# ----------------------------------------------------------------------------------------------- references


def test_reference_forms(tmp_path, monkeypatch):
    assert parse_ref("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", "main")
    assert parse_ref(f"org/name@{SHA}") == ("org/name", SHA)
    assert parse_ref("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert is_hub_ref("gpt2") and is_hub_ref("org/name@v1.0")
    for path in ("/abs/model", "./model", "a/b/c", "../x", "~/m", ""):
        assert not is_hub_ref(path), path
    assert not is_hub_ref("train.jsonl", "dataset")  # a missing file, not a dataset repository
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert not is_hub_ref("org/tiny")  # an existing local path always wins


# -------------------------------------------------------------------------------------------------- pinning


def test_cached_ids_are_pinned_to_their_commit(offline_hub, sft_data):
    cfg = pin_run_sources(
        _sft("model.tokenizer_path=org/tiny@main", "data.eval_path=org/data@main", "data.eval_split=test")
    )
    assert cfg.model.path == f"org/tiny@{SHA}" and cfg.model.tokenizer_path == f"org/tiny@{SHA}"
    assert cfg.data.train_path == cfg.data.eval_path == f"org/data@{DATA_SHA}"
    snapshot = offline_hub / "models--org--tiny" / "snapshots" / SHA
    assert model_dir(cfg.model.path) == str(snapshot)
    # A commit, a tag and the branch each pin to the commit they name; a local path is left as it is.
    assert pin_run_sources(_sft(f"model.ref_path=org/tiny@{OLD_SHA}")).model.ref_path == f"org/tiny@{OLD_SHA}"
    assert pin_run_sources(_sft("model.ref_path=org/tiny@v0")).model.ref_path == f"org/tiny@{OLD_SHA}"
    assert pin_run_sources(_sft(data=sft_data)).data.train_path == sft_data


def test_rl_keys_are_pinned(offline_hub):
    from rlhf.trainers.kinds import kind_of

    cfg = load_config(
        RLRunConfig,
        overrides=[
            "model.path=org/tiny",
            "data.train_path=org/data",
            "critic.path=org/tiny@v0",
            "reward.model_path=org/tiny",
            "algo.advantage_estimator=gae",
        ],
    )
    pinned = pin_run_sources(cfg, kind_of(cfg).model_keys)  # online RL's model keys: the critic's, the reward's
    assert (pinned.critic.path, pinned.reward.model_path) == (f"org/tiny@{OLD_SHA}", f"org/tiny@{SHA}")


def test_pinned_config_round_trips(offline_hub, tmp_path):
    cfg = pin_run_sources(_sft("data.config_name=sft"))
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(SFTRunConfig, str(tmp_path / "config.yaml"))
    assert again == cfg and again.model.path == f"org/tiny@{SHA}"
    assert pin_run_sources(again) == again  # pinning is idempotent: what config.yaml holds resolves to itself


def test_a_resumed_run_keeps_the_commits_it_was_pinned_to(offline_hub, tmp_path):
    out = tmp_path / "run"
    first = pin_run_sources(_sft(f"model.path=org/tiny@{OLD_SHA}", f"train.output_dir={out}"))
    save_config(first, out / "config.yaml")
    resumed = pin_run_sources(_sft(f"train.output_dir={out}", "train.resume=true"))  # main is at SHA by now
    assert resumed.model.path == f"org/tiny@{OLD_SHA}"
    assert pin_run_sources(_sft(f"train.output_dir={out}")).model.path == f"org/tiny@{SHA}"  # a fresh run
    assert (
        pin_run_sources(_sft(f"train.output_dir={out}", "train.resume=true", "model.path=org/tiny@main")).model.path
        == f"org/tiny@{SHA}"
    )  # asked explicitly


def test_uncached_ids_are_refused_naming_the_id_and_the_cache(offline_hub):
    with pytest.raises(ConfigError) as err:
        pin_run_sources(_sft("model.path=org/missing"))
    message = str(err.value)
    assert message.startswith("model.path: 'org/missing' is not a local directory, and hub model org/missing")
    assert str(offline_hub) in message and "HF_HUB_OFFLINE=1" in message
    with pytest.raises(
        ConfigError,
        match=r"data\.train_path: 'org/nowhere' is not a local file or directory, "
        r"and hub dataset org/nowhere",
    ):
        pin_run_sources(_sft(data="org/nowhere"))
    with pytest.raises(ConfigError) as err:  # the repository is cached, that revision is not
        pin_run_sources(_sft("model.path=org/tiny@v9"))
    assert "revision v9" in str(err.value) and "main, v0" in str(err.value)


def test_a_hub_repository_that_is_not_a_model_is_refused(offline_hub):
    with pytest.raises(ConfigError, match=r"model\.ref_path: hub repository 'org/no-config' .* \(no config\.json\)"):
        pin_run_sources(_sft("model.ref_path=org/no-config"))
    with pytest.raises(ConfigError, match=r"model\.tokenizer_path: .* has no tokenizer files"):
        pin_run_sources(_sft("model.tokenizer_path=org/no-config"))


def test_actors_get_the_hub_settings(offline_hub):
    from rlhf.distributed.cluster import actor_env

    env = actor_env(0)
    assert env["HF_HUB_CACHE"] == str(offline_hub) and env["HF_HUB_OFFLINE"] == "1"


def test_dry_run_looks_ids_up_without_downloading(offline_hub):
    from shared_helpers import preflight

    rows = {
        key: status for key, _, status in preflight(_sft("data.eval_path=org/elsewhere"), here=False, precision="fp32")
    }
    assert rows["model.path"].startswith(f"hub model at commit {SHA[:12]}, cached here")
    assert rows["data.train_path"].startswith(f"hub dataset at commit {DATA_SHA[:12]}, cached here")
    assert "not in the HF cache here" in rows["data.eval_path"]  # may be cached where the run starts


# -------------------------------------------------------------------------------------------- hub datasets


def test_hub_dataset_rows_by_config_and_split(offline_hub):
    ref = f"org/data@{DATA_SHA}"
    train = read_rows(ref, ["prompt", "response"])  # the default config (sft), split train
    assert train == [{"prompt": r["prompt"], "response": r["response"]} for r in uneven_sft_rows(12, seed=1)]
    assert len(read_rows("org/data", ["prompt", "response"], split="test", config_name="sft")) == 4
    pairs = read_rows(
        ref, ["prompt", "chosen", "rejected"], optional=["margin"], config_name="pairs", types={"margin": (int, float)}
    )
    assert pairs == uneven_pair_rows(3, seed=3) + uneven_pair_rows(2, seed=5)  # both files, in order


def test_hub_dataset_bad_rows_name_the_file_and_line(offline_hub):
    snapshot = offline_hub / "datasets--org--bad" / "snapshots" / BAD_SHA
    with pytest.raises(DataError) as err:
        read_rows("org/bad", ["prompt", "response"])
    assert str(err.value) == f"{snapshot}/data/train.jsonl:3: missing field 'response' (row has: prompt)"
    with pytest.raises(DataError) as err:  # Parquet has no lines: the row index
        read_rows("org/pq", ["prompt", "response"])
    parquet = offline_hub / "datasets--org--pq" / "snapshots" / PQ_SHA / "data" / "train-00000-of-00001.parquet"
    assert str(err.value) == f"{parquet}: row 1: field 'response' must be str, got null"


def test_hub_dataset_check_runs_on_each_row(offline_hub):
    def no_sevens(row):
        if "7" in row["prompt"]:
            raise ValueError("no sevens")

    with pytest.raises(DataError, match=r"sft/train\.jsonl:\d+: no sevens"):
        read_rows("org/data", ["prompt", "response"], check=no_sevens)


def test_unknown_split_or_config_lists_the_available_ones(offline_hub):
    with pytest.raises(DataError) as err:
        read_rows("org/data", ["prompt", "response"], split="validation")
    assert str(err.value) == "org/data: no split 'validation' in config 'sft' (available splits: train, test)"
    with pytest.raises(DataError) as err:
        read_rows("org/data", ["prompt", "response"], config_name="chat")
    assert str(err.value) == f"hub dataset org/data@{DATA_SHA}: no config 'chat' (available configs: sft, pairs)"
    with pytest.raises(ConfigError, match=r"^data\.train_path: hub dataset .*: no config 'chat' \(available configs"):
        pin_run_sources(_sft("data.config_name=chat"))


def test_an_uncached_dataset_id_is_a_data_error(offline_hub):
    with pytest.raises(
        DataError,
        match=r"^org/none: no such file or directory, and hub dataset org/none "
        r"\(revision main\) is not in the Hugging Face cache",
    ):
        read_rows("org/none", ["prompt"])


# ------------------------------------------------------------------------------- online, against a fake hub


class FakeHub:
    """The hub as huggingface_hub's snapshot_download / HfApi see it: repositories with one commit each; a download
    writes the files its patterns select into the cache, and refs/<revision>, as the real one does."""

    def __init__(self, cache: Path, repos: dict) -> None:
        self.cache, self.repos, self.downloads = cache, repos, []  # repos: (type, id) -> (sha, {path: bytes})

    def _repo(self, repo_id, repo_type):
        import httpx2
        from huggingface_hub.errors import RepositoryNotFoundError

        if (repo_type or "model", repo_id) not in self.repos:
            url = f"https://huggingface.co/api/{repo_type}s/{repo_id}"
            raise RepositoryNotFoundError("404", response=httpx2.Response(404, request=httpx2.Request("GET", url)))
        return self.repos[(repo_type or "model", repo_id)]

    def snapshot_download(
        self, repo_id, *, repo_type=None, revision=None, cache_dir=None, allow_patterns=None, ignore_patterns=None, **_
    ):
        from huggingface_hub.utils import filter_repo_objects

        sha, files = self._repo(repo_id, repo_type)
        chosen = list(filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        self.downloads.append((repo_type, repo_id, sorted(chosen)))
        refs = () if revision == sha else (revision,)
        return str(put_repo(Path(cache_dir), repo_type, repo_id, sha, {f: files[f] for f in chosen}, refs=refs))

    def list_repo_files(self, repo_id, revision=None, repo_type=None):
        return list(self._repo(repo_id, repo_type)[1])


@pytest.fixture
def online_hub(tiny_model, tmp_path, monkeypatch) -> FakeHub:
    import huggingface_hub
    from huggingface_hub import constants

    tiny = {name: (Path(tiny_model) / name).read_bytes() for name in os.listdir(tiny_model)}
    model = {**tiny, "pytorch_model.bin": b"same weights, pickled", "onnx/model.onnx": b"onnx"}
    data = {
        "README.md": CARD.encode(),
        "sft/train.jsonl": _jsonl(uneven_sft_rows(8, seed=1)),
        "sft/test.jsonl": _jsonl(uneven_sft_rows(2, seed=2)),
        "pairs/train-00000.jsonl": _jsonl(uneven_pair_rows(3, seed=3)),
    }
    hub = FakeHub(tmp_path / "hub", {("model", "org/tiny"): (SHA, model), ("dataset", "org/data"): (DATA_SHA, data)})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: hub)
    return hub


def test_online_ids_are_downloaded_then_resolve_offline(online_hub, monkeypatch):
    cfg = pin_run_sources(_sft("data.config_name=pairs"))
    assert (cfg.model.path, cfg.data.train_path) == (f"org/tiny@{SHA}", f"org/data@{DATA_SHA}")
    (_, _, model_files), (_, _, card), (_, _, data_files) = online_hub.downloads
    # The model's loadable files only (no ONNX, no pickled twin of the safetensors); the dataset's card, then
    # only the files of the config read.
    assert "model.safetensors" in model_files and "pytorch_model.bin" not in model_files
    assert not any(f.startswith("onnx/") for f in model_files)
    assert card == ["README.md"] and data_files == ["README.md", "pairs/train-00000.jsonl"]
    # A worker resolving the pin online selects the same files, from its cached snapshot, without a listing.
    online_hub.list_repo_files = None
    assert model_dir(cfg.model.path) == str(online_hub.cache / "models--org--tiny" / "snapshots" / SHA)
    assert online_hub.downloads[-1] == ("model", "org/tiny", model_files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # refs/main was written: the unpinned ids now resolve offline
    assert pin_run_sources(_sft("data.config_name=pairs")) == cfg


def test_online_unknown_repository_is_named(online_hub):
    with pytest.raises(ConfigError) as err:
        pin_run_sources(_sft("model.path=org/typo"))
    assert str(err.value).startswith(
        "model.path: 'org/typo' is not a local directory, and hub model org/typo "
        "(revision main): no such repository on the hub"
    )


# ------------------------------------------------------------------------------------- a real run, offline


@pytest.mark.usefixtures("ray_session")
def test_sft_from_a_hub_model_and_dataset_through_the_cli(offline_hub, tmp_path, capsys):
    """Ray started before the cache was set (the session cluster): the workers find it through actor_env."""
    from rlhf.cli.common import run_cli
    from rlhf.trainers.offline.sft import train_sft

    out = tmp_path / "sft"
    status = run_cli(
        SFTRunConfig,
        train_sft,
        "train_sft",
        [
            "model.path=org/tiny",
            "data.train_path=org/data",
            "data.config_name=sft",
            "data.eval_path=org/data",
            "data.eval_split=test",
            f"train.output_dir={out}",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "train.num_workers=2",
            "train.max_steps=2",
            "strategy.zero_stage=0",
            "data.max_length=64",
            "logging.tensorboard=false",
        ],
    )
    assert status == 0, capsys.readouterr().err
    saved = load_config(SFTRunConfig, str(out / "config.yaml"))
    assert saved.model.path == f"org/tiny@{SHA}" and saved.data.train_path == f"org/data@{DATA_SHA}"
    assert saved.data.eval_path == f"org/data@{DATA_SHA}"
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert (out / "final" / "config.json").is_file()
