"""The LLM judge's spec, the parsing of its answers and the pairwise win-rate maths: pure, no engines. The judge
itself, and the templates, answers and failure policies in full: :mod:`rlhf.rewards.judge`."""

from __future__ import annotations

import math
import numbers
import os
import re
import string
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from rlhf.config.schema import ConfigError
from rlhf.rewards.functions import RewardFunctionError
from rlhf.rewards.results import OnError, check_on_error

__all__ = [
    "JudgeError",
    "JudgeSpec",
    "ordered_pairs",
    "parse_preference",
    "parse_score",
    "template_fields",
    "win_rates",
]

SCORE, PAIRWISE = "score", "pairwise"
# The number after "score" ("Score: 7", "score = 8.5"). First match wins.
DEFAULT_SCORE_PATTERN = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
# A, B or tie, first thing in the answer or after answer/verdict/winner/better ("[[A]]", "Verdict: B"). A and B are
# upper case only: a lower-case "a" is the article.
DEFAULT_PAIRWISE_PATTERN = r"(?:^|[Aa]nswer|[Vv]erdict|[Ww]inner|[Bb]etter)\W*\b(A|B|[Tt]ie|TIE)\b"
_PREFERENCE = {"A": 1.0, "B": 0.0, "TIE": 0.5}
_NORMALIZE = ("unit", "none")
_OUT_OF_RANGE = ("clamp", "refuse")
KEY = "reward.judge."  # the config keys' prefix: errors name reward.judge.<field>


class JudgeError(RewardFunctionError):
    """A judge that cannot render a sample's prompt, or whose answer cannot be parsed under ``on_unparsable="fail"``;
    the message names the sample and quotes the judge's text."""


def template_fields(template: str, where: str = f"{KEY}template") -> Tuple[str, ...]:
    """The names a template fills, in order of first use. Raises ``ValueError`` naming ``where`` for a template
    ``str.format`` cannot parse, a positional field (``{}``, ``{0}``) or an attribute / index (``{x.y}``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{where}: not a valid format string ({e}); write literal braces as {{{{ and }}}}") from None
    names: List[str] = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(
                f"{where}: field {{{name}}} is not a plain name; use {{prompt}}, {{response}}, a column name, "
                f"and double literal braces"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class JudgeSpec:
    """How the judge is asked and how its answer becomes a reward. Validated at construction; an error names the
    config key ``reward.judge.<field>``.

    Attributes:
        path: The judge model (a local HF directory or a hub reference), served by vLLM engines.
        template: The question (module docstring); must use ``{response}`` (score) or both ``{response_a}`` and
            ``{response_b}`` (pairwise).
        mode: ``"score"`` or ``"pairwise"``.
        pattern: A regular expression with one group, searched in prefix + answer: the number (score) or
            ``A`` / ``B`` / ``tie`` (pairwise). ``None``: the mode's default.
        answer_prefix: Text after the rendered prompt that the answer continues (``"Score: "``).
        max_new_tokens, temperature, seed: The judge's sampling; ``temperature=0`` is greedy (deterministic).
        score_min, score_max: The score range (score mode).
        normalize: ``"unit"`` maps the range to ``[0, 1]``; ``"none"`` keeps the judge's number.
        out_of_range: ``"clamp"`` a number outside the range to it, or ``"refuse"`` it (an unparsable answer).
        on_unparsable: ``"fail"``, ``"drop"`` (score mode) or a stand-in value (module docstring).
        weight: The source's weight in :attr:`ScoreResult.total`.
        max_model_len: The judge engines' context; a judge prompt that leaves no room for ``max_new_tokens``
            is not sent (unparsable, with the reason).
        log_samples: How many judgements :meth:`LLMJudge.sample_log` returns for logging.
    """

    path: str
    template: str
    mode: str = SCORE
    pattern: Optional[str] = None
    answer_prefix: str = ""
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    score_min: float = 0.0
    score_max: float = 10.0
    normalize: str = "unit"
    out_of_range: str = "clamp"
    on_unparsable: OnError = "fail"
    weight: float = 1.0
    max_model_len: int = 2048
    log_samples: int = 4

    @classmethod
    def of(cls, keys, seed: int = 0) -> "JudgeSpec":
        """The spec of a run's ``reward.judge.*`` (:class:`rlhf.config.rl_schema.JudgeConfig`), ``seed`` the run's;
        a bad key is a :class:`~rlhf.config.schema.ConfigError` naming it."""
        on_unparsable = keys.on_unparsable if keys.on_unparsable in ("fail", "drop") else float(keys.on_unparsable)
        try:
            return cls(
                path=keys.path,
                template=keys.template,
                mode=keys.mode,
                pattern=keys.pattern or None,
                answer_prefix=keys.answer_prefix,
                max_new_tokens=keys.max_new_tokens,
                temperature=keys.temperature,
                seed=seed,
                score_min=keys.score_min,
                score_max=keys.score_max,
                normalize=keys.normalize,
                out_of_range=keys.out_of_range,
                on_unparsable=on_unparsable,
                weight=keys.weight,
                max_model_len=keys.max_model_len,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"{KEY}path: the judge model is required, got {self.path!r}")
        for key, text in (("template", self.template), ("answer_prefix", self.answer_prefix)):
            if not isinstance(text, str):
                raise ValueError(f"{KEY}{key} must be a string, got {text!r}")
        if self.mode not in (SCORE, PAIRWISE):
            raise ValueError(f"{KEY}mode must be one of {SCORE!r}, {PAIRWISE!r}; got {self.mode!r}")
        names = template_fields(self.template)
        needed = ("response",) if self.mode == SCORE else ("response_a", "response_b")
        missing = [n for n in needed if n not in names]
        if missing:
            raise ValueError(
                f"{KEY}template: a {self.mode} judge's template must use "
                f"{', '.join('{' + n + '}' for n in needed)}; missing {', '.join('{' + n + '}' for n in missing)}"
            )
        try:
            groups = re.compile(self.pattern_or_default).groups
        except re.error as e:
            raise ValueError(f"{KEY}pattern: not a regular expression ({e}): {self.pattern!r}") from None
        if groups != 1:
            raise ValueError(f"{KEY}pattern must have exactly one group (the answer), has {groups}: {self.pattern!r}")
        for key, count, low in (
            ("max_new_tokens", self.max_new_tokens, 1),
            ("max_model_len", self.max_model_len, 2),
            ("log_samples", self.log_samples, 0),
            ("seed", self.seed, 0),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < low:
                raise ValueError(f"{KEY}{key} must be an int >= {low}, got {count!r}")
        if self.max_new_tokens >= self.max_model_len:  # else no judge prompt is ever sent: each sample unparsable
            raise ValueError(
                f"{KEY}max_new_tokens ({self.max_new_tokens}) must be < {KEY}max_model_len ({self.max_model_len}): "
                f"the judge's prompt and its answer share the context, and a prompt only gets what the answer leaves"
            )
        for key, number in (
            ("temperature", self.temperature),
            ("weight", self.weight),
            ("score_min", self.score_min),
            ("score_max", self.score_max),
        ):
            if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number):
                raise ValueError(f"{KEY}{key} must be a finite number, got {number!r}")
        if self.temperature < 0:
            raise ValueError(f"{KEY}temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.score_min >= self.score_max:
            raise ValueError(f"{KEY}score_min < {KEY}score_max must hold, got {self.score_min}, {self.score_max}")
        if self.normalize not in _NORMALIZE:
            raise ValueError(f"{KEY}normalize must be one of {', '.join(_NORMALIZE)}; got {self.normalize!r}")
        if self.out_of_range not in _OUT_OF_RANGE:
            raise ValueError(f"{KEY}out_of_range must be one of {', '.join(_OUT_OF_RANGE)}; got {self.out_of_range!r}")
        on = check_on_error(self.on_unparsable, f"{KEY}on_unparsable")
        if self.mode == PAIRWISE and (on == "drop" or (isinstance(on, float) and not 0.0 <= on <= 1.0)):
            raise ValueError(
                f"{KEY}on_unparsable for a pairwise judge must be 'fail' or a stand-in P(A better) in [0, 1] "
                f"(0.5: a tie), got {self.on_unparsable!r}"
            )

    @property
    def own_fields(self) -> Tuple[str, ...]:
        """The template fields the judge fills itself (:meth:`rlhf.rewards.judge.LLMJudge.score`)."""
        return ("prompt", "response") if self.mode == SCORE else ("prompt", "response_a", "response_b")

    @property
    def column_fields(self) -> Tuple[str, ...]:
        """The template's other fields: each sample must have them as columns (``reward.columns``), or rendering its
        question fails at the first scoring, after every actor started."""
        return tuple(f for f in template_fields(self.template) if f not in self.own_fields)

    @property
    def pattern_or_default(self) -> str:
        if self.pattern is not None:
            return self.pattern
        return DEFAULT_SCORE_PATTERN if self.mode == SCORE else DEFAULT_PAIRWISE_PATTERN

    @property
    def name(self) -> str:
        """``judge:<model basename>``: the reward source's name in metrics and messages."""
        return f"judge:{os.path.basename(self.path.rstrip('/')) or self.path}"


# ------------------------------------------------------------------------------------------------ parsing (pure)


def parse_score(text: str, spec: JudgeSpec) -> Tuple[Optional[float], str]:
    """``(value, why)``: the reward ``text`` (prefix + answer) gives, or ``None`` and why it gives none.

    The pattern's group must be a finite number; outside ``[score_min, score_max]`` it is clamped or refused
    (``out_of_range``); ``normalize="unit"`` maps the range linearly to ``[0, 1]``.
    """
    match = re.search(spec.pattern_or_default, text)
    if match is None:
        return None, f"does not match {KEY}pattern {spec.pattern_or_default!r}"
    try:
        value = float(match.group(1))
    except (TypeError, ValueError):
        return None, f"{KEY}pattern's group {match.group(1)!r} is not a number"
    if not math.isfinite(value):
        return None, f"{KEY}pattern's group {match.group(1)!r} is not a finite number"
    low, high = spec.score_min, spec.score_max
    if not low <= value <= high:
        if spec.out_of_range == "refuse":
            return None, f"gives {value:g}, outside [{low:g}, {high:g}] ({KEY}out_of_range=refuse)"
        value = min(max(value, low), high)
    return ((value - low) / (high - low) if spec.normalize == "unit" else value), ""


def parse_preference(text: str, spec: JudgeSpec) -> Tuple[Optional[float], str]:
    """``(P(A better), why)``: 1.0 for ``A``, 0.0 for ``B``, 0.5 for a tie, or ``None`` and why."""
    match = re.search(spec.pattern_or_default, text)
    if match is None:
        return None, f"does not match {KEY}pattern {spec.pattern_or_default!r}"
    verdict = (match.group(1) or "").strip().upper()
    if verdict not in _PREFERENCE:
        return None, f"{KEY}pattern's group {match.group(1)!r} is none of A, B, tie"
    return _PREFERENCE[verdict], ""


# ------------------------------------------------------------------------------------------- win rates (pure)


def ordered_pairs(n: int) -> List[Tuple[int, int]]:
    """Every ``(i, j)`` with ``i != j`` among ``n`` responses, row by row: the ``n * (n - 1)`` comparisons (response
    ``i`` shown as A, ``j`` as B) that :func:`win_rates` needs."""
    return [(i, j) for i in range(n) for j in range(n) if i != j]


def win_rates(p_a: torch.Tensor) -> torch.Tensor:
    """Each response's win rate in its group from both-ways pairwise verdicts.

    Args:
        p_a: ``(..., n, n)``, ``p_a[..., i, j]`` = P(response ``i`` shown as A beats response ``j`` shown as B);
            the diagonal is ignored. ``n >= 2``.

    Returns:
        ``(..., n)`` in ``[0, 1]``: ``w_i = 1 / (n - 1) * sum_{j != i} (p_a[i, j] + 1 - p_a[j, i]) / 2``, i's
        chance of beating a random other response, averaged over the two orders so that a position bias (a judge
        that prefers A whatever it sees) cancels. Over a group the rates sum to ``n / 2``.
    """
    n = p_a.shape[-1]
    if p_a.shape[-2] != n or n < 2:
        raise ValueError(f"win_rates needs (..., n, n) verdicts with n >= 2, got shape {tuple(p_a.shape)}")
    off = ~torch.eye(n, dtype=torch.bool, device=p_a.device)
    wins = (p_a + 1.0 - p_a.transpose(-1, -2)) / 2.0  # (..., n, n): i beats j, the two orders averaged
    return (wins * off).sum(-1) / (n - 1)
