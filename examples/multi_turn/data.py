"""The data of the two multi-turn examples: RL prompts and held-out prompts with an ``answer``, and SFT warm-up
rows in the text format ``{"prompt": ..., "response": ...}``.

Write them with ``python examples/multi_turn/data.py --env calculator --out DIR`` (or ``--env retry``); the files
are ``DIR/sft.jsonl``, ``DIR/prompts.jsonl`` and ``DIR/eval_prompts.jsonl``.

**How an SFT row must look for a multi-turn rollout.** The rollout never re-encodes text: turn 2's prompt is the
token ids the engine saw and sampled in turn 1 (``rlhf/rollout/episodes.py``), i.e. ::

    tokens(prompt) + sampled response ids (ending with EOS when the model stopped) + tokens(observation)

with the observation tokenized alone, without special tokens. An SFT row ``{"prompt": P, "response": R}`` is
tokenized as ``tokens(P)`` (with the tokenizer's own special tokens: none for the tiny tokenizer) + ``tokens(R)``
+ EOS (``rlhf/data/tokenize.py``). So a row that teaches the second turn has ``P = prompt + response + EOS text +
observation``: the tokenizer reads the EOS text (``</s>``) as the EOS id, and the tiny tokenizer's pieces do not
merge across these boundaries (digits and letters are one token each), so ``tokens(P)`` is exactly the rollout's
ids. ``tests/unit/test_example_envs.py`` checks it token by token.

The text formats (the call, the result, the feedback) come from the environments themselves, loaded by spec as
the rollout's actors load them, so data and environment cannot drift apart.
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Dict, List, Optional, Sequence

from rlhf.envs import load_environment
from rlhf.models.tiny import EOS_TOKEN
from rlhf.synthetic.arithmetic import make_rl_prompts, make_sft_rows, write_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
SPECS = {
    "calculator": os.path.join(HERE, "calculator.py") + ":Calculator",
    "retry": os.path.join(HERE, "retry.py") + ":Retry",
}

# Each file draws from its own seed (seed x stride + offset), as rlhf.cli.make_assets does.
_SEED_STRIDE = 1000
_SFT, _PROMPTS, _EVAL = 0, 1, 2
# Two-digit operands: 8100 problems with 3-4 digit answers, beyond what the tiny model memorises in a warm-up.
LOW, HIGH = 10, 99
RETRY_MAX_OPERAND = 20  # the a+b task of rlhf.synthetic.arithmetic


def multiplication_rows(n: int, seed: int, low: int = LOW, high: int = HIGH) -> List[Dict[str, str]]:
    """Rows ``{"prompt": "37*48=", "answer": "1776"}``, operands uniform in ``low..high``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        rows.append({"prompt": f"{a}*{b}=", "answer": str(a * b)})
    return rows


def calculator_sft_rows(n: int, seed: int, tool_share: float = 0.3, eos: str = EOS_TOKEN) -> List[Dict[str, str]]:
    """Warm-up rows for ``n`` problems: a ``tool_share`` of them are taught as a call, two rows each (the call;
    then, after the call, its EOS and the observation, the copied result), the rest as a direct answer.

    Before RL the model then calls the tool on about ``tool_share`` of the prompts, and answers right after a
    call; RL has to find out that calling pays.
    """
    calculator = load_environment(SPECS["calculator"])
    rng = random.Random(f"tool share {seed}")  # not random.Random(seed): that stream drew the operands
    rows = []
    for row in multiplication_rows(n, seed):
        prompt, answer = row["prompt"], row["answer"]
        if rng.random() >= tool_share:
            rows.append({"prompt": prompt, "response": answer})
            continue
        call = calculator.call_text(prompt.rstrip("="))
        observation = calculator.result_text(calculator.evaluate(call))
        rows.append({"prompt": prompt, "response": call})
        rows.append({"prompt": prompt + call + eos + observation, "response": answer})
    return rows


def _wrong_answer(rng: random.Random, right: int) -> int:
    """A plausible wrong sum: mostly a near miss (the tiny model's usual error), sometimes further off."""
    offsets = (-2, -1, 1, 2) if rng.random() < 0.7 else tuple(range(-9, -2)) + tuple(range(3, 10))
    return right + rng.choice([d for d in offsets if right + d >= 0])


def retry_sft_rows(
    n: int, seed: int, retry_share: float = 0.05, eos: str = EOS_TOKEN, max_operand: int = RETRY_MAX_OPERAND
) -> List[Dict[str, str]]:
    """``n`` addition rows (``rlhf.synthetic.arithmetic.make_sft_rows``); for a ``retry_share`` of them one more
    row that answers right after a wrong first answer, its EOS and the environment's feedback.

    The retry rows teach the second turn: without any, the warmed-up model rarely gets a retry right (0-6%
    measured); with 5% of the problems, ~25%. Whether the policy gets the retry right, and how often it needs one,
    is what RL then changes.
    """
    retry = load_environment(SPECS["retry"])
    rng = random.Random(f"retry share {seed}")  # not random.Random(seed): that stream drew the operands
    rows = []
    for row in make_sft_rows(n, seed, max_operand):
        rows.append(row)
        if rng.random() < retry_share:
            wrong = str(_wrong_answer(rng, int(row["response"])))
            feedback = retry.feedback_text(wrong, row["response"], row["prompt"])
            rows.append({"prompt": row["prompt"] + wrong + eos + feedback, "response": row["response"]})
    return rows


def addition_rows(n: int, seed: int, max_operand: int = RETRY_MAX_OPERAND) -> List[Dict[str, str]]:
    """Rows ``{"prompt": "12+7=", "answer": "19"}`` (``rlhf.synthetic.arithmetic.make_rl_prompts``)."""
    return make_rl_prompts(n, seed, max_operand)


def example_rows(
    env: str,
    seed: int = 0,
    num_sft: int = 2000,
    num_prompts: int = 1024,
    num_eval: int = 64,
    share: Optional[float] = None,
    eos: str = EOS_TOKEN,
) -> Dict[str, List[Dict[str, str]]]:
    """The rows of one example: ``sft``, ``prompts`` and ``eval_prompts`` (a fresh sample from another seed; the
    problem space is small, so not a disjoint one). ``share``: the SFT rows' tool (calculator) or retry (retry)
    share, default the functions' own."""
    if env not in SPECS:
        raise ValueError(f"unknown example {env!r}; choose one of {sorted(SPECS)}")
    seeds = {
        part: seed * _SEED_STRIDE + offset for part, offset in (("sft", _SFT), ("prompts", _PROMPTS), ("eval", _EVAL))
    }
    extra = {} if share is None else {"tool_share" if env == "calculator" else "retry_share": share}
    if env == "calculator":
        sft = calculator_sft_rows(num_sft, seeds["sft"], eos=eos, **extra)
        prompts = multiplication_rows(num_prompts, seeds["prompts"])
        held_out = multiplication_rows(num_eval, seeds["eval"])
    else:
        sft = retry_sft_rows(num_sft, seeds["sft"], eos=eos, **extra)
        prompts = addition_rows(num_prompts, seeds["prompts"])
        held_out = addition_rows(num_eval, seeds["eval"])
    return {"sft": sft, "prompts": prompts, "eval_prompts": held_out}


def write_example_data(env: str, out_dir: str, **kwargs) -> Dict[str, str]:
    """Write :func:`example_rows` to ``out_dir/{sft,prompts,eval_prompts}.jsonl``; returns the paths by name."""
    rows = example_rows(env, **kwargs)
    return {name: write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), part) for name, part in rows.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python examples/multi_turn/data.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--env", choices=sorted(SPECS), required=True)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-sft", type=int, default=2000, help="SFT problems (a tool or retry row adds one)")
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--share", type=float, default=None, help="SFT tool / retry share (default 0.3 / 0.05)")
    args = parser.parse_args(argv)
    paths = write_example_data(
        args.env,
        args.out,
        seed=args.seed,
        num_sft=args.num_sft,
        num_prompts=args.num_prompts,
        num_eval=args.num_eval,
        share=args.share,
    )
    for name, path in paths.items():
        print(f"wrote {path} ({name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
