"""The agent example's data: a chat SFT warm-up (the sum, and for 5% of the problems a wrong answer, the hint and the
right one), RL prompts and held-out prompts as chat messages with their ``answer``.

    python examples/agents/data.py --out DIR     # DIR/sft.jsonl, DIR/prompts.jsonl, DIR/eval_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List

MAX_OPERAND = 20  # the retry example's range: 441 problems, some of which the warm-up leaves wrong


def _question(a: int, b: int) -> List[Dict[str, str]]:
    return [{"role": "user", "content": f"{a}+{b}="}]


def sft_rows(n: int, seed: int, retry_share: float = 0.05) -> List[dict]:
    """Conversations: the question and the sum; a ``retry_share`` of them a near miss first, the hint, the sum."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        messages = _question(a, b)
        if rng.random() < retry_share:
            wrong = a + b + rng.choice((-2, -1, 1, 2))
            messages += [
                {"role": "assistant", "content": str(wrong)},
                {"role": "user", "content": "higher" if wrong < a + b else "lower"},
            ]
        rows.append({"messages": messages + [{"role": "assistant", "content": str(a + b)}]})
    return rows


def prompt_rows(n: int, seed: int) -> List[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        rows.append({"prompt": _question(a, b), "answer": str(a + b)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-sft", type=int, default=2000)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (
        ("sft", sft_rows(args.num_sft, seed=0)),
        ("prompts", prompt_rows(512, seed=1)),
        ("eval_prompts", prompt_rows(64, seed=2)),
    ):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
