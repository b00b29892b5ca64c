"""Shared fixtures: the tiny model and data built locally, and one local Ray cluster for the session.

Integration tests run real Ray actors hosting real DeepSpeed engines (CPU accelerator, gloo) on the tiny model.
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


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end runs (deselect with -m 'not slow')")


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
def sft_data(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "sft.jsonl", uneven_sft_rows(21, seed=3))


@pytest.fixture(scope="session")
def pair_data(tmp_path_factory) -> str:
    return write_jsonl(tmp_path_factory.mktemp("data") / "pairs.jsonl", uneven_pair_rows(19, seed=4))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for every integration test (starting one costs ~6 s)."""
    import ray

    if not ray.is_initialized():
        # Logical CPUs: an RL run holds policy, reference, critic and vLLM actors at once; they take turns on 2 cores.
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
