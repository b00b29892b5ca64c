"""A tool-using environment: two-digit multiplication with a calculator the policy may call.

Prompts are rows ``{"prompt": "37*48=", "answer": "1776"}``. Each turn the policy either answers (the episode
ends: reward 1.0 if the first integer of the response is the answer, else 0.0) or calls the tool::

    37*48=<calc>37*48</calc></s><result>1776</result>1776</s>
    ^prompt ^turn 1: a call     ^EOS ^observation     ^turn 2: the answer

The tiny model cannot multiply two-digit numbers by itself (0-1% of its direct answers are right, measured in
examples/multi_turn/README.md), but copying a tool result it can: the contrast RL has to discover.

Rules (the class attributes say the numbers):

* A response containing ``<calc>`` is a call; the expression is what stands between it and the next ``</calc>``.
  It must be ``int op int`` with ``op`` one of ``+ - * /`` and operands of at most :attr:`MAX_OPERAND_DIGITS`
  digits; division must be exact. It is parsed, never ``eval``-ed. A good call observes ``<result>N</result>``, a
  malformed one ``<error>REASON</error>`` (``unclosed``, ``syntax``, ``too long``, ``division by zero``,
  ``inexact``); both count as calls and neither ends the episode.
* The call after the :attr:`MAX_CALLS`-th ends the episode with reward 0.0 (a policy that loops on the tool
  gets nothing, and the episode cannot grow without bound whatever ``rollout.max_turns`` is).
* ``reset`` returns ``""``: the prompt row is the whole first turn. Run it with ``rollout.max_turns >=
  MAX_CALLS + 1`` so that an answer after the last allowed call is still possible.

The file imports nothing but ``re`` and ``rlhf``: it is loaded by spec (``examples/multi_turn/calculator.py:
Calculator``) in Ray actors that do not have ``examples/`` on their path.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Tuple

from rlhf.envs import Environment, StepOutcome
from rlhf.synthetic.arithmetic import is_correct

_OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ToolError(ValueError):
    """A call the calculator refuses; ``str(error)`` is the short reason shown to the policy."""


class Calculator(Environment):
    """Multiplication with an optional calculator call (module docstring); one instance per episode."""

    CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
    MAX_CALLS = 2
    MAX_OPERAND_DIGITS = 6
    # Longer expressions are refused before any parsing: a policy that babbles inside a call costs nothing.
    MAX_EXPRESSION_CHARS = 2 * MAX_OPERAND_DIGITS + 8

    def __init__(self) -> None:
        self.answer: Optional[str] = None
        self.calls = 0

    # ------------------------------------------------------------------ the text formats (data.py uses them too)
    @classmethod
    def call_text(cls, expression: str) -> str:
        """What a call looks like in a response: ``<calc>37*48</calc>``."""
        return f"{cls.CALL_OPEN}{expression}{cls.CALL_CLOSE}"

    @staticmethod
    def result_text(value: int) -> str:
        """The observation after a good call: ``<result>1776</result>``."""
        return f"<result>{value}</result>"

    @staticmethod
    def error_text(reason: str) -> str:
        """The observation after a malformed call: ``<error>syntax</error>``."""
        return f"<error>{reason}</error>"

    @classmethod
    def is_call(cls, response: str) -> bool:
        """Whether a response is a tool call (well-formed or not)."""
        return cls.CALL_OPEN in response

    @classmethod
    def evaluate(cls, response: str) -> int:
        """The value of the response's call, parsed as ``int op int``; :class:`ToolError` with a short reason
        when the call is malformed."""
        start = response.index(cls.CALL_OPEN) + len(cls.CALL_OPEN)
        end = response.find(cls.CALL_CLOSE, start)
        if end < 0:
            raise ToolError("unclosed")
        expression = response[start:end]
        if len(expression) > cls.MAX_EXPRESSION_CHARS:
            raise ToolError("too long")
        digits = cls.MAX_OPERAND_DIGITS  # ASCII digits only: \d would also take other scripts' digits
        match = re.fullmatch(rf"\s*(-?[0-9]{{1,{digits}}})\s*([-+*/])\s*(-?[0-9]{{1,{digits}}})\s*", expression)
        if match is None:
            raise ToolError("syntax")
        a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
        if op != "/":
            return _OPERATIONS[op](a, b)
        if b == 0:
            raise ToolError("division by zero")
        if a % b:
            raise ToolError("inexact")  # an integer tool: a fraction would be an answer no row asks for
        return a // b

    # ------------------------------------------------------------------ the environment
    def reset(self, row: Mapping[str, Any]) -> str:
        self.answer, self.calls = str(row["answer"]), 0
        return ""

    def step(self, response: str, response_ids: Tuple[int, ...]) -> StepOutcome:
        if not self.is_call(response):
            correct = is_correct(response, self.answer)
            return StepOutcome(None, float(correct), True, {"tool_calls": self.calls, "correct": correct})
        self.calls += 1
        if self.calls > self.MAX_CALLS:
            return StepOutcome(None, 0.0, True, {"tool_calls": self.calls, "correct": False, "ended": "tool_limit"})
        try:
            observation = self.result_text(self.evaluate(response))
            info = {"tool_calls": self.calls}
        except ToolError as e:
            observation, info = self.error_text(str(e)), {"tool_calls": self.calls, "tool_error": str(e)}
        return StepOutcome(observation, 0.0, False, info)
