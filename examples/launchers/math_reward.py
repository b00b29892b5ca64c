"""Rule-based reward for math prompts with a reference answer (GSM8K-style), used by the GRPO launchers.

Prompt rows carry the reference in an ``answer`` field (``{"prompt": ..., "answer": "72"}``; a GSM8K solution
ending in ``#### 72`` also works). The reward is 1.0 when the response's final answer equals it, else 0.0. The
final answer is the content of the last ``\\boxed{...}`` if there is one (what the launchers' prompts ask for),
else the last number in the response.

Named in the configs as ``examples/launchers/math_reward.py:correct_answer``: a path relative to the job's working
directory, the repository root (``ray job submit --working-dir .``).
"""

from __future__ import annotations

import re
from typing import List, Optional

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> Optional[float]:
    """The last number in ``text`` (thousands separators and a trailing ``.0`` allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def final_answer(response: str) -> Optional[float]:
    """The number a response ends on: its last ``\\boxed{}``, else its last number."""
    boxed = _BOXED.findall(response)
    return _number(boxed[-1]) if boxed else _number(response)


def reference(answer: str) -> Optional[float]:
    """The reference number; for a GSM8K solution, what follows ``####``."""
    return _number(str(answer).rsplit("####", 1)[-1])


def correct_answer(prompts: List[str], responses: List[str], answers: List[str]) -> List[float]:
    """1.0 for a response whose final answer equals the reference (to 1e-6), else 0.0; one per response."""
    rewards = []
    for response, answer in zip(responses, answers):
        got, want = final_answer(response), reference(answer)
        rewards.append(1.0 if got is not None and want is not None and abs(got - want) < 1e-6 else 0.0)
    return rewards
