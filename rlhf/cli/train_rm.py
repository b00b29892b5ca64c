"""Pairwise reward-model training: ``python -m rlhf.cli.train_rm [--config FILE_OR_PRESET] key=value ...``

Runs on a local Ray cluster by default, or joins ``RAY_ADDRESS``
(``RAY_AUTH_MODE=token ray job submit --address http://HEAD_IP:8265 --working-dir . --
    python -m rlhf.cli.train_rm ...``).
``--help`` lists every configuration key with its default.
"""

from __future__ import annotations

import sys

from rlhf.cli.common import run_cli
from rlhf.trainers.kinds import TRAINER_KINDS


def main(argv=None) -> int:
    kind = TRAINER_KINDS.get("rm")
    return run_cli(kind.config_cls, kind.train, prog="python -m rlhf.cli.train_rm", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
