"""Pairwise reward-model training: ``python -m rlhf.cli.train_rm [--config FILE_OR_PRESET] key=value ...``

Runs on a local Ray cluster by default, or joins ``RAY_ADDRESS``
(``RAY_AUTH_MODE=token ray job submit --address http://HEAD_IP:8265 --working-dir . --
    python -m rlhf.cli.train_rm ...``).
``--help`` lists every configuration key with its default.
"""
from __future__ import annotations

import sys

from rlhf.cli.common import run_cli
from rlhf.config.schema import RewardModelRunConfig
from rlhf.trainers.reward_model import train_reward_model


def main(argv=None) -> int:
    return run_cli(RewardModelRunConfig, train_reward_model, prog="python -m rlhf.cli.train_rm", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
