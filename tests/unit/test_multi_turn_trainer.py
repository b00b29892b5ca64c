"""Multi-turn pieces of the RL trainer without actors: chat-template observations (exact against a full render of
the conversation), environments that return the next prompt as ids (the prefix check through ``run_episodes``),
the ``env.*`` / ``rollout.*`` episode keys, the episode limits (``penalize``, ``mask``) in scoring and in the
update, and the resource plan's environment actors. The real engines and pool run in
tests/integration/test_multi_turn_training.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from group_helpers import LocalGroup
from test_multi_turn import SAMPLING, Engine, decode, encode
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.batch import Batch
from rlhf.config.loader import load_config
from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.chat import ChatFormatter
from rlhf.distributed.engine import EngineSpec
from rlhf.envs import EnvError, StepOutcome
from rlhf.objectives.actor_critic import PolicyObjective
from rlhf.rollout.episodes import EpisodeError
from rlhf.rollout.multi_turn import RolloutStats, TurnLimits, episode_metrics, run_episodes
from rlhf.rollout.observations import ChatObservations, TextObservations
from rlhf.rollout.prompts import PromptSet, prepare_prompts
from rlhf.rollout.sources import EpisodeRollout, Rollout, observation_format
from rlhf.rollout.types import Generation
from rlhf.trainers.kinds import kind_of
from rlhf.trainers.online.steps import RLActors, RLTrainer

SYSTEM = {"role": "system", "content": "Answer with the sum."}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


# ------------------------------------------------------------------------------------ chat observations
def test_a_chat_observation_is_exactly_the_templates_next_turn(tokenizer):
    """prompt ids + the sampled response (ending on <|im_end|>) + the observation's ids == the whole conversation
    rendered and tokenized in one piece: the observation turn is the template's, token for token."""
    chat = ChatFormatter(tokenizer)
    messages = [SYSTEM, {"role": "user", "content": "12+7="}]
    response = tokenizer("19", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    encoder = ChatObservations(chat, "user")
    observed = encoder("lower, try again", response)
    whole = chat.prompt_ids(
        messages + [{"role": "assistant", "content": "19"}, {"role": "user", "content": "lower, try again"}]
    )
    assert chat.prompt_ids(messages) + response + observed == whole
    assert tokenizer.decode(observed).startswith("\n<|im_start|>user\nlower")  # the turn's closing newline first


def test_a_response_cut_before_its_end_of_turn_gets_the_templates_closing_as_context(tokenizer):
    chat = ChatFormatter(tokenizer)
    cut = tokenizer("19", add_special_tokens=False)["input_ids"]  # max_new_tokens hit: no <|im_end|>
    observed = ChatObservations(chat, "tool")(" 7", cut)
    assert tokenizer.decode(observed) == "<|im_end|>\n<|im_start|>tool\n 7<|im_end|>\n<|im_start|>assistant\n"


def test_a_reset_observation_is_rendered_into_the_prompt(tokenizer):
    chat = ChatFormatter(tokenizer)
    messages = [SYSTEM, {"role": "user", "content": "12+7="}]
    encoder = ChatObservations(chat, "user")
    first = encoder.first(chat.prompt_ids(messages), "use the tool", messages)
    assert first == chat.prompt_ids(messages + [{"role": "user", "content": "use the tool"}])
    other = [SYSTEM, {"role": "user", "content": "3+4="}]
    with pytest.raises(ValueError, match="do not end with its .* token ids: the messages of another prompt"):
        encoder.first(chat.prompt_ids(messages), "use the tool", other)
    with pytest.raises(ValueError, match="needs the prompt's messages"):
        encoder.first(chat.prompt_ids(messages), "use the tool")


def test_a_truncated_prompt_stays_truncated_with_its_reset_observation(tokenizer):
    """rollout.prompt_overflow=truncate kept the prompt's last max_prompt_length tokens: rendering it again with
    the observation drops the same leading tokens (the prompt data's rule still holds; the observation's tokens
    count in the episode's budget)."""
    chat = ChatFormatter(tokenizer)
    messages = [SYSTEM, {"role": "user", "content": "12+7=" * 6}]
    whole = chat.prompt_ids(messages)
    prompts = prepare_prompts(
        [{"prompt": messages}],
        tokenizer,
        prompt_key="prompt",
        columns=(),
        max_prompt_length=len(whole) - 5,
        overflow="truncate",
        chat=chat,
    )
    assert prompts.truncated == 1 and prompts.prompt_ids[0] == whole[5:]
    first = ChatObservations(chat, "user").first(prompts.prompt_ids[0], "use the tool", prompts.messages[0])
    assert first == chat.prompt_ids(messages + [{"role": "user", "content": "use the tool"}])[5:]
    closed = len(chat.tokenize(chat.render(messages))) - 5  # the truncated prompt up to its generation prompt
    assert first[:closed] == prompts.prompt_ids[0][:closed] and len(first) > len(prompts.prompt_ids[0])


class Named:
    """Reset observations name their row (``"row <id>"``); done after one turn. Records the rows it was given."""

    step_timeout_s = 30.0

    def __init__(self):
        self.rows = []

    def reset(self, rows):
        self.rows = [r["id"] for r in rows]
        return [f"row {r['id']}" for r in rows]

    def step(self, ids, responses, response_ids):
        return [StepOutcome(None, 0.0, True) for _ in ids]

    def close(self, ids):
        pass


@pytest.mark.parametrize("num_prompts, prompt_index", [(5, [4, 4, 1, 1]), (2, [1, 1, 0, 0])])
def test_each_episodes_reset_observation_is_rendered_onto_its_own_prompt(tokenizer, num_prompts, prompt_index):
    """Episode j of a rollout answers prompt ``prompt_index[j]``: its first tokens are that prompt's messages +
    the observation its own environment row gave, rendered once; its row and its group are that prompt's too. (The
    rollout position is not a prompt index: with fewer prompts than episodes it is not even a valid one.)"""
    rows = [
        {"id": 10 + k, "prompt": [SYSTEM, {"role": "user", "content": f"{k}+{k}="}], "answer": str(2 * k)}
        for k in range(num_prompts)
    ]
    prompts = prepare_prompts(
        rows,
        tokenizer,
        prompt_key="prompt",
        columns=("answer",),
        max_prompt_length=64,
        overflow="skip",
        chat=ChatFormatter(tokenizer),
    )
    env, engine = Named(), Engine()
    rollout = EpisodeRollout(env, tokenizer, "chat", "user", TurnLimits(1, 128), "error")(
        engine, prompts, prompt_index, SAMPLING, step=1
    )
    expected = [
        prompts.chat.prompt_ids(rows[i]["prompt"] + [{"role": "user", "content": f"row {10 + i}"}])
        for i in prompt_index
    ]
    assert [list(p) for p in engine.calls[0][0]] == expected
    assert env.rows == [10 + i for i in prompt_index] and rollout.prompt_index == prompt_index
    for j, ids in enumerate(expected):
        assert rollout.batch.input_ids[j, : len(ids)].tolist() == ids
        assert rollout.batch.loss_mask[j, : len(ids)].sum() == 0  # the first prompt is context


def test_a_reset_observation_keeps_the_rows_tools_in_the_prompt(tokenizer):
    """A prompt row with ``tools`` was rendered with their schemas (what an agent's first request sends); its reset
    observation is rendered onto the same messages with the same tools, so the episode's first tokens are the
    tools header, the prompt and the observation. Without the tools, the render is refused, naming them."""
    from rlhf.models.tiny import TOOLS_CHAT_TEMPLATE

    tools = [{"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}}]
    rows = [{"id": 10, "prompt": [{"role": "user", "content": "3*4="}], "tools": tools}]
    chat = ChatFormatter(tokenizer, template=TOOLS_CHAT_TEMPLATE)
    prompts = prepare_prompts(
        rows, tokenizer, prompt_key="prompt", columns=(), max_prompt_length=256, overflow="skip", chat=chat
    )
    assert prompts.tools == [tools]
    env, engine = Named(), Engine()
    EpisodeRollout(env, tokenizer, "chat", "user", TurnLimits(1, 512), "error")(
        engine, prompts, [0, 0], SAMPLING, step=1
    )
    expected = chat.prompt_ids(rows[0]["prompt"] + [{"role": "user", "content": "row 10"}], tools)
    assert [list(p) for p in engine.calls[0][0]] == [expected, expected]
    assert '"name": "mul"' in tokenizer.decode(expected)
    with pytest.raises(ValueError, match="the messages of another prompt, or without its tools"):
        ChatObservations(chat, "user").first(prompts.prompt_ids[0], "row 10", rows[0]["prompt"])


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    # renders only the last message: an observation turn is not a continuation of the conversation
    chat = ChatFormatter(tokenizer, template="{{ messages[-1]['content'] }}")
    with pytest.raises(ValueError, match="rollout.observation_role=user: the chat template does not render"):
        ChatObservations(chat, "user")


def test_text_observations_are_the_texts_own_tokens(tokenizer):
    encoder = TextObservations.of(tokenizer)
    assert encoder(" got 3", (5, 6)) == tokenizer(" got 3", add_special_tokens=False)["input_ids"]
    assert encoder.first([1, 2], "x") == [1, 2] + tokenizer("x", add_special_tokens=False)["input_ids"]


def test_observation_format_auto_follows_the_prompts():
    assert observation_format("auto", conversational=True) == "chat"
    assert observation_format("auto", conversational=False) == "text"
    with pytest.raises(ConfigError, match="rollout.observation_format=chat needs conversational prompts"):
        observation_format("chat", conversational=False)


# ------------------------------------------------------------------------- whole prompts as token ids
class ReEncoding:
    """Returns the next prompt as ids: the episode's true tokens, or (``drift``) with one of them replaced, as a
    re-tokenizing environment does."""

    def __init__(self, drift: bool, prompts):
        self.drift, self.prompts, self.responses = drift, prompts, {}

    def reset(self, rows):
        self.responses = {i: [] for i in range(len(rows))}
        return [""] * len(rows)

    def step(self, ids, responses, response_ids):
        out = []
        for i, r in zip(ids, response_ids):
            self.responses[i].extend(r)
            full = list(self.prompts[i]) + self.responses[i]
            if self.drift and i == 1:
                full[-2] = 999  # "a b" sampled, "ab" re-encoded
            full += [7, 7]  # the observation's tokens
            self.responses[i].extend([7, 7])
            out.append(StepOutcome(prompt_ids=full))
        return out

    def close(self, ids):
        pass


def test_prompt_ids_that_extend_the_episode_are_appended_as_the_observation():
    prompts = [(1, 2), (3,)]
    records = run_episodes(
        Engine(), ReEncoding(False, prompts), prompts, [{}, {}], SAMPLING, encode, decode, TurnLimits(2, 64)
    )
    assert all(r.episode.turns == 2 and r.ended_by == "max_turns" for r in records)
    assert [s.source for s in records[0].episode.segments] == ["policy", "env", "policy"]
    assert records[0].episode.segments[1].ids == (7, 7)


def test_a_re_encoding_environment_is_caught_naming_the_episode_turn_and_position():
    prompts = [(1, 2), (3,)]
    with pytest.raises(
        EpisodeError,
        match=r"episode 1, turn 1: the new prompt does not extend the episode's tokens: "
        r"they differ at position 2 of 4",
    ):
        run_episodes(
            Engine(), ReEncoding(True, prompts), prompts, [{}, {}], SAMPLING, encode, decode, TurnLimits(2, 64)
        )
    records = run_episodes(
        Engine(),
        ReEncoding(True, prompts),
        prompts,
        [{}, {}],
        SAMPLING,
        encode,
        decode,
        TurnLimits(2, 64),
        on_prefix_mismatch="truncate",
    )
    assert [r.ended_by for r in records] == ["max_turns", "prefix_mismatch"]
    assert records[1].episode.turns == 1 and records[1].at_limit  # kept up to the mismatch, then ended


class Failing:
    """Episode 1 fails at reset, episode 2 at its second turn; the others answer ``"o"`` forever."""

    def __init__(self):
        self.asked = None

    def reset(self, rows, errors="raise"):
        self.asked = errors
        return [EnvError("reset broke", "x", 1, 0) if i == 1 else "" for i in range(len(rows))]

    def step(self, ids, responses, response_ids, errors="raise"):
        self.turn = getattr(self, "turn", 0) + 1
        return [EnvError("step broke", "x", i, 2) if i == 2 and self.turn == 2 else StepOutcome("o", 1.0) for i in ids]

    def close(self, ids):
        pass


def test_an_environment_error_ends_only_its_episode_when_asked():
    env = Failing()
    stats = RolloutStats()
    records = run_episodes(
        Engine(), env, [(1,)] * 4, [{}] * 4, SAMPLING, encode, decode, TurnLimits(3, 64), stats, on_env_error="end"
    )
    assert env.asked == "return"
    assert [r.ended_by for r in records] == ["max_turns", "env_error", "env_error", "max_turns"]
    assert [r.episode.turns for r in records] == [3, 0, 2, 3] and records[1].error == "reset broke"
    assert records[2].turn_rewards == [1.0] and not records[2].at_limit  # its turns up to the failure kept
    assert stats.env_errors == 2 and episode_metrics(records, stats)["episode/env_errors"] == 2


def test_a_failed_episode_and_its_group_are_out_of_the_step():
    """GRPO: the failed episode's group carries no loss and its score enters no baseline (rlhf.ops.failures);
    before, only the failed row was masked and its score stayed in its siblings' baseline."""
    rollout = _rollout([False, False, False, False])
    rollout.prompt_index = [0, 0, 1, 1]
    rollout.failed = torch.tensor([False, True, False, False])
    trainer = _trainer(_cfg(*MULTI, "env.on_error=drop"))
    scores, _ = trainer.score(rollout, Prompts)
    batch = rollout.batch.replace(old_logps=torch.zeros(4, 4))
    rows, stats = trainer.advantages(batch, scores, rollout.prompt_index, None, rollout.failures())
    assert rows.loss_mask.sum(-1).tolist() == [0, 0, 3, 3] and stats["failed/rows_out"] == 2
    assert rows.advantages[:2].abs().sum() == 0  # env rewards [1.0, 0.5 (failed)]: nothing, not a +-0.707
    a = 0.5 / (0.5**0.5 + 1e-6)  # the other group, env rewards [0.0, 1.0]: GRPO's +-0.5 / (std + eps)
    torch.testing.assert_close(rows.advantages[2:, 1:], torch.tensor([[-a] * 3, [a] * 3]))


def test_step_outcome_prompt_ids_are_checked():
    assert StepOutcome(prompt_ids=[1, 2]).prompt_ids == (1, 2)
    with pytest.raises(ValueError, match="not both"):
        StepOutcome("text", prompt_ids=[1])
    with pytest.raises(ValueError, match="non-negative token ids"):
        StepOutcome(prompt_ids="12")


# ---------------------------------------------------------------------------------------- config
def _cfg(*extra) -> RLRunConfig:
    return load_config(
        RLRunConfig,
        "grpo_tiny",
        [
            "model.path=unused",
            "data.train_path=unused",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            *extra,
        ],
    )


MULTI = (
    "env.spec=envs.py:Retry",
    "rollout.max_turns=2",
    "rollout.max_prompt_length=16",
    "rollout.max_episode_tokens=32",
)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("rollout.max_turns=2",), "rollout.max_turns is 2, which needs an environment"),
        (("env.spec=envs.py:Retry",), "rollout.max_episode_tokens must be set above rollout.max_prompt_length"),
        (MULTI + ("rollout.episode_limit=drop",), "rollout.episode_limit"),
        (MULTI + ("rollout.observation_role=bot",), "rollout.observation_role"),
        (MULTI + ("env.step_timeout_s=0",), "env.step_timeout_s"),
    ],
)
def test_episode_keys_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


def test_episodes_set_the_sequence_length_and_the_plan_counts_the_environment_actors():
    single, multi = _cfg(), _cfg(*MULTI, "env.num_actors=3", "env.cpus_per_actor=0.5")
    assert single.max_sequence_length == 256 + 6 and multi.max_sequence_length == 32
    assert kind_of(multi).plan(multi, 0.0).needed_cpus == kind_of(single).plan(single, 0.0).needed_cpus + 1.5
    assert "environment" not in {a.role for a in kind_of(single).plan(single, 0.0).actors}


# ---------------------------------------------------------------------------------- episode limits
def _rollout(at_limit) -> Rollout:
    n = len(at_limit)
    batch = Batch(
        input_ids=torch.ones(n, 4, dtype=torch.long),
        attention_mask=torch.ones(n, 4, dtype=torch.long),
        loss_mask=torch.tensor([[0, 1, 1, 1]] * n),
    )
    return Rollout(
        batch,
        list(range(n)),
        ["1"] * n,
        env_rewards=torch.tensor([1.0, 0.5, 0.0, 1.0][:n]),
        at_limit=torch.tensor(at_limit),
    )


def _trainer(cfg, group=None) -> RLTrainer:
    return RLTrainer(cfg, None, None, None, RLActors(policy=group, engines=None), None, PolicyObjective(), None)


class Prompts:
    texts, columns = ["p"] * 4, {}


def test_penalize_replaces_the_reward_of_episodes_a_limit_ended():
    rollout = _rollout([False, True, False, True])
    scores, per_source = _trainer(_cfg(*MULTI, "rollout.episode_limit=penalize", "rollout.limit_reward=-1")).score(
        rollout, Prompts
    )
    assert scores.tolist() == [1.0, -1.0, 0.0, -1.0]
    assert per_source["env"].tolist() == [1.0, 0.5, 0.0, 1.0]  # what the environment said, still logged
    kept, _ = _trainer(_cfg(*MULTI)).score(rollout, Prompts)  # truncate: the episode's own reward
    assert kept.tolist() == [1.0, 0.5, 0.0, 1.0]


def test_mask_takes_the_loss_off_episodes_a_limit_ended_and_skips_a_step_left_with_none(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    cfg = _cfg(*MULTI, "rollout.episode_limit=mask")  # optimizer steps of 2 episodes, 2 per RL step

    def update(at_limit):
        rollout = _rollout(at_limit)
        group = LocalGroup(model, EngineSpec.for_global_batch(2, 2, 1), 1)
        trainer = _trainer(cfg, group)
        rows = trainer.scoring.trained_rows(rollout.batch, rollout)
        batch = rows.replace(old_logps=torch.zeros(4, 4), advantages=torch.ones(4, 4) * rows.loss_mask)
        return rows, trainer.update(batch, rl_step=1), group

    rows, metrics, _ = update([True, False, True, False])
    assert rows.loss_mask.sum(-1).tolist() == [0, 3, 0, 3]
    assert metrics["num_tokens"] == 6  # only the kept episodes' tokens are counted, whatever the steps drew
    assert metrics["optimizer_steps"] + metrics.get("optimizer_steps_empty", 0) == 2
    _, metrics, group = update([True] * 4)
    assert metrics["optimizer_steps"] == 0 and metrics["optimizer_steps_empty"] == 2 and group.schedule_steps == []
    assert "policy_loss" not in metrics  # nothing trained, nothing made up


class Cutting:
    """Single-turn engines: every request answers 4 tokens; the odd ones were cut at max_new_tokens."""

    def generate(self, prompt_ids, sampling):
        return [
            Generation(tuple(p), (5, 6, 7, 8), (-0.5,) * 4, "length" if j % 2 else "stop")
            for j, p in enumerate(prompt_ids)
        ]


def _single_turn(tokenizer, *overrides):
    """A single-turn trainer whose reward function gives every response 1.0, and its rollout of 2 prompts x 2."""
    prompts = PromptSet([[1, 2], [3]], ["p", "q"], {}, 0, 0)
    scorer = lambda prompts, responses, columns: (torch.ones(len(responses)), {"f": torch.ones(len(responses))})  # noqa
    trainer = RLTrainer(
        _cfg(*overrides),
        tokenizer,
        prompts,
        None,
        RLActors(policy=None, engines=Cutting()),
        scorer,
        PolicyObjective(),
        None,
    )
    return trainer, trainer._sample(prompts, [0, 0, 1, 1], seed_base=0, step=1)


def test_single_turn_responses_cut_at_max_new_tokens_are_at_a_limit(tokenizer):
    """DAPO's overlong filtering (mask) and punishment (penalize) for responses vLLM cut (finish_reason length)."""
    trainer, rollout = _single_turn(tokenizer, "rollout.episode_limit=mask")
    assert rollout.at_limit.tolist() == [False, True, False, True]
    assert rollout.metrics == {"episode/ended_max_new_tokens": 0.5}
    assert trainer.scoring.trained_rows(rollout.batch, rollout).loss_mask.sum(-1).tolist() == [4, 0, 4, 0]
    assert trainer.score(rollout, trainer.prompts)[0].tolist() == [1.0] * 4  # still in their groups' baselines
    trainer, rollout = _single_turn(tokenizer, "rollout.episode_limit=penalize", "rollout.limit_reward=-1")
    scores, per_source = trainer.score(rollout, trainer.prompts)
    assert scores.tolist() == [1.0, -1.0, 1.0, -1.0] and per_source["f"].tolist() == [1.0] * 4
    trainer, rollout = _single_turn(tokenizer)  # truncate (the default): trained as they stand
    assert trainer.scoring.trained_rows(rollout.batch, rollout).loss_mask.sum(-1).tolist() == [4] * 4
    assert trainer.score(rollout, trainer.prompts)[0].tolist() == [1.0] * 4


def test_a_multi_turn_run_checks_its_environment_and_chat_template_before_any_actor(tokenizer, tmp_path):
    from rlhf.trainers.online.checks import environment_status
    from rlhf.trainers.online.prompts import check_episodes

    envs = tmp_path / "envs.py"
    envs.write_text(
        "class Retry:\n    def reset(self, row):\n        return ''\n"
        "    def step(self, response, response_ids):\n        return None, 0.0, True, {}\n"
    )
    keys = ("rollout.max_turns=2", "rollout.max_prompt_length=16", "rollout.max_episode_tokens=32")
    rewriting = ChatFormatter(tokenizer, template="{{ messages[-1]['content'] }}")
    prompts = PromptSet([[1]], ["p"], {}, 0, 0, chat=rewriting)
    with pytest.raises(ConfigError, match=r"env.spec: .*has no attribute 'Retri'. Did you mean 'Retry'"):
        environment_status(f"{envs}:Retri", here=True)  # the run's preflight
    assert environment_status(f"{envs}:Retry", here=True) == "found, loads"
    with pytest.raises(ConfigError, match="rollout.observation_role=user: the chat template does not render"):
        check_episodes(_cfg(f"env.spec={envs}:Retry", *keys), prompts)
    check_episodes(_cfg(f"env.spec={envs}:Retry", *keys, "rollout.observation_format=text"), prompts)  # no chat
    check_episodes(_cfg(f"env.spec={envs}:Retry", *keys), dataclasses.replace(prompts, chat=ChatFormatter(tokenizer)))
