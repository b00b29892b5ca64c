"""The LLM judge's own logic (rlhf.rewards.judge) over scripted engines: template checks and rendering, the token
ids that reach the engines, answer parsing, the unparsable-answer policies and the pairwise win-rate maths. The real
vLLM engines are in tests/integration/test_judge_engines.py."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from rlhf.rewards.judge import (
    JudgeError,
    JudgeSpec,
    LLMJudge,
    ordered_pairs,
    parse_preference,
    parse_score,
    template_fields,
    win_rates,
)
from rlhf.rollout.types import Generation
from rlhf.rollout.vllm.judge_engines import judge_sampling

SCORE_TEMPLATE = "Question: {prompt}\nReference: {answer}\nResponse: {response}\nGrade it."
PAIR_TEMPLATE = "Question: {prompt}\nA: {response_a}\nB: {response_b}\nWhich is better?"


@pytest.fixture(scope="module")
def tokenizer():
    from rlhf.models.tiny import build_tokenizer

    return build_tokenizer()


class ScriptedEngines:
    """The engines' ``generate`` signature; each answer is ``answer(decoded judge prompt)``, and every call's prompt
    ids and sampling are kept."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer, self.calls = tokenizer, answer, []

    def generate(self, prompt_ids, sampling):
        self.calls.append(([list(p) for p in prompt_ids], sampling))
        out = []
        for p in prompt_ids:
            text = self.answer(self.tokenizer.decode(list(p), skip_special_tokens=True))
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            out.append(Generation(tuple(p), ids, (0.0,) * len(ids), "stop"))
        return out


def _judge(tokenizer, answer, **spec):
    spec.setdefault("template", SCORE_TEMPLATE)
    judge_spec = JudgeSpec(path="/models/tiny/", **spec)
    return LLMJudge(judge_spec, ScriptedEngines(tokenizer, answer), tokenizer, judge_sampling(judge_spec, 2))


def _response_of(question: str) -> str:
    return re.search(r"Response: (.*)\n", question).group(1)


# --------------------------------------------------------------------------------------------- spec and template


def test_template_fields_keep_order_and_refuse_what_format_would_misuse():
    assert template_fields("{prompt} {response} {answer} {prompt} {{literal}}") == ("prompt", "response", "answer")
    for bad in ("{} {response}", "{0} {response}", "{row.x} {response}", "{row[0]} {response}", "{response"):
        with pytest.raises(ValueError, match=r"reward\.judge\.template"):
            JudgeSpec(path="m", template=bad)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(template="{prompt} only"), "must use {response}; missing {response}"),
        (dict(template="{response_a}", mode="pairwise"), "missing {response_b}"),
        (dict(mode="ranking"), "reward.judge.mode"),
        (dict(pattern=r"Score: \d"), "exactly one group"),
        (dict(pattern=r"(Score: (\d)"), "reward.judge.pattern: not a regular expression"),
        (dict(score_min=5, score_max=5), "reward.judge.score_min < reward.judge.score_max"),
        (dict(normalize="z"), "reward.judge.normalize"),
        (dict(out_of_range="wrap"), "reward.judge.out_of_range"),
        (dict(on_unparsable="skip"), "reward.judge.on_unparsable"),
        (dict(max_new_tokens=0), "reward.judge.max_new_tokens"),
        (dict(max_new_tokens=16, max_model_len=16), "reward.judge.max_new_tokens (16) must be < reward.judge.max_mod"),
        (dict(temperature=-0.1), "reward.judge.temperature"),
        (dict(path=""), "reward.judge.path"),
        (dict(score_max=float("inf")), "reward.judge.score_max must be a finite number"),
        (dict(seed=-1), "reward.judge.seed"),
        (dict(answer_prefix=None), "reward.judge.answer_prefix must be a string"),
        (dict(template=PAIR_TEMPLATE, mode="pairwise", on_unparsable="drop"), "pairwise judge must be 'fail' or"),
        (dict(template=PAIR_TEMPLATE, mode="pairwise", on_unparsable=1.5), "pairwise judge must be 'fail' or"),
    ],
)
def test_spec_errors_name_the_key(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        JudgeSpec(**{"path": "m", "template": "{response}", **fields})


def test_name_is_the_models_basename(tokenizer):
    assert _judge(tokenizer, lambda q: "").name == "judge:tiny"


def test_render_fills_columns_and_a_missing_one_is_named(tokenizer):
    judge = _judge(tokenizer, lambda q: "Score: 5")
    rendered = judge.render({"prompt": "1+2=", "response": "3", "answer": 3}, 0)
    assert rendered == "Question: 1+2=\nReference: 3\nResponse: 3\nGrade it."
    with pytest.raises(JudgeError, match=r"\{answer\}, which sample 0 does not have \(it has prompt, response\)"):
        judge.score(["1+2="], ["3"])
    assert judge.engines.calls == []  # nothing was asked
    with pytest.raises(JudgeError, match="may not be named 'response'"):
        judge.score(["1+2="], ["3"], {"response": ["x"], "answer": ["3"]})


def test_the_engines_get_the_chat_template_user_turn_then_the_answer_prefix(tokenizer):
    judge = _judge(tokenizer, lambda q: "7", answer_prefix="Score: ", max_new_tokens=3, temperature=0.0)
    judge.score(["1+2="], ["3"], {"answer": ["3"]})
    [(ids, sampling)] = judge.engines.calls
    question = "Question: 1+2=\nReference: 3\nResponse: 3\nGrade it."
    chat = f"<s><|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\nScore: "
    assert ids == [tokenizer(chat, add_special_tokens=False)["input_ids"]]
    assert ids[0].count(tokenizer.bos_token_id) == 1  # the template's BOS, no second one
    assert (sampling.max_new_tokens, sampling.temperature, sampling.stop_token_ids) == (3, 0.0, (2,))
    assert judge.last_judgements[0].text == "Score: 7" and judge.last_judgements[0].value == pytest.approx(0.7)

    no_chat = copy.deepcopy(tokenizer)  # the module's tokenizer keeps its template
    no_chat.chat_template = None
    judge = LLMJudge(judge.spec, ScriptedEngines(no_chat, lambda q: "7"), no_chat, judge.sampling)
    judge.score(["1+2="], ["3"], {"answer": ["3"]})
    assert judge.engines.calls[0][0] == [tokenizer(question + "Score: ")["input_ids"]]


# ------------------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    "text, fields, value",
    [
        ("Score: 7", {}, 0.7),
        ("I think score = 8.5 overall", {}, 0.85),
        ("Score: 12", {}, 1.0),  # clamped to score_max
        ("Score: -3", {}, 0.0),  # clamped to score_min
        ("Score: 7", dict(normalize="none"), 7.0),
        ("Score: 3", dict(score_min=1, score_max=5), 0.5),
        ("Score: 47", dict(pattern=r"Score: (\d)"), 0.4),  # the first digit only
    ],
)
def test_parse_score(text, fields, value):
    got, why = parse_score(text, JudgeSpec(path="m", template="{response}", **fields))
    assert got == pytest.approx(value, abs=1e-12) and why == ""


@pytest.mark.parametrize(
    "text, fields, why",
    [
        ("Great answer!", {}, r"does not match reward.judge.pattern"),
        ("Score: 12", dict(out_of_range="refuse"), "gives 12, outside [0, 10]"),
        ("Score: seven", dict(pattern=r"Score: (\w+)"), "'seven' is not a number"),
        ("Score: inf", dict(pattern=r"Score: (\w+)"), "not a finite number"),
    ],
)
def test_unparsable_scores_say_why(text, fields, why):
    got, reason = parse_score(text, JudgeSpec(path="m", template="{response}", **fields))
    assert got is None and why in reason


@pytest.mark.parametrize(
    "text, value",
    [("A", 1.0), ("[[B]]", 0.0), ("Verdict: tie", 0.5), ("Answer: B is better", 0.0), ("a good one", None),
     ("Both are fine", None)],
)  # fmt: skip
def test_parse_preference(text, value):
    got, why = parse_preference(text, JudgeSpec(path="m", template=PAIR_TEMPLATE, mode="pairwise"))
    assert got == value and (why == "") == (value is not None)


# ------------------------------------------------------------------------------------------------ score mode


def test_score_mode_values_texts_and_metrics(tokenizer):
    grades = {"3": "Score: 9", "4": "score: 2", "5": "Score: 5.5"}
    judge = _judge(tokenizer, lambda q: grades[_response_of(q)], weight=2.0, log_samples=2)
    result = judge.score(["1+2="] * 3, ["3", "4", "5"], {"answer": ["3"] * 3})
    assert result.per_source["judge:tiny"].tolist() == pytest.approx([0.9, 0.2, 0.55])
    assert result.total.tolist() == pytest.approx([1.8, 0.4, 1.1])
    assert result.errors == 0 and not result.substituted.any() and not result.failed.any()
    assert [j.text for j in judge.last_judgements] == ["Score: 9", "score: 2", "Score: 5.5"]
    assert judge.sample_log() == [
        {"index": 0, "judge_text": "Score: 9", "value": pytest.approx(0.9), "why": ""},
        {"index": 1, "judge_text": "score: 2", "value": pytest.approx(0.2), "why": ""},
    ]
    metrics = judge.metrics()
    assert metrics["judge/calls"] == 3 and metrics["judge/unparsable"] == 0
    assert metrics["judge/mean_value"] == pytest.approx((0.9 + 0.2 + 0.55) / 3)
    assert judge(["1+2="] * 3, ["3", "4", "5"], answer=["3"] * 3) == pytest.approx([0.9, 0.2, 0.55])


def test_unparsable_under_fail_names_the_sample_and_quotes_the_judge(tokenizer):
    judge = _judge(tokenizer, lambda q: "Score: 4" if _response_of(q) == "3" else "I refuse to grade this")
    with pytest.raises(JudgeError) as error:
        judge.score(["1+2=", "2+2=", "3+3="], ["3", "5", "7"], {"answer": ["3", "4", "6"]})
    message = str(error.value)
    assert "sample 1 (prompt='2+2='; response='5')" in message and message.endswith("(and 1 more unparsable samples)")
    assert r"the judge's answer 'I refuse to grade this' does not match reward.judge.pattern" in message
    silent = _judge(tokenizer, lambda q: "")  # an empty answer was still an answer
    with pytest.raises(JudgeError, match=r"sample 0 .*: the judge's answer '' does not match"):
        silent.score(["1+2="], ["3"], {"answer": ["3"]})


@pytest.mark.parametrize("stand_in", [-1.0, 0.25])
def test_unparsable_under_a_fixed_value_takes_it_and_counts_it(tokenizer, stand_in):
    judge = _judge(tokenizer, lambda q: "Score: 4" if _response_of(q) == "3" else "no idea", on_unparsable=stand_in)
    result = judge.score(["a", "b", "c"], ["3", "5", "6"], {"answer": ["x"] * 3})
    assert result.per_source["judge:tiny"].tolist() == pytest.approx([0.4, stand_in, stand_in])
    assert result.substituted.tolist() == [False, True, True] and result.errors == 2
    assert judge.metrics()["judge/unparsable"] == 2
    assert [j.value for j in judge.last_judgements] == [pytest.approx(0.4), None, None]


def test_unparsable_under_drop_marks_the_sample_and_the_function_form_refuses(tokenizer):
    judge = _judge(tokenizer, lambda q: "Score: 4" if _response_of(q) == "3" else "no idea", on_unparsable="drop")
    result = judge.score(["a", "b"], ["3", "5"], {"answer": ["x"] * 2})
    assert result.failed.tolist() == [False, True] and result.total.tolist() == pytest.approx([0.4, 0.0])
    with pytest.raises(JudgeError, match="use LLMJudge.score"):
        judge(["a", "b"], ["3", "5"], answer=["x"] * 2)


def test_a_judge_prompt_too_long_for_the_context_is_not_sent(tokenizer):
    probe = _judge(tokenizer, lambda q: "Score: 8")
    short = len(probe.prompt_ids(probe.render({"prompt": "a", "response": "3", "answer": "x"}, 0)))
    # room for the short prompt's answer exactly; the long one has 40 more digit tokens
    judge = _judge(tokenizer, lambda q: "Score: 8", max_model_len=short + 8, max_new_tokens=8, on_unparsable=0.0)
    result = judge.score(["a", "b"], ["3", "3" * 40], {"answer": ["x"] * 2})
    assert judge.engines.calls[0][0] == [list(judge.last_judgements[0].prompt_ids)]  # only the short one was sent
    assert result.per_source["judge:tiny"].tolist() == pytest.approx([0.8, 0.0]) and result.errors == 1
    assert judge.last_judgements[1].text is None
    assert f"exceeds reward.judge.max_model_len={short + 8}" in judge.last_judgements[1].why


# --------------------------------------------------------------------------------------------------- pairwise


def test_win_rates_by_hand():
    # p[i, j] = P(i shown as A beats j shown as B). w_i = 1/(n-1) * sum_j (p[i,j] + 1 - p[j,i]) / 2:
    # w0 = ((1 + 1 - 0)/2 + (0.5 + 1 - 1)/2) / 2 = (1 + 0.25) / 2 = 0.625
    # w1 = ((0 + 1 - 1)/2 + (1 + 1 - 0)/2) / 2 = (0 + 1) / 2    = 0.5
    # w2 = ((1 + 1 - 0.5)/2 + (0 + 1 - 1)/2) / 2 = (0.75 + 0) / 2 = 0.375
    p = torch.tensor([[9.0, 1.0, 0.5], [0.0, 9.0, 1.0], [1.0, 0.0, 9.0]], dtype=torch.float64)  # diagonal unused
    assert win_rates(p).tolist() == [0.625, 0.5, 0.375]
    assert float(win_rates(p).sum()) == 1.5  # n / 2
    always_a = torch.ones(4, 4, dtype=torch.float64)  # a judge that only looks at the position
    assert win_rates(always_a).tolist() == [0.5] * 4
    both = torch.stack([p, always_a[:3, :3]])
    assert torch.equal(win_rates(both), torch.stack([win_rates(p), win_rates(always_a[:3, :3])]))
    with pytest.raises(ValueError, match="n >= 2"):
        win_rates(torch.ones(1, 1))
    assert ordered_pairs(3) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]


def _longer_wins(question: str) -> str:
    a, b = re.search(r"A: (.*)\nB: (.*)\n", question).groups()
    return "A" if len(a) > len(b) else "B" if len(b) > len(a) else "tie"


def test_pairwise_score_ranks_each_group_both_ways(tokenizer):
    judge = _judge(tokenizer, _longer_wins, template=PAIR_TEMPLATE, mode="pairwise")
    result = judge.score(["p", "p", "p", "q", "q"], ["xx", "x", "xxx", "yy", "yy"])
    # group p: "xxx" beats both, "xx" beats "x": 1, 0.5, 0; group q: two equal responses tie both ways
    assert result.per_source["judge:tiny"].tolist() == [0.5, 0.0, 1.0, 0.5, 0.5]
    sent = judge.engines.calls[0][0]
    assert len(sent) == 3 * 2 + 2 * 1  # n(n-1) calls per group
    assert [j.text for j in judge.last_judgements[:2]] == ["A", "B"]  # (xx vs x), (xx vs xxx)

    biased = _judge(tokenizer, lambda q: "A", template=PAIR_TEMPLATE, mode="pairwise")
    assert biased.score(["p"] * 3, ["xx", "x", "xxx"]).per_source["judge:tiny"].tolist() == [0.5] * 3


def test_pairwise_needs_two_responses_per_prompt(tokenizer):
    judge = _judge(tokenizer, _longer_wins, template=PAIR_TEMPLATE, mode="pairwise")
    with pytest.raises(JudgeError, match="sample 2 .* has no other response"):
        judge.score(["p", "p", "q"], ["x", "xx", "y"])


def test_compare_and_unparsable_pairs(tokenizer):
    answers = {"x": "[[A]]", "xx": "B", "xxx": "hmm"}

    def answer(question):
        return answers[re.search(r"A: (.*)\n", question).group(1)]

    judge = _judge(tokenizer, answer, template=PAIR_TEMPLATE, mode="pairwise", on_unparsable=0.5)
    p_a = judge.compare(["p"] * 3, ["x", "xx", "xxx"], ["y", "y", "y"])
    assert p_a.dtype == torch.float64 and p_a.tolist() == [1.0, 0.0, 0.5]
    assert judge.metrics()["judge/unparsable"] == 1

    result = judge.score(["p", "p"], ["x", "xxx"])  # (x vs xxx): A; (xxx vs x): unparsable -> 0.5
    # w_x = (1 + 1 - 0.5) / 2 = 0.75, w_xxx = (0.5 + 1 - 1) / 2 = 0.25
    assert result.per_source["judge:tiny"].tolist() == [0.75, 0.25]
    assert result.substituted.tolist() == [True, True] and result.errors == 1
    assert "samples 1 (A) vs 0 (B)" in result.failures[0].message

    strict = _judge(tokenizer, answer, template=PAIR_TEMPLATE, mode="pairwise")
    with pytest.raises(JudgeError, match=r"pair 2 \(prompt='p'\): the judge's answer 'hmm' does not match"):
        strict.compare(["p"] * 3, ["x", "xx", "xxx"], ["y", "y", "y"])
    with pytest.raises(JudgeError, match=r"compare needs reward.judge.mode=pairwise"):
        _judge(tokenizer, answer).compare(["p"], ["x"], ["y"])


def test_pairwise_groups_are_the_rollouts_groups_not_runs_of_equal_texts(tokenizer):
    # two groups of one prompt text side by side (two prompt rows of one text, or that render alike): each is
    # ranked on its own, n(n-1) = 2 calls per group; as one run of four, "x" would beat nothing and "yy" everything
    judge = _judge(tokenizer, _longer_wins, template=PAIR_TEMPLATE, mode="pairwise")
    result = judge.score(["p"] * 4, ["x", "xx", "y", "yy"], groups=[3, 3, 5, 5])
    assert result.per_source["judge:tiny"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert len(judge.engines.calls[0][0]) == 4 and judge.metrics()["judge/calls"] == 4


def test_a_groups_rows_need_not_be_adjacent_and_groups_are_judged_in_order_of_first_appearance(tokenizer):
    judge = _judge(tokenizer, _longer_wins, template=PAIR_TEMPLATE, mode="pairwise")
    result = judge.score(["q", "p", "q", "p", "q"], ["yy", "x", "y", "xx", "yyy"], groups=[1, 0, 1, 0, 1])
    # group 1 (rows 0, 2, 4): "yyy" beats both, "yy" beats "y"; group 0 (rows 1, 3): "xx" beats "x"
    assert result.per_source["judge:tiny"].tolist() == [0.5, 0.0, 0.0, 1.0, 1.0]
    asked = [re.search(r"A: (.*)\nB: (.*)\n", tokenizer.decode(p, skip_special_tokens=True)).groups()
             for p in judge.engines.calls[0][0]]  # fmt: skip
    assert asked == [("yy", "y"), ("yy", "yyy"), ("y", "yy"), ("y", "yyy"), ("yyy", "yy"), ("yyy", "y"),
                     ("x", "xx"), ("xx", "x")]  # fmt: skip
    assert result.failures == () and not result.substituted.any()


def test_pairwise_groups_of_one_and_misaligned_groups_are_refused(tokenizer):
    judge = _judge(tokenizer, _longer_wins, template=PAIR_TEMPLATE, mode="pairwise")
    with pytest.raises(JudgeError, match=r"sample 1 \(prompt='p'\) has no other response in its group \(group 8\)"):
        judge.score(["p", "p", "p"], ["x", "xx", "xxx"], groups=[7, 8, 7])
    with pytest.raises(JudgeError, match="got 2 group ids for 3 samples"):
        judge.score(["p", "p", "p"], ["x", "xx", "xxx"], groups=[7, 7])
    assert judge.engines.calls == []  # nothing was asked
