"""The environment protocol, what a step returns, the error that names the episode, and one episode run in-process.

An episode: ``obs = env.reset(row)``, then per turn the policy answers with a response and
``env.step(response, response_ids)`` returns a :class:`StepOutcome` ``(observation, reward, done, info)`` (or that
4-tuple), until ``done``. Turns are counted from 1 (the first ``step`` after ``reset``); ``reset`` is turn 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from rlhf.envs.rows import PromptRow
from rlhf.utils.specs import clip_plain

__all__ = ["Observation", "StepOutcome", "Environment", "EnvError", "LocalEpisode"]

#: An observation is text: the rollout side tokenizes it once (as text, or as a chat message:
#: ``rollout.observation_format``) and appends it to the conversation. A step may instead hand back the whole next
#: prompt as token ids (:attr:`StepOutcome.prompt_ids`).
Observation = str


class EnvError(ValueError):
    """An environment that cannot be loaded, raised, hung, died or returned something malformed.

    The message names the environment spec and, when an episode is at fault, the episode index, the turn and the
    cause (the original exception type and message); the same are attributes (``None`` when not known).
    """

    def __init__(
        self, message: str, spec: Optional[str] = None, episode: Optional[int] = None, turn: Optional[int] = None
    ) -> None:
        super().__init__(message)
        self.spec, self.episode, self.turn = spec, episode, turn

    def __reduce__(self):  # crosses process boundaries (Ray) with its attributes
        return (type(self), (str(self), self.spec, self.episode, self.turn))


@dataclass(frozen=True)
class StepOutcome:
    """What one turn of an environment returns.

    Attributes:
        observation: text to append to the conversation before the next turn (a tool result, a user reply), or
            ``None`` for nothing (usual when ``done``).
        reward: this turn's reward, a finite real number (stored as ``float``; bools are rejected).
        done: whether the episode has ended (a ``bool``); no further ``step`` is allowed after it.
        info: free-form, picklable details (logged, never trained on); copied into a plain ``dict``.
        prompt_ids: instead of ``observation``, the whole next prompt as token ids: the episode's tokens so far
            (as the policy sampled them) followed by the observation's. For an environment that keeps the
            conversation as tokens itself; the rollout checks that they extend the episode
            (``rollout.on_prefix_mismatch``) and appends the rest. Stored as a tuple of ``int``.

    Raises:
        ValueError: on construction, naming the field that is wrong.
    """

    observation: Optional[str] = None
    reward: float = 0.0
    done: bool = False
    info: Dict[str, Any] = field(default_factory=dict)
    prompt_ids: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.observation is not None and not isinstance(self.observation, str):
            raise ValueError(
                f"StepOutcome.observation must be a str or None, got {type(self.observation).__name__} "
                f"{clip_plain(repr(self.observation), 80)}"
            )
        r = self.reward
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(float(r)):
            raise ValueError(
                f"StepOutcome.reward must be a finite real number (not a bool; write float(ok)), got "
                f"{type(r).__name__} {clip_plain(repr(r), 80)}"
            )
        if not isinstance(self.done, bool):
            raise ValueError(
                f"StepOutcome.done must be a bool (write bool(...)), got {type(self.done).__name__} "
                f"{clip_plain(repr(self.done), 80)}"
            )
        if not isinstance(self.info, Mapping):
            raise ValueError(f"StepOutcome.info must be a dict, got {type(self.info).__name__}")
        if self.prompt_ids is not None:
            ids = self.prompt_ids
            if (
                isinstance(ids, (str, bytes))
                or not hasattr(ids, "__len__")
                or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise ValueError(
                    f"StepOutcome.prompt_ids must be a sequence of non-negative token ids, got "
                    f"{clip_plain(repr(ids), 80)}"
                )
            if self.observation is not None:
                raise ValueError(
                    "StepOutcome takes an observation as text or as the whole prompt's token ids (prompt_ids), not both"
                )
            object.__setattr__(self, "prompt_ids", tuple(int(t) for t in ids))
        object.__setattr__(self, "reward", float(r))
        object.__setattr__(self, "info", dict(self.info))

    @classmethod
    def coerce(cls, value: Any) -> "StepOutcome":
        """``value`` if it is a :class:`StepOutcome`, else one built from a 4-tuple ``(observation, reward, done,
        info)``; anything else is a ``ValueError`` saying what was returned."""
        if isinstance(value, cls):
            return value
        if isinstance(value, tuple) and len(value) == 4:
            return cls(*value)
        raise ValueError(
            f"step must return a StepOutcome or a tuple (observation, reward, done, info), got "
            f"{type(value).__name__} {clip_plain(repr(value), 80)}"
        )


class Environment:
    """Base class of environments (subclass it, or duck-type ``reset`` and ``step``).

    One instance runs one episode at a time; :class:`rlhf.envs.EnvironmentPool` makes a fresh instance per episode,
    with no constructor arguments. Instances may hold state (an interpreter, a sandbox); they live in a Ray actor,
    so they need not be picklable.
    """

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """Start an episode from a prompt row (all of its columns, e.g. ``{"prompt": ..., "answer": ...}``) and
        return the first observation (the text the policy answers first)."""
        raise NotImplementedError

    def step(self, response: str, response_ids: Tuple[int, ...]) -> StepOutcome:
        """Take the policy's answer to the last observation (its text and token ids) and return the outcome."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (called when the episode is closed; optional)."""


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {clip_plain(str(error), 500)}"


class LocalEpisode:
    """One episode of one environment instance, run in this process: counts turns, validates what the environment
    returns and turns any failure into an :class:`EnvError` naming ``spec``, ``index`` and the turn.

    Args:
        env: a fresh environment instance.
        spec: the environment's spec (for messages).
        index: the episode index (for messages).
    """

    def __init__(self, env: Any, spec: str, index: int) -> None:
        self.env, self.spec, self.index = env, spec, index
        self.turn = 0  # steps taken so far; the next step is turn + 1
        self.done = False

    def error(self, what: str, turn: int, phase: Optional[str] = None) -> EnvError:
        """``EnvError("environment 'SPEC' WHAT in PHASE (turn T of episode E)")``; the phase defaults to reset for
        turn 0, else step."""
        phase = phase or ("reset" if turn == 0 else "step")
        return EnvError(
            f"environment {self.spec!r} {what} in {phase} (turn {turn} of episode {self.index})",
            self.spec,
            self.index,
            turn,
        )

    def reset(self, row: Mapping[str, Any]) -> Observation:
        """``env.reset(row)``, which must return a ``str``."""
        try:
            observation = self.env.reset(PromptRow(row))  # a missing field names env.columns
        except Exception as e:
            raise self.error(f"raised {_cause(e)}", 0) from e
        if not isinstance(observation, str):
            raise self.error(
                f"returned {type(observation).__name__} {clip_plain(repr(observation), 80)} "
                f"(reset must return the first observation as a str)",
                0,
            )
        return observation

    def step(self, response: str, response_ids: Tuple[int, ...]) -> StepOutcome:
        """``env.step(response, response_ids)`` as a validated :class:`StepOutcome`; stepping a finished episode
        is an error."""
        turn = self.turn + 1
        if self.done:
            raise self.error(f"was stepped after its episode ended at turn {self.turn}", turn)
        try:
            result = self.env.step(response, tuple(response_ids))
        except Exception as e:
            raise self.error(f"raised {_cause(e)}", turn) from e
        try:
            outcome = StepOutcome.coerce(result)
        except ValueError as e:
            raise self.error(f"returned a bad outcome: {e}", turn) from None
        self.turn, self.done = turn, outcome.done
        return outcome

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:
                raise self.error(f"raised {_cause(e)}", self.turn, "close") from e
