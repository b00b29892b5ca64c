"""A tiny addition task with a checkable answer.

Prompts look like ``"12+7="`` and the correct response is ``"19"``. The task is small on purpose: with operands
in ``0..20`` there are only 441 distinct problems, so a 2-layer model learns it in a few hundred CPU steps, which
makes it usable for tests, examples and the SFT -> DPO -> online-RL demo. The response never contains EOS text;
the tokenizer side appends the EOS token.

Every sampler takes an explicit seed and draws from its own ``random.Random`` so that datasets are reproducible
and independent of any global RNG state another library may touch.
"""

from __future__ import annotations

import json
import os
import random
import re
from typing import Iterable, Mapping

from rlhf.atomic import write_text_atomic

DEFAULT_MAX_OPERAND = 20

# An optional minus sign so that "-3" is read as -3, not as 3 (a wrong answer must not look correct).
_INT_RE = re.compile(r"-?\d+")


def format_prompt(a: int, b: int) -> str:
    """The prompt for ``a + b``; no spaces so that tokenization is compact and unambiguous."""
    return f"{a}+{b}="


def _check_max_operand(max_operand: int) -> None:
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")


def _sample_operands(rng: random.Random, max_operand: int) -> tuple[int, int]:
    return rng.randint(0, max_operand), rng.randint(0, max_operand)


def make_sft_rows(n: int, seed: int, max_operand: int = DEFAULT_MAX_OPERAND) -> list[dict]:
    """Supervised rows with correct answers.

    Args:
        n: Number of rows.
        seed: Seed for this sample; the same seed gives the same rows.
        max_operand: Operands are drawn uniformly from ``0..max_operand`` inclusive.

    Returns:
        Rows ``{"prompt": "a+b=", "response": "a+b"}``.
    """
    _check_max_operand(max_operand)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _sample_operands(rng, max_operand)
        rows.append({"prompt": format_prompt(a, b), "response": str(a + b)})
    return rows


def _wrong_answer(rng: random.Random, correct: int) -> tuple[int, float]:
    """A plausible wrong answer and its margin (1.0 for a near miss, 2.0 for a far one).

    Candidates are non-negative and never equal to ``correct``. A digit swap (``19`` -> ``91``) is a typical
    model error and counts as far; so does an offset of 3..10.
    """
    kind = rng.random()
    if kind < 0.2:
        digits = str(correct)
        swapped = int(digits[::-1]) if len(digits) == 2 else None
        # "10" reversed is "01" == 1 and "11" reversed is itself; only use swaps that give a new 2-digit number.
        if swapped is not None and swapped != correct and digits[1] != "0":
            return swapped, 2.0
    if kind < 0.6:
        offsets = [d for d in (-2, -1, 1, 2) if correct + d >= 0]
        return correct + rng.choice(offsets), 1.0
    offsets = [d for d in range(-10, 11) if abs(d) >= 3 and correct + d >= 0]
    return correct + rng.choice(offsets), 2.0


def make_preference_rows(n: int, seed: int, max_operand: int = DEFAULT_MAX_OPERAND) -> list[dict]:
    """Preference pairs: the correct answer is chosen, a plausible wrong one is rejected.

    Args:
        n: Number of pairs.
        seed: Seed for this sample; the same seed gives the same rows.
        max_operand: Operands are drawn uniformly from ``0..max_operand`` inclusive.

    Returns:
        Rows ``{"prompt", "chosen", "rejected", "margin"}``; ``margin`` is an integer-valued float (1.0 for a near
        miss, 2.0 for a far one) that a reward model may use and other trainers ignore.
    """
    _check_max_operand(max_operand)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _sample_operands(rng, max_operand)
        wrong, margin = _wrong_answer(rng, a + b)
        rows.append({"prompt": format_prompt(a, b), "chosen": str(a + b), "rejected": str(wrong), "margin": margin})
    return rows


def to_unpaired(rows: list[dict]) -> list[dict]:
    """Preference pairs as thumbs-up / thumbs-down rows (TRL's unpaired layout, for KTO): each pair gives
    ``{"prompt", "completion": chosen, "label": True}`` and ``{"prompt", "completion": rejected, "label": False}``."""
    return [
        {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
        for r in rows
        for side in ("chosen", "rejected")
    ]


def make_rl_prompts(n: int, seed: int, max_operand: int = DEFAULT_MAX_OPERAND) -> list[dict]:
    """Prompts for online RL with their reference answers.

    Returns:
        Rows ``{"prompt": "a+b=", "answer": "a+b"}`` with the answer as a string.
    """
    _check_max_operand(max_operand)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _sample_operands(rng, max_operand)
        rows.append({"prompt": format_prompt(a, b), "answer": str(a + b)})
    return rows


SYSTEM_PROMPT = "Answer with the sum."


def _user(prompt: str) -> dict:
    return {"role": "user", "content": prompt}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def to_chat_sft(rows: list[dict]) -> list[dict]:
    """SFT rows as conversations (``{"messages": [...]}``). Every third conversation asks a second question after
    the first answer, so it has two assistant turns (``data.assistant_turns`` all vs last)."""
    out = []
    for i, row in enumerate(rows):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, _user(row["prompt"]), _assistant(row["response"])]
        if i % 3 == 2:
            previous = rows[i - 1]
            messages += [_user(previous["prompt"]), _assistant(previous["response"])]
        out.append({"messages": messages})
    return out


def to_chat_preference(rows: list[dict]) -> list[dict]:
    """Preference rows as a prompt conversation with one assistant message chosen and one rejected."""
    return [
        {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, _user(r["prompt"])],
            "chosen": [_assistant(r["chosen"])],
            "rejected": [_assistant(r["rejected"])],
            "margin": r["margin"],
        }
        for r in rows
    ]


def to_chat_prompts(rows: list[dict]) -> list[dict]:
    """RL prompts as conversations, answered after the chat template's generation prompt."""
    return [
        {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, _user(r["prompt"])], "answer": r["answer"]}
        for r in rows
    ]


def extract_answer(response: str) -> str | None:
    """The first integer in ``response`` (after stripping whitespace), or None if there is none.

    A leading minus sign is kept, so ``"-3"`` yields ``"-3"``.
    """
    match = _INT_RE.search(response.strip())
    return match.group(0) if match else None


def is_correct(response: str, answer: str) -> bool:
    """Whether the first integer in ``response`` equals ``answer`` numerically (so ``"07"`` matches ``"7"``)."""
    got = extract_answer(response)
    if got is None:
        return False
    try:
        return int(got) == int(answer.strip())
    except ValueError:  # a malformed reference answer is a data bug, but scoring must not crash a run
        return False


def reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """Rule-based reward: 1.0 for a correct response, 0.0 otherwise.

    Args:
        prompts: The prompts (unused; kept so every reward function has the same signature).
        responses: Generated responses, one per prompt.
        answers: Reference answers, one per prompt.

    Returns:
        One reward per response.
    """
    if not (len(prompts) == len(responses) == len(answers)):
        raise ValueError(f"reward: got {len(prompts)} prompts, {len(responses)} responses and {len(answers)} answers")
    return [1.0 if is_correct(r, a) else 0.0 for r, a in zip(responses, answers)]


def tokenizer_corpus(max_operand: int = DEFAULT_MAX_OPERAND) -> list[str]:
    """Texts to train the tokenizer on: every prompt, answer and full example the task can produce.

    Also covers every integer up to a few hundred (wrong answers and larger operands), operators and whitespace.
    The tokenizer's byte-level alphabet encodes any text regardless; the corpus decides which merges exist.
    """
    _check_max_operand(max_operand)
    texts: list[str] = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            prompt = format_prompt(a, b)
            texts.append(prompt)
            texts.append(prompt + str(a + b))
    top = max(2 * max_operand + 10, 200)
    texts.extend(str(i) for i in range(-10, top + 1))
    texts.extend(["+", "=", "-", "*", "/", " ", "\n", "\t", " + ", " = ", "0123456789"])
    return texts


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping]) -> str:
    """Write rows as JSON lines, atomically.

    The rows go to a temporary file in the same directory which then replaces ``path``, so a crash never leaves
    a half-written file that a later run would mistake for a complete dataset.

    Args:
        path: Destination; parent directories are created.
        rows: JSON-serialisable mappings, one per line.

    Returns:
        ``path`` as a string.
    """
    return write_text_atomic(path, (json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
