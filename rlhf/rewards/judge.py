"""An LLM judge (generative reward model): a language model asked, through a prompt template, to grade a response
(``mode="score"``: a number in ``[score_min, score_max]``) or to pick the better of two (``mode="pairwise"``: ``A``
or ``B``), its answer parsed by a regular expression.

The LLM-as-a-judge recipe of Zheng et al. 2023, "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena": single
answer grading, and pairwise comparison asked both ways (A/B, then B/A) because judges favour a position.
Departures: the judge's answer is greedy by default (``temperature=0``: a reward must not be a coin flip), and a
pairwise verdict is a probability ``P(A better)`` (1, 0, or 0.5 for a tie) that :func:`win_rates` averages over
both orders, so a judge that always says "A" gives every response 0.5, not a bias.

This module is the judge over any generation backend with the rollout engines' signature (:class:`JudgeEngines`);
the spec, the parsing and the win-rate maths are :mod:`rlhf.rewards.judge_spec` (pure, re-exported here);
:func:`rlhf.rollout.vllm.judge_engines.start_judge` starts vLLM engines of the judge model and builds the
:class:`LLMJudge` over them (the rollout layer owns the engines; this layer must not import it).

**Templates.** A Python format string over ``{prompt}`` and ``{response}`` (score) or ``{prompt}``,
``{response_a}`` and ``{response_b}`` (pairwise), plus any column of the prompt rows (``{answer}``). Only plain
names are allowed (no ``{0}``, ``{x.attr}``, ``{x[0]}``); literal braces are doubled (``{{``). The text is sent as
one user message through the judge tokenizer's chat template when it has one (with the generation prompt), else
as plain text; :attr:`JudgeSpec.answer_prefix` is appended after it, so the judge's answer starts there (a prefill:
``"Score: "`` makes the next token the score) and the parse pattern sees prefix + generated text.

**Failures.** An answer the pattern does not match, a number outside the range under ``out_of_range="refuse"``,
or a judge prompt too long for ``max_model_len`` is an unparsable sample: ``on_unparsable`` decides, as
``on_error`` does for the other reward sources (:mod:`rlhf.rewards.results`): ``"fail"`` raises naming the sample
and quoting the judge's text, ``"drop"`` (score mode) marks the sample failed, a number stands in (score mode: in
the output scale, after normalisation; pairwise: as ``P(A better)``, 0.5 a tie). Every one is counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from rlhf.rewards.functions import clip_preview
from rlhf.rewards.judge_spec import (
    KEY,
    PAIRWISE,
    JudgeError,
    JudgeSpec,
    ordered_pairs,
    parse_preference,
    parse_score,
    template_fields,
    win_rates,
)
from rlhf.rewards.results import Failure, OnError, ScoreResult, assemble, check_on_error

__all__ = [
    "JudgeEngines",
    "JudgeError",
    "JudgeSpec",
    "Judgement",
    "LLMJudge",
    "ordered_pairs",
    "parse_preference",
    "parse_score",
    "template_fields",
    "win_rates",
]


class JudgeEngines(Protocol):
    """What the judge generates with: :class:`rlhf.rollout.vllm.engines.RolloutEngines` (batched, results in prompt
    order, each with ``prompt_ids`` and ``response_ids``)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: Any) -> Sequence[Any]: ...


@dataclass(frozen=True)
class Judgement:
    """One judge call: ``index`` is the sample (score) or comparison (pairwise, see :meth:`LLMJudge.compare`);
    ``text`` is prefix + the judge's answer (``None``: not asked, the prompt was too long); ``value`` the parsed
    reward or ``P(A better)`` (``None``: unparsable, ``why`` says so)."""

    index: int
    prompt_ids: Tuple[int, ...]
    text: Optional[str]
    value: Optional[float]
    why: str = ""


class LLMJudge:
    """A reward source whose values come from a judge model (module docstring).

    :meth:`score` returns a :class:`~rlhf.rewards.results.ScoreResult` like the reward pool and
    :class:`~rlhf.rewards.remote.HttpReward`; calling the object with the reward-function signature
    ``(prompts, responses, **columns) -> list of floats`` lets it stand in a reward source (``"drop"`` cannot be
    expressed there and raises). :attr:`last_judgements` keeps the last call's judge texts and parsed values;
    :meth:`sample_log` the first ``spec.log_samples`` of them, :meth:`metrics` the counts.

    Args:
        spec: The judge.
        engines: The generation backend (:class:`JudgeEngines`).
        tokenizer: The judge model's tokenizer (renders the chat template, decodes the answers).
        sampling: What ``engines.generate`` takes for ``spec``'s sampling
            (:func:`rlhf.rollout.vllm.judge_engines.judge_sampling`).
    """

    def __init__(self, spec: JudgeSpec, engines: JudgeEngines, tokenizer: Any, sampling: Any) -> None:
        self.spec, self.engines, self.tokenizer, self.sampling = spec, engines, tokenizer, sampling
        self.on_unparsable: OnError = check_on_error(spec.on_unparsable, f"{KEY}on_unparsable")
        self.last_result: Optional[ScoreResult] = None
        self.last_judgements: Tuple[Judgement, ...] = ()
        self._seconds = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:
        return f"LLMJudge({self.spec.path!r}, mode={self.spec.mode!r}, on_unparsable={self.on_unparsable!r})"

    def shutdown(self) -> None:
        """Stop the engines (when the backend can)."""
        stop = getattr(self.engines, "shutdown", None)  # a backend object, not a config: fakes have no shutdown
        if stop is not None:
            stop()

    # ------------------------------------------------------------------------------------------- rendering

    def render(self, values: Mapping[str, Any], sample: int) -> str:
        """The template filled with ``values`` (prompt, response(s), columns). Raises :class:`JudgeError` naming
        the missing field, the sample and what there is."""
        try:
            return self.spec.template.format_map({k: str(v) for k, v in values.items()})
        except KeyError as e:
            raise JudgeError(
                f"LLM judge {self.name}: {KEY}template uses {{{e.args[0]}}}, which sample {sample} does not have "
                f"(it has {', '.join(sorted(values))}): add that column to the prompt rows or fix the template"
            ) from None

    def prompt_ids(self, text: str) -> List[int]:
        """The token ids the judge sees for a rendered question: the chat template's user turn and generation
        prompt (no special tokens added: the template writes them), or the plain text; then the answer prefix."""
        template = getattr(self.tokenizer, "chat_template", None)  # a tokenizer attribute, None without one
        if template:
            chat = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(chat + self.spec.answer_prefix, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(text + self.spec.answer_prefix)["input_ids"])

    # --------------------------------------------------------------------------------------------- judging

    def _ask(self, questions: Sequence[str]) -> List[Tuple[Tuple[int, ...], Optional[str], str]]:
        """``(prompt_ids, prefix + answer or None, why None)`` per question, in one batched ``generate``; a prompt
        with no room for the answer in ``max_model_len`` is not sent."""
        ids = [self.prompt_ids(q) for q in questions]
        room = self.spec.max_model_len - self.spec.max_new_tokens
        sent = [i for i, p in enumerate(ids) if len(p) <= room]
        gens = self.engines.generate([ids[i] for i in sent], self.sampling) if sent else []
        out: List[Tuple[Tuple[int, ...], Optional[str], str]] = [
            (
                tuple(p),
                None,
                f"its judge prompt has {len(p)} tokens; with {KEY}max_new_tokens={self.spec.max_new_tokens} it "
                f"exceeds {KEY}max_model_len={self.spec.max_model_len}",
            )
            for p in ids
        ]
        for i, gen in zip(sent, gens):
            answer = self.tokenizer.decode(list(gen.response_ids), skip_special_tokens=True)
            out[i] = (tuple(gen.prompt_ids), self.spec.answer_prefix + answer, "")
        return out

    def _judge(self, questions: Sequence[str], parse) -> List[Judgement]:
        began = time.perf_counter()
        judgements = []
        for i, (ids, text, why) in enumerate(self._ask(questions)):
            value, why = parse(text, self.spec) if text is not None else (None, why)
            judgements.append(Judgement(i, ids, text, value, why))
        self.last_judgements = tuple(judgements)
        self._seconds = time.perf_counter() - began
        return judgements

    def _message(self, j: Judgement, what: str) -> str:
        said = "the judge was not asked:" if j.text is None else f"the judge's answer {clip_preview(j.text)}"
        return f"LLM judge {self.name}: {what}: {said} {j.why}"

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        columns: Optional[Mapping[str, Sequence]] = None,
        groups: Optional[Sequence[int]] = None,
    ) -> ScoreResult:
        """Score ``N`` samples (float32 ``(N,)`` values under :attr:`name`), with masks and counts.

        Pairwise mode scores each response by its :func:`win_rates` among the responses of its group, at a cost of
        ``n * (n - 1)`` judge calls per group of ``n``. ``groups`` gives each sample's group id (the trainer passes
        the rollout's ``prompt_index``, the groups its advantages are computed over): the samples of one id form
        one group wherever they are, and samples of different ids never share one, whatever their prompt texts.
        Without ``groups`` (the reward-function form, :meth:`__call__`) a group is a run of consecutive samples
        with equal prompt texts, which merges two groups of one text side by side and splits a group whose samples
        are not adjacent. An unparsable verdict under a stand-in marks both of its samples ``substituted`` (and
        counts once in ``errors``); nothing is ever ``failed``. Score mode ignores ``groups``.

        Raises:
            JudgeError: misaligned inputs, a template field a sample lacks, a pairwise group of one response, or
                with ``on_unparsable="fail"`` the first unparsable sample (named, the judge's text quoted).
        """
        cols = self._columns(len(prompts), len(responses), columns or {})
        if self.spec.mode == PAIRWISE:
            result = self._score_pairwise(list(prompts), list(responses), cols, groups)
        else:
            questions = [
                self.render({**_row(cols, i), "prompt": p, "response": r}, i)
                for i, (p, r) in enumerate(zip(prompts, responses))
            ]
            judgements = self._judge(questions, parse_score)
            failures = [
                Failure(
                    j.index,
                    self.name,
                    "error",
                    self._message(
                        j,
                        f"sample {j.index} (prompt={clip_preview(prompts[j.index])}; "
                        f"response={clip_preview(responses[j.index])})",
                    ),
                )
                for j in judgements
                if j.value is None
            ]
            if failures and self.on_unparsable == "fail":  # assemble would raise too, but not a JudgeError
                more = f" (and {len(failures) - 1} more unparsable samples)" if len(failures) > 1 else ""
                raise JudgeError(failures[0].message + more)
            values = {self.name: [j.value for j in judgements]}
            result = assemble([(self.name, self.spec.weight)], values, failures, self.on_unparsable, self._seconds)
        self.last_result = result
        return result

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **columns: Sequence) -> List[float]:
        """The reward-function form: one float per sample (``"drop"`` raises: it needs :meth:`score`'s mask)."""
        result = self.score(prompts, responses, columns)
        if bool(result.failed.any()):
            raise JudgeError(
                f"{result.failures[0].message}; on_unparsable='drop' needs the failed mask, which the "
                f"reward-function form cannot return: use LLMJudge.score"
            )
        return result.per_source[self.name].tolist()

    def compare(
        self,
        prompts: Sequence[str],
        responses_a: Sequence[str],
        responses_b: Sequence[str],
        columns: Optional[Mapping[str, Sequence]] = None,
    ) -> torch.Tensor:
        """``P(A better)`` per pair, float64 ``(N,)``: 1.0 (A), 0.0 (B), 0.5 (tie) or the ``on_unparsable``
        stand-in (the count is in :meth:`metrics`). One judge call per pair, in this order only: compare both ways
        (or use :meth:`score` / :func:`win_rates`) to cancel the judge's position bias.

        Raises:
            JudgeError: with ``on_unparsable="fail"`` for the first unparsable pair (named, the judge's text quoted).
        """
        if self.spec.mode != PAIRWISE:
            raise JudgeError(f"LLM judge {self.name}: compare needs {KEY}mode=pairwise, not {self.spec.mode!r}")
        cols = self._columns(len(prompts), len(responses_a), columns or {})
        if len(responses_b) != len(prompts):
            raise JudgeError(f"LLM judge {self.name}: {len(prompts)} prompts but {len(responses_b)} responses B")
        questions = [
            self.render({**_row(cols, i), "prompt": p, "response_a": a, "response_b": b}, i)
            for i, (p, a, b) in enumerate(zip(prompts, responses_a, responses_b))
        ]
        judgements = self._judge(questions, parse_preference)
        bad = [j for j in judgements if j.value is None]
        if bad and self.on_unparsable == "fail":
            more = f" (and {len(bad) - 1} more unparsable pairs)" if len(bad) > 1 else ""
            raise JudgeError(
                self._message(bad[0], f"pair {bad[0].index} (prompt={clip_preview(prompts[bad[0].index])})") + more
            )
        stand_in = float(self.on_unparsable) if not isinstance(self.on_unparsable, str) else 0.5
        return torch.tensor([stand_in if j.value is None else j.value for j in judgements], dtype=torch.float64)

    def _pairwise_groups(self, prompts: List[str], groups: Optional[Sequence[int]]) -> List[List[int]]:
        """Each group's sample indices (:meth:`score`), groups in order of first appearance so that the judge calls
        come in a deterministic order. A group of one cannot be ranked: raises naming the sample."""
        if groups is not None and len(groups) != len(prompts):
            raise JudgeError(f"LLM judge {self.name}: got {len(groups)} group ids for {len(prompts)} samples")
        ids = None if groups is None else [int(g) for g in groups]  # a tensor's elements hash by identity
        members = [list(range(s, e)) for s, e in _runs(prompts)] if ids is None else _by_group(ids)
        lone = next((g[0] for g in members if len(g) < 2), None)
        if lone is not None:
            where = "next to it" if ids is None else f"in its group (group {ids[lone]})"
            raise JudgeError(
                f"LLM judge {self.name}: pairwise judging ranks the responses of a prompt among themselves; sample "
                f"{lone} (prompt={clip_preview(prompts[lone])}) has no other response {where} "
                f"(sample at least 2 responses per prompt)"
            )
        return members

    def _score_pairwise(
        self, prompts: List[str], responses: List[str], cols: Dict[str, list], groups: Optional[Sequence[int]]
    ) -> ScoreResult:
        members = self._pairwise_groups(prompts, groups)
        pairs = [(g[i], g[j]) for g in members for i, j in ordered_pairs(len(g))]
        p_a = self.compare(
            [prompts[i] for i, _ in pairs],
            [responses[i] for i, _ in pairs],
            [responses[j] for _, j in pairs],
            {k: [c[i] for i, _ in pairs] for k, c in cols.items()},
        )
        rates = torch.zeros(len(prompts), dtype=torch.float64)
        at = 0
        for g in members:  # p_a holds each group's n(n-1) verdicts in ordered_pairs order
            n = len(g)
            grid = torch.zeros(n, n, dtype=torch.float64)
            grid[~torch.eye(n, dtype=torch.bool)] = p_a[at : at + n * (n - 1)]
            rates[g] = win_rates(grid)
            at += n * (n - 1)
        substituted = torch.zeros(len(prompts), dtype=torch.bool)
        failures = []
        for j in self.last_judgements:
            if j.value is None:
                a, b = pairs[j.index]
                substituted[[a, b]] = True
                failures.append(Failure(a, self.name, "error", self._message(j, f"samples {a} (A) vs {b} (B)")))
        values = rates.float()
        return ScoreResult(
            total=(self.spec.weight * rates).float(),
            per_source={self.name: values},
            failed=torch.zeros(len(prompts), dtype=torch.bool),
            substituted=substituted,
            errors=len(failures),
            seconds=self._seconds,
            failures=tuple(sorted(failures, key=lambda f: f.index)),
        )

    # --------------------------------------------------------------------------------------------- logging

    def sample_log(self) -> List[Dict[str, Any]]:
        """The first ``spec.log_samples`` judgements of the last call: index, judge text, parsed value, why not."""
        return [
            {"index": j.index, "judge_text": j.text, "value": j.value, "why": j.why}
            for j in self.last_judgements[: self.spec.log_samples]
        ]

    def metrics(self, prefix: str = "judge/") -> Dict[str, float]:
        """The last call's judge calls, unparsable answers, mean parsed value and seconds per call."""
        calls = len(self.last_judgements)
        parsed = [j.value for j in self.last_judgements if j.value is not None]
        out = {
            f"{prefix}calls": float(calls),
            f"{prefix}unparsable": float(calls - len(parsed)),
            f"{prefix}seconds_per_call": self._seconds / calls if calls else 0.0,
        }
        if parsed:  # no mean of nothing (a NaN in the metrics would read as a diverged run)
            out[f"{prefix}mean_value"] = sum(parsed) / len(parsed)
        return out

    def _columns(self, n: int, n_responses: int, columns: Mapping[str, Sequence]) -> Dict[str, list]:
        cols = {key: list(column) for key, column in columns.items()}
        if n_responses != n or any(len(c) != n for c in cols.values()):
            raise JudgeError(
                f"LLM judge {self.name}: got {n} prompts, {n_responses} responses and columns of lengths "
                f"{ {key: len(c) for key, c in cols.items()} }; each needs one value per prompt"
            )
        clash = sorted(set(cols) & {"prompt", "response", "response_a", "response_b"})
        if clash:
            raise JudgeError(
                f"LLM judge {self.name}: a column may not be named {clash[0]!r} (the template's own field)"
            )
        return cols


def _row(cols: Mapping[str, Sequence], i: int) -> Dict[str, Any]:
    return {key: column[i] for key, column in cols.items()}


def _by_group(groups: Sequence[int]) -> List[List[int]]:
    """The sample indices of each group id, in order of the ids' first appearance (a dict keeps insertion order)."""
    members: Dict[int, List[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return list(members.values())


def _runs(prompts: Sequence[str]) -> List[Tuple[int, int]]:
    """``[start, end)`` of each run of equal consecutive prompts (the groups when no group ids are given)."""
    runs: List[Tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
