"""Shared fixtures: the tiny model and data built locally, and one local Ray cluster for the session.

Integration tests run real Ray actors hosting real DeepSpeed engines (CPU accelerator, gloo) on the tiny model.

``make test`` runs two test processes (pytest-xdist, ``--dist loadfile``), each with its own local Ray cluster:
part of an integration test is waiting (actor start-up, process spawns), which the other process fills. A test
file goes to one process whole, so a module fixture that trains (several runs) runs once; the long files are
handed out first so that the processes finish together.
"""
from __future__ import annotations

import json
import os
import random

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# Longest first (longest-processing-time scheduling over the test processes); the rest keep their order.
LONG_MODULES = ("test_rl_e2e", "test_resume", "test_dpo_training", "test_resume_dpo", "test_rl_algorithms",
                "test_multinode", "test_doctor", "test_precision", "test_offline_training", "test_workers",
                "test_cli_errors", "test_vllm_rollout", "test_rm_training", "test_health", "test_chat_chain",
                "test_comm_op_build", "test_hub", "test_rl_reference")
# Modules with unit tests and a few long ones (those on the shared Ray cluster are `slow`): scheduled early too.
MIXED_MODULES = ("test_audit", "test_fp64")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts Ray actors or trains end to end (`make test-fast` deselects "
                                       "them with -m 'not slow')")


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        order = LONG_MODULES + MIXED_MODULES  # the longest first, so the two test processes end together
        name = _module(item)
        return order.index(name) if name in order else len(order)

    # Every test of the long modules and every test on the shared Ray cluster is `slow`: `make test-fast` is the
    # unit tests (pure maths, config, data, docs), no actors.
    for item in items:
        if _module(item) in LONG_MODULES or "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    items.sort(key=rank)  # stable: a module's tests keep their order


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(str(rng.randrange(10)) for _ in range(rng.randint(lo, hi)))


def uneven_sft_rows(n: int, seed: int) -> list[dict]:
    """Addition rows whose responses have very different lengths (1 to ~40 tokens), so micro-batches pad
    differently under every factorisation."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        rows.append({"prompt": f"{a}+{b}=", "response": f"{a + b} {_digits(rng, 0, 18)}".strip()})
    return rows


def uneven_pair_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(30), rng.randrange(30)
        rows.append({"prompt": f"{a}+{b}=", "chosen": f"{a + b} {_digits(rng, 0, 12)}".strip(),
                     "rejected": f"{a + b + rng.randint(1, 5)} {_digits(rng, 0, 18)}".strip(),
                     "margin": float(rng.randint(1, 3))})
    return rows


def kill_an_actor_once(checkpoint_dir: str, title: str, while_saving: bool = False):
    """A thread that SIGKILLs one live actor process titled ``title...`` (Ray names an actor's process
    ``ray::<Class>``) once ``checkpoint_dir`` exists (``while_saving``: once its ``.tmp`` is being written): a real
    crash. A test process runs one training at a time, so its live actors belong to that run. Returns the thread
    and a dict that gets the killed ``pid``."""
    import signal
    import threading
    import time

    import psutil

    killed = {}

    def watch():
        deadline = time.time() + 300
        watched = (checkpoint_dir + ".tmp", checkpoint_dir) if while_saving else (checkpoint_dir,)
        while time.time() < deadline and not any(map(os.path.isdir, watched)):
            time.sleep(0.02)
        # Only this test process's own actors (its local Ray cluster's workers descend from it): a parallel
        # test process's run is left alone.
        for proc in psutil.Process().children(recursive=True):
            try:
                cmdline = proc.cmdline()
            except psutil.Error:
                continue
            if cmdline and cmdline[0].startswith(title):
                killed["pid"] = proc.pid
                os.kill(proc.pid, signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, killed


def wait_until_dead(handle, timeout_s: float = 120.0) -> None:
    """``ray.kill`` is asynchronous: on a loaded machine a call made right after it can still be served."""
    import time

    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers")


def run_main(module: str, argv, cwd, capsys, monkeypatch):
    """``python -m <module> argv...`` in this process, from ``cwd`` and outside any Ray cluster:
    ``(exit status, stdout, stderr)``."""
    import importlib

    monkeypatch.chdir(cwd)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rc = importlib.import_module(module).main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


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

    if not ray.is_initialized():
        # Logical CPUs: an RL run holds policy, reference, critic and vLLM actors at once; they take turns on 2 cores.
        # address="local": always a cluster of this process's own (parallel test processes each start one),
        # never one found through RAY_ADDRESS or /tmp/ray/ray_current_cluster.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
