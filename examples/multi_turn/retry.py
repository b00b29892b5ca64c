"""An answer / feedback / retry environment on the synthetic addition task.

Prompts are rows ``{"prompt": "12+7=", "answer": "19"}``. Turn 1 answers; a wrong answer gets feedback and the
question again, and turn 2 is the one retry::

    12+7=18</s>higher
    12+7=19</s>
    ^turn 1   ^observation: which way the answer lies, then the question again   ^turn 2

Rewards: :attr:`Retry.FIRST_REWARD` (1.0) right at the first try, :attr:`Retry.RETRY_REWARD` (0.5) right at the
retry, 0.0 otherwise; the episode is ``done`` after a right answer or after the retry. The feedback is
``higher`` / ``lower`` (the first integer of the answer against the right one) or ``a number`` when the answer
has no integer, then a newline and the prompt: the retry's context ends like a prompt the policy was trained to
answer, and the direction narrows the guess (a near miss, the tiny model's usual error, has one candidate left on
that side). ``reset`` returns ``""``: the prompt row is the whole first turn. Run it with ``rollout.max_turns >=
2``.

The file imports nothing but ``rlhf``: it is loaded by spec (``examples/multi_turn/retry.py:Retry``) in Ray
actors that do not have ``examples/`` on their path.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from rlhf.envs import Environment, StepOutcome
from rlhf.synthetic.arithmetic import extract_answer, is_correct


class Retry(Environment):
    """Answer, feedback, one retry (module docstring); one instance per episode."""

    FIRST_REWARD = 1.0
    RETRY_REWARD = 0.5
    TRIES = 2

    def __init__(self) -> None:
        self.prompt: Optional[str] = None
        self.answer: Optional[str] = None
        self.tries = 0

    @staticmethod
    def hint(response: str, answer: str) -> str:
        """``higher`` / ``lower``: where the right answer lies from the response's first integer; ``a number``
        when there is none."""
        got = extract_answer(response)
        if got is None:
            return "a number"
        return "higher" if int(got) < int(answer) else "lower"

    @classmethod
    def feedback_text(cls, response: str, answer: str, prompt: str) -> str:
        """The observation after a wrong first answer: the hint, a newline, the prompt again."""
        return f"{cls.hint(response, answer)}\n{prompt}"

    def reset(self, row: Mapping[str, Any]) -> str:
        self.prompt, self.answer, self.tries = str(row["prompt"]), str(row["answer"]), 0
        return ""

    def step(self, response: str, response_ids: Tuple[int, ...]) -> StepOutcome:
        self.tries += 1
        correct = is_correct(response, self.answer)
        info = {"tries": self.tries, "correct": correct}
        if correct:
            return StepOutcome(None, self.FIRST_REWARD if self.tries == 1 else self.RETRY_REWARD, True, info)
        if self.tries >= self.TRIES:
            return StepOutcome(None, 0.0, True, info)
        return StepOutcome(self.feedback_text(response, self.answer, self.prompt), 0.0, False, info)
