"""Online RL (PPO with a critic, GRPO, Dr. GRPO, RLOO, REINFORCE++) with vLLM rollouts:
``python -m rlhf.cli.train_ppo [--config FILE_OR_PRESET] key=value ...``

Runs on a local Ray cluster by default, or joins ``RAY_ADDRESS``
(``RAY_AUTH_MODE=token ray job submit --address http://HEAD_IP:8265 --working-dir . --
    python -m rlhf.cli.train_ppo ...``). ``--help`` lists every configuration key.
"""
from __future__ import annotations

import sys

from rlhf.cli.common import run_cli
from rlhf.config.rl_schema import RLRunConfig
from rlhf.trainers.rl_runner import train_ppo


def main(argv=None) -> int:
    return run_cli(RLRunConfig, train_ppo, prog="python -m rlhf.cli.train_ppo", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
