"""Shared fixtures: the tiny model and data built locally, and one local Ray cluster for the session.

Layout: ``tests/unit`` holds the tests that start no Ray actors and train nothing (pure maths, config, data, docs,
CLI validation); ``tests/integration`` the rest, which run real Ray actors hosting real DeepSpeed engines (CPU
accelerator, gloo) on the tiny model. The directory is the truth: every test under ``tests/integration`` is marked
``slow`` here, and ``tests/unit/conftest.py`` fails a unit test that asks for ``ray_session`` or calls ``ray.init``.
``make test-fast`` is ``pytest tests/unit``. Helpers shared by both directories live next to this file
(``shared_helpers.py``, ``rl_helpers.py``, ...), which is put on ``sys.path`` below; test module basenames must be
unique across both directories (rootdir-less "prepend" import mode, no ``__init__.py``).

Scheduling: ``make test`` runs two test processes (pytest-xdist, ``--dist loadfile``), each with its own local Ray
cluster: part of an integration test is waiting (actor start-up, process spawns), which the other process fills. A
test file goes to one process whole, so a module fixture that trains (several runs) runs once, and files are handed
out in collection order, so the longest go first (longest-processing-time scheduling) and the processes finish
together. No list is kept by hand: every run records each test's seconds (setup + call + teardown, as reported to
the controlling process, xdist workers included) in pytest's cache under ``rlhf/test_seconds`` (``.pytest_cache``;
``--cache-clear`` forgets them), and collection orders files by the summed seconds of their collected tests, longest
first. Files with no record yet (a fresh clone, a new file) go first, integration before unit, since an unknown one
may be long. Inside a file the tests keep their order. Under xdist the controlling process reads the cache once and
hands the same figures to every worker, so the workers' collections agree even if the cache changes meanwhile.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

TESTS_DIR = Path(__file__).resolve().parent
INTEGRATION_DIR = TESTS_DIR / "integration"
# The shared helpers (``from rl_helpers import ...``) import from tests in either directory.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from shared_helpers import uneven_pair_rows, uneven_sft_rows, write_jsonl  # noqa: E402

SECONDS_KEY = "rlhf/test_seconds"  # pytest cache key: {node id: seconds of its last run}
_SECONDS = pytest.StashKey[dict]()  # the recorded seconds this session orders by


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class _TestSeconds:
    """On the controlling process (the only one without xdist): sums each test's reported seconds and merges them
    into the cache at the end. Reports from xdist workers reach the controller through ``pytest_runtest_logreport``."""

    def __init__(self, config):
        self.config, self.ran = config, {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):  # xdist: the workers order by the figures the controller read
        node.workerinput["rlhf_test_seconds"] = self.config.stash[_SECONDS]

    def pytest_runtest_logreport(self, report):
        self.ran[report.nodeid] = self.ran.get(report.nodeid, 0.0) + float(report.duration or 0.0)

    def pytest_sessionfinish(self):
        cache = getattr(self.config, "cache", None)
        if cache is None or not self.ran:
            return
        recorded = cache.get(SECONDS_KEY, {})  # re-read: another session may have written meanwhile
        recorded = dict(recorded) if isinstance(recorded, dict) else {}
        recorded.update({nodeid: round(s, 3) for nodeid, s in self.ran.items()})
        root = Path(self.config.rootpath)
        cache.set(
            SECONDS_KEY, {nodeid: s for nodeid, s in sorted(recorded.items()) if (root / _file(nodeid)).is_file()}
        )  # files since removed are forgotten


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: starts Ray actors or trains end to end: every test under "
        "tests/integration (`make test-fast` runs tests/unit only)",
    )
    if hasattr(config, "workerinput"):  # an xdist worker: the controller read the cache and records the times
        config.stash[_SECONDS] = config.workerinput.get("rlhf_test_seconds", {})
        return
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    recorded = cache.get(SECONDS_KEY, {}) if cache is not None else {}
    config.stash[_SECONDS] = recorded if isinstance(recorded, dict) else {}
    config.pluginmanager.register(_TestSeconds(config), "rlhf_test_seconds")
    # pytest-xdist >= 3.6 re-sorts --dist loadfile's files by their number of tests unless told not to
    # (--loadscope-reorder is on by default). With recorded times the files go out in the order made here, longest
    # first. Without them (a fresh clone, CI) there is nothing better to order by and xdist's order stays: on a fresh
    # clone both orders measured alike (22:26 and 22:20 of pytest, the same day).
    if config.stash[_SECONDS] and hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION_DIR in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)

    recorded = config.stash.get(_SECONDS, {})
    seconds: Dict[str, float] = {}  # file -> summed recorded seconds of its collected tests
    for item in items:
        if item.nodeid in recorded:
            seconds[_file(item.nodeid)] = seconds.get(_file(item.nodeid), 0.0) + float(recorded[item.nodeid])

    def rank(item):
        name = _file(item.nodeid)
        if name not in seconds:  # never run here: first, integration before unit
            return (0, INTEGRATION_DIR not in Path(item.path).parents, 0.0)
        return (1, False, -seconds[name])

    items.sort(key=rank)  # stable: a file's tests keep their order, files of equal rank their collection order


@pytest.fixture(scope="module")
def one_torch_thread():
    """A module's in-process torch maths on one intra-op thread (``rl_helpers.one_torch_thread`` says why; use it
    as ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``). Measured next to two busy processes:
    test_rl_objectives.py and test_rl_metrics.py took 12 to 29 s on two threads, 9 s on one."""
    from rl_helpers import one_torch_thread as on_one_thread

    with on_one_thread():
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory, tiny_model) -> str:
    """The tiny model with a seeded random scalar head, saved as ``train_rm`` saves a reward model."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = str(tmp_path_factory.mktemp("reward_model") / "tiny_rm")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    model.config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "sft.jsonl", uneven_sft_rows(21, seed=3))


@pytest.fixture(scope="session")
def pair_data(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "pairs.jsonl", uneven_pair_rows(19, seed=4))


RL_SHAPING = """
def length_bonus(prompts, responses):
    # a continuous, content-dependent reward so that even the random tiny model gets non-zero advantages
    return [(sum(map(ord, r)) % 97) / 96.0 for r in responses]
"""


@pytest.fixture(scope="session")
def rl_shaping(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "shaping.py"
    path.write_text(RL_SHAPING)
    return f"{path}:length_bonus@0.5"


@pytest.fixture(scope="session")
def rl_prompts(tmp_path_factory):
    from rlhf.synthetic.arithmetic import make_rl_prompts, write_jsonl

    return write_jsonl(str(tmp_path_factory.mktemp("rl") / "prompts.jsonl"), make_rl_prompts(64, seed=5))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for every integration test (starting one costs ~6 s)."""
    import ray

    from rlhf.distributed.cluster import LOCAL_SYSTEM_CONFIG

    if not ray.is_initialized():
        # Logical CPUs: an RL run holds policy, reference, critic and vLLM actors at once; they take turns on 2 cores.
        # address="local": always a cluster of this process's own (parallel test processes each start one),
        # never one found through RAY_ADDRESS or /tmp/ray/ray_current_cluster.
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}},
            _system_config=LOCAL_SYSTEM_CONFIG,  # no idle workers started ahead (rlhf.distributed.cluster)
        )
    yield ray
    ray.shutdown()
