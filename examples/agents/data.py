"""The agent examples' data: a chat SFT warm-up, RL prompts and held-out prompts as chat messages with their
``answer``.

* ``retry`` (retry_agent.py): sums; the warm-up answers them, and for 5% of the problems answers wrong, gets the
  hint and answers right.
* ``calculator`` (calculator_agent.py): two-digit products; the warm-up answers 40% of them directly (mostly
  wrong: the tiny model cannot multiply) and 60% by calling the ``mul`` tool (OpenAI's ``tool_calls``, the
  ``tools`` column) and copying its result. RL has to find out that calling pays, and to copy the numbers right.
  With ``--model``, also the tiny model, its tokenizer's merges learned from the tool-calling text too, and the
  chat template with tools.

    python examples/agents/data.py --task retry --out DIR     # DIR/sft.jsonl, prompts.jsonl, eval_prompts.jsonl
    python examples/agents/data.py --task calculator --out DIR --model MODEL_DIR    # + DIR/tools.jinja
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Dict, List

MAX_OPERAND = 20  # the retry example's range: 441 problems, some of which the warm-up leaves wrong
LOW, HIGH = 10, 99  # the calculator's operands: 8100 products, beyond what the tiny model memorises


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


def _tools():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from calculator_agent import TOOLS  # the agent's own schema: the warm-up renders what the agent will send

    return TOOLS


def calculator_sft_rows(n: int, seed: int, tool_share: float = 0.6) -> List[dict]:
    """Products: a ``tool_share`` of them called (``mul``), its result read back and copied; the rest answered."""
    rng, tools = random.Random(seed), _tools()
    rows = []
    for _ in range(n):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        messages = [{"role": "user", "content": f"{a}*{b}="}]
        if rng.random() < tool_share:
            call = {"type": "function", "function": {"name": "mul", "arguments": json.dumps({"a": a, "b": b})}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(a * b)},
            ]
        rows.append({"messages": messages + [{"role": "assistant", "content": str(a * b)}], "tools": tools})
    return rows


def calculator_prompt_rows(n: int, seed: int) -> List[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        rows.append({"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b)})
    return rows


def write_model(out: str, template: str, rows: List[dict]) -> None:
    """The tiny model and the chat template with tools (as a file). The tokenizer also learns its merges from
    ``rows`` as the template renders them, so that the tools header and a call are words, not bytes: a call is 30
    tokens instead of 73, a whole tool-calling episode ~165 instead of ~465.
    """
    from rlhf.models.tiny import TOOLS_CHAT_TEMPLATE, build_tiny_model, build_tokenizer, write_tools_template

    render = build_tokenizer().apply_chat_template
    corpus = [render(r["messages"], tools=r["tools"], tokenize=False, chat_template=TOOLS_CHAT_TEMPLATE) for r in rows]
    build_tiny_model(out, extra_corpus=corpus)
    write_tools_template(template)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("retry", "calculator"), default="retry")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-sft", type=int, default=2000)
    parser.add_argument("--model", default="", help="calculator: write the tiny model here")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.task == "calculator":
        files = (
            ("sft", calculator_sft_rows(args.num_sft, seed=0)),
            ("prompts", calculator_prompt_rows(512, seed=1)),
            ("eval_prompts", calculator_prompt_rows(64, seed=2)),
        )
        if args.model:
            write_model(args.model, os.path.join(args.out, "tools.jinja"), files[0][1][:200])
    else:
        files = (
            ("sft", sft_rows(args.num_sft, seed=0)),
            ("prompts", prompt_rows(512, seed=1)),
            ("eval_prompts", prompt_rows(64, seed=2)),
        )
    for name, rows in files:
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
