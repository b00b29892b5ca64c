"""The multi-turn examples' environments (examples/multi_turn/calculator.py, retry.py) and data (data.py), without
Ray: the rules, rewards and done flags of each, the tool's parser on malformed and oversized calls, and the SFT
warm-up rows, which must tokenize to exactly the token ids a rollout builds (prompt, sampled response with its EOS,
observation tokenized alone), or the warm-up teaches a context the policy never sees."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rlhf.data.tokenize import tokenize_sft
from rlhf.envs import EnvError, LocalEpisode, StepOutcome, load_environment
from rlhf.rollout.episodes import Episode

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multi_turn"
CALCULATOR, RETRY = f"{EXAMPLE / 'calculator.py'}:Calculator", f"{EXAMPLE / 'retry.py'}:Retry"


def _load(name: str):
    """``examples/multi_turn/<name>.py`` as a module, as the example's loop loads it."""
    spec = importlib.util.spec_from_file_location(f"example_multi_turn_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data():
    return _load("data")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlhf.models.tiny import build_tiny_model

    # the rollout and the trainer load the tokenizer from the model directory: so does this test
    return AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model")))


def _episode(spec: str, row: dict) -> LocalEpisode:
    episode = LocalEpisode(load_environment(spec)(), spec, 0)
    assert episode.reset(row) == ""  # the prompt row is the whole first turn
    return episode


ROW = {"prompt": "37*48=", "answer": "1776"}


# --------------------------------------------------------------------------- the calculator
def test_calculator_direct_answers_end_the_episode_with_their_correctness():
    right = _episode(CALCULATOR, ROW).step("1776", (1,))
    assert (right.observation, right.reward, right.done) == (None, 1.0, True)
    assert right.info == {"tool_calls": 0, "correct": True}
    for wrong in ("1777", "", "about 1800", "-1776"):
        outcome = _episode(CALCULATOR, ROW).step(wrong, ())
        assert (outcome.reward, outcome.done) == (0.0, True), wrong


def test_calculator_call_then_answer():
    episode = _episode(CALCULATOR, ROW)
    call = episode.step("<calc>37*48</calc>", (5, 6))
    assert (call.observation, call.reward, call.done) == ("<result>1776</result>", 0.0, False)
    assert call.info == {"tool_calls": 1}
    answer = episode.step("1776", (7,))
    assert (answer.reward, answer.done, answer.info["tool_calls"]) == (1.0, True, 1)
    with pytest.raises(EnvError, match="after its episode ended at turn 2"):
        episode.step("1776", ())


@pytest.mark.parametrize(
    "call, value",
    [
        ("<calc>37*48</calc>", 1776),
        ("<calc> 37 * 48 </calc>", 1776),
        ("<calc>99+1</calc>", 100),
        ("<calc>10-37</calc>", -27),
        ("<calc>-6*7</calc>", -42),
        ("<calc>84/12</calc>", 7),
        ("<calc>999999*999999</calc>", 999998000001),
        ("I will use it: <calc>2*3</calc> and more text", 6),  # the call is found inside the response
        ("<calc>2*3</calc><calc>4*5</calc>", 6),  # the first call only
    ],
)
def test_tool_evaluates_int_op_int(call, value):
    calculator = load_environment(CALCULATOR)
    assert calculator.evaluate(call) == value
    assert _episode(CALCULATOR, ROW).step(call, ()).observation == f"<result>{value}</result>"


@pytest.mark.parametrize(
    "call, reason",
    [
        ("<calc>37*48", "unclosed"),
        ("<calc>37*48</calc", "unclosed"),
        ("<calc></calc>", "syntax"),
        ("<calc>37x48</calc>", "syntax"),
        ("<calc>37**48</calc>", "syntax"),
        ("<calc>1+2+3</calc>", "syntax"),
        ("<calc>(1+2)</calc>", "syntax"),
        ("<calc>3.5*2</calc>", "syntax"),
        ("<calc>1234567*2</calc>", "syntax"),  # operands of at most 6 digits
        ("<calc>\u0663*2</calc>", "syntax"),  # an Arabic-Indic 3: ASCII digits only
        ("<calc>__import__('os').system('true')</calc>", "too long"),  # never eval-ed; refused before parsing
        ("<calc>" + "9" * 100_000 + "*2</calc>", "too long"),
        ("<calc>1/0</calc>", "division by zero"),
        ("<calc>7/2</calc>", "inexact"),
    ],
)
def test_malformed_calls_observe_an_error_and_count(call, reason):
    calculator = load_environment(CALCULATOR)
    with pytest.raises(ValueError) as caught:
        calculator.evaluate(call)
    assert str(caught.value) == reason
    episode = _episode(CALCULATOR, ROW)
    outcome = episode.step(call, ())
    assert (outcome.observation, outcome.reward, outcome.done) == (f"<error>{reason}</error>", 0.0, False)
    assert outcome.info == {"tool_calls": 1, "tool_error": reason}
    assert episode.step("1776", ()).reward == 1.0  # a bad call costs a turn, not the episode


def test_a_call_beyond_the_limit_ends_the_episode_with_nothing():
    calculator = load_environment(CALCULATOR)
    episode = _episode(CALCULATOR, ROW)
    for n in range(1, calculator.MAX_CALLS + 1):
        assert episode.step("<calc>37*48</calc>" if n % 2 else "<calc>bad</calc>", ()).info["tool_calls"] == n
    last = episode.step("<calc>37*48</calc>", ())
    assert (last.observation, last.reward, last.done) == (None, 0.0, True)
    assert last.info == {"tool_calls": calculator.MAX_CALLS + 1, "correct": False, "ended": "tool_limit"}


# --------------------------------------------------------------------------- retry
ADD = {"prompt": "12+7=", "answer": "19"}


def test_retry_right_first_time():
    outcome = _episode(RETRY, ADD).step("19", (1, 2))
    assert (outcome.observation, outcome.reward, outcome.done) == (None, 1.0, True)
    assert outcome.info == {"tries": 1, "correct": True}


@pytest.mark.parametrize(
    "first, hint",
    [
        ("18", "higher"),
        ("7", "higher"),
        ("20", "lower"),
        ("91", "lower"),
        ("-19", "higher"),
        ("", "a number"),
        ("nineteen", "a number"),
    ],
)
def test_retry_feedback_says_where_the_answer_lies_and_asks_again(first, hint):
    episode = _episode(RETRY, ADD)
    wrong = episode.step(first, ())
    assert (wrong.observation, wrong.reward, wrong.done) == (f"{hint}\n12+7=", 0.0, False)
    right = episode.step("19", ())
    assert (right.observation, right.reward, right.done, right.info["tries"]) == (None, 0.5, True, 2)


def test_retry_wrong_twice_ends_with_nothing():
    episode = _episode(RETRY, ADD)
    episode.step("18", ())
    last = episode.step("18", ())
    assert (last.observation, last.reward, last.done) == (None, 0.0, True)
    with pytest.raises(EnvError, match="after its episode ended"):
        episode.step("19", ())


def test_outcomes_are_valid_step_outcomes_for_the_pool():
    for spec, row, responses in ((CALCULATOR, ROW, ["<calc>1*1</calc>", "x"]), (RETRY, ADD, ["1", "2"])):
        episode = _episode(spec, row)
        for response in responses:
            assert isinstance(episode.step(response, ()), StepOutcome)


# --------------------------------------------------------------------------- data
def test_calculator_sft_rows_teach_the_call_on_some_rows(data):
    rows = data.calculator_sft_rows(1000, seed=3, tool_share=0.3)
    calls = [r for r in rows if r["response"].startswith("<calc>")]
    copies = [r for r in rows if "<result>" in r["prompt"]]
    direct = [r for r in rows if r not in calls and r not in copies]
    assert len(calls) == len(copies) and len(calls) + len(direct) == 1000
    assert 0.25 < len(calls) / 1000 < 0.35
    for call, copy in zip(calls, copies):
        a, b = (int(x) for x in call["prompt"].rstrip("=").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert call["response"] == f"<calc>{a}*{b}</calc>"
        assert copy == {"prompt": f"{a}*{b}=<calc>{a}*{b}</calc></s><result>{a * b}</result>", "response": str(a * b)}
    assert all(r["response"] == str(eval(r["prompt"].rstrip("="))) for r in direct)  # noqa: S307 (test data)
    assert data.calculator_sft_rows(50, seed=3) == data.calculator_sft_rows(50, seed=3)
    assert data.calculator_sft_rows(50, seed=3) != data.calculator_sft_rows(50, seed=4)


def test_retry_sft_rows_answer_after_the_environments_own_feedback(data):
    rows = data.retry_sft_rows(400, seed=1, retry_share=0.25)
    retries = [r for r in rows if "</s>" in r["prompt"]]
    assert 0.18 < len(retries) / 400 < 0.32 and len(rows) == 400 + len(retries)
    for row in retries:
        prompt, rest = row["prompt"].split("=", 1)
        wrong, feedback = rest.split("</s>")
        episode = _episode(RETRY, {"prompt": prompt + "=", "answer": row["response"]})
        assert wrong != row["response"] and int(wrong) >= 0
        assert episode.step(wrong, ()).observation == feedback  # what the rollout will show after that answer


def _sft_example(tokenizer, row):
    out = tokenize_sft([row], tokenizer, max_length=128, prompt_key="prompt", response_key="response")
    (example,) = out.examples
    return example


def _rollout_of(tokenizer, spec, row, responses):
    """The episode a rollout builds when the policy samples ``responses`` (each ended by EOS): prompt tokens, each
    response's tokens + EOS as sampled, each observation tokenized alone (TextObservations), as run_episodes does;
    returns the episode and the environment's outcomes."""
    env = LocalEpisode(load_environment(spec)(), spec, 0)
    env.reset(row)
    episode = Episode(tuple(tokenizer(row["prompt"])["input_ids"]))
    outcomes = []
    for text in responses:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        episode.add_response(ids, [0.0] * len(ids))
        decoded = tokenizer.decode(ids, skip_special_tokens=True)  # what the environment is given
        outcomes.append(env.step(decoded, tuple(ids)))
        if outcomes[-1].observation:
            episode.add_observation(tokenizer(outcomes[-1].observation, add_special_tokens=False)["input_ids"])
    return episode, outcomes


@pytest.mark.parametrize("env", ["calculator", "retry"])
def test_sft_rows_tokenize_to_the_rollouts_own_ids(data, tokenizer, env):
    """Each SFT row of the second turn is, token for token, the context the rollout shows the policy there, and its
    loss falls on exactly the tokens the policy samples in that turn (the answer and its EOS)."""
    rows = data.example_rows(env, seed=0, num_sft=200, num_prompts=1, num_eval=1, eos=tokenizer.eos_token)["sft"]
    second_turns = [r for r in rows if tokenizer.eos_token in r["prompt"]]
    assert second_turns
    for row in second_turns:
        first_prompt = row["prompt"].split("=", 1)[0] + "="
        first_response = row["prompt"][len(first_prompt) :].split(tokenizer.eos_token)[0]
        episode, outcomes = _rollout_of(
            tokenizer,
            data.SPECS[env],
            {"prompt": first_prompt, "answer": row["response"]},
            [first_response, row["response"]],
        )
        example = _sft_example(tokenizer, row)
        assert example.input_ids == episode.token_ids, row
        last = episode.segments[-1]
        assert example.loss_mask == (0,) * (len(example.input_ids) - len(last.ids)) + (1,) * len(last.ids)
        assert outcomes[-1].reward == (1.0 if env == "calculator" else 0.5) and outcomes[-1].done


def test_first_turn_sft_rows_tokenize_to_the_rollouts_first_turn(data, tokenizer):
    rows = data.example_rows("calculator", seed=0, num_sft=100, num_prompts=1, num_eval=1)["sft"]
    for row in (r for r in rows if tokenizer.eos_token not in r["prompt"]):
        episode, outcomes = _rollout_of(
            tokenizer, data.SPECS["calculator"], {"prompt": row["prompt"], "answer": "0"}, [row["response"]]
        )
        assert (
            _sft_example(tokenizer, row).input_ids
            == episode.token_ids[: len(episode.prompt_ids) + len(episode.segments[0].ids)]
        )
        assert outcomes[0].done == (not row["response"].startswith("<calc>"))


def test_data_cli_writes_the_three_files(data, tmp_path, capsys):
    assert (
        data.main(
            ["--env", "retry", "--out", str(tmp_path), "--num-sft", "20", "--num-prompts", "8", "--num-eval", "4"]
        )
        == 0
    )
    read = {
        name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("sft", "prompts", "eval_prompts")
    }
    assert len(read["prompts"]) == 8 and len(read["eval_prompts"]) == 4 and len(read["sft"]) >= 20
    assert all(set(r) == {"prompt", "answer"} and r["prompt"].endswith("=") for r in read["prompts"])
    assert read["prompts"] != read["eval_prompts"][:4]  # another seed
    assert "eval_prompts" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown example 'chess'"):
        data.example_rows("chess")


# --------------------------------------------------------------------------- what the loop reports
def _record(tokenizer, turns, reward):
    """An episode record of ``turns`` (text of a policy turn, or ``("env", text)`` for an observation)."""
    from rlhf.rollout.multi_turn import EpisodeRecord

    episode = Episode((1, 2))
    for turn in turns:
        if isinstance(turn, tuple):
            episode.add_observation(tokenizer(turn[1], add_special_tokens=False)["input_ids"])
        else:
            ids = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            episode.add_response(ids, [0.0] * len(ids))
    return EpisodeRecord(episode, [reward], "done")


def test_the_loops_episode_stats(tokenizer):
    loop = _load("train_loop")
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    calculator = [
        _record(tokenizer, ["<calc>37*48</calc>", ("env", "<result>1776</result>"), "1776"], 1.0),
        _record(
            tokenizer,
            [
                "<calc>3*</calc>",
                ("env", "<error>syntax</error>"),
                "<calc>3*4</calc>",
                ("env", "<result>12</result>"),
                "13",
            ],
            0.0,
        ),
        _record(tokenizer, ["1800"], 0.0),
        _record(tokenizer, ["1776"], 1.0),
    ]
    assert loop.episode_stats("calculator", calculator, decode) == {
        "reward": 0.5,
        "accuracy": 0.5,
        "turns": 1.75,
        "tool_rate": 0.5,
        "tool_calls": 0.75,
        "acc_tool": 0.5,
        "acc_direct": 0.5,
    }
    retry = [
        _record(tokenizer, ["19"], 1.0),
        _record(tokenizer, ["18", ("env", "higher\n12+7="), "19"], 0.5),
        _record(tokenizer, ["18", ("env", "higher\n12+7="), "17"], 0.0),
    ]
    stats = loop.episode_stats("retry", retry, decode)
    assert stats == pytest.approx(
        {
            "reward": 0.5,
            "accuracy": 2 / 3,
            "turns": 5 / 3,
            "retry_rate": 2 / 3,
            "first_try": 1 / 3,
            "retry_success": 0.5,
        }
    )
    assert "retry ok 0.50" in loop._line("retry", stats)
