"""What an agent run takes from the template its endpoint renders with (issue #37, items 1 and 2).

1. The stop tokens: an agent's replies end at the endpoint's template's end of turn (and EOS), whatever the prompt
   rows' format. Text prompt rows used to leave the engines only EOS to stop on, so every reply ran to
   ``rollout.max_new_tokens`` as ``4<|im_end|><|im_end|>...``. Real pieces: the prompt set as the run reads it, the
   run's agent rollout, the endpoint with vLLM's renderer on the tiny model, the real ``openai`` client; the engines
   are a stand-in that stops as vLLM stops (on EOS and the request's stop ids, else at its length).
2. The tools probe: a run whose agent sends tools (``env.tool_parser``) or whose data has them refuses, before any
   actor starts, a template that does not write them (the tiny model's ChatML), naming ``env.chat_template``;
   accepts a template that does (the tiny model's tools templates); ``env.allow_unrendered_tools=true`` turns the
   refusal into a warning.
"""

from __future__ import annotations

import json

import pytest

from rlhf.rollout.types import Generation, SamplingSpec

TEXT_ROWS = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "1+3=", "answer": "4"}]


class StoppingEngines:
    """A policy that answers ``reply`` and then writes the template's end of turn over and over, sampled as vLLM
    samples: a request stops after EOS or one of its ``stop_token_ids`` (finish ``stop``), else at its
    ``max_new_tokens`` (finish ``length``). Records each request's stop ids."""

    def __init__(self, tokenizer, reply: str) -> None:
        self.eos = tokenizer.eos_token_id
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stream = list(tokenizer(reply, add_special_tokens=False)["input_ids"]) + [end] * 64
        self.asked: list = []

    def generate_each(self, prompt_ids, samplings):
        self.asked += [tuple(s.stop_token_ids) for s in samplings]
        return [self._one(tuple(p), s) for p, s in zip(prompt_ids, samplings)]

    def _one(self, prompt, sampling: SamplingSpec) -> Generation:
        stops = {self.eos, *sampling.stop_token_ids}
        ids = []
        for token in self.stream[: sampling.max_new_tokens]:
            ids.append(token)
            if token in stops:
                return Generation(prompt, tuple(ids), (-0.1,) * len(ids), "stop")
        return Generation(prompt, tuple(ids), (-0.1,) * len(ids), "length")


async def _ask(client, row):
    """An agent of the issue's shape: one question, rewarded on the reply's text."""
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return float(reply.choices[0].message.content == row["answer"])


class LocalPool:
    """The environment pool's ``run_agents``, in this process (the agents as an actor runs them)."""

    def __init__(self, agent) -> None:
        self.agent = agent

    def run_agents(self, urls, rows, errors="raise"):
        from rlhf.envs.agents import run_agents

        results, _ = run_agents(self.agent, "test_agent_template.py:_ask", list(enumerate(zip(urls, rows))), 30.0)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed and errors == "raise":
            raise failed[0]
        return results


def test_an_agent_run_with_text_prompt_rows_stops_at_the_templates_end_of_turn(tiny_model):
    from transformers import AutoTokenizer

    from rlhf.rollout.agent import AgentRollout
    from rlhf.rollout.openai.endpoint import AgentEndpoint
    from rlhf.rollout.openai.render import OpenAIRenderer
    from rlhf.rollout.prompts import prepare_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = prepare_prompts(
        TEXT_ROWS, tokenizer, prompt_key="prompt", columns=("answer",), max_prompt_length=64, overflow="skip"
    )
    assert prompts.chat is None  # text rows: no chat formatter, so no end of turn among the prompt set's stops
    # the trainer's sampling of the step, as RLTrainer._sampling builds it from the prompt set
    sampling = SamplingSpec(max_new_tokens=8, temperature=1.0, seed=7, stop_token_ids=prompts.stop_token_ids)
    renderer = OpenAIRenderer(tiny_model, served_model_name="policy")  # the template: the tokenizer's ChatML
    engines = StoppingEngines(renderer.tokenizer, "4")
    with AgentEndpoint(renderer, engines.generate_each, SamplingSpec(max_new_tokens=8)) as endpoint:
        rollout = AgentRollout(LocalPool(_ask), endpoint, tokenizer, 64, 2, "error", "fail")(
            None, prompts, [0, 1, 0], sampling, step=1
        )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    four = tokenizer("4", add_special_tokens=False)["input_ids"]
    replies = [row[mask.bool()].tolist() for row, mask in zip(rollout.batch.input_ids, rollout.batch.loss_mask)]
    assert replies == [four + [end]] * 3  # "4<|im_end|>", not "4<|im_end|><|im_end|>..." to max_new_tokens
    assert rollout.metrics["episode/ended_max_new_tokens"] == 0.0 and rollout.metrics["episode/ended_done"] == 1.0
    assert rollout.responses == ["4"] * 3 and rollout.env_rewards.tolist() == [1.0] * 3
    assert all(end in asked and tokenizer.eos_token_id in asked for asked in engines.asked), engines.asked


# ---------------------------------------------------------------------------------------------------------------
# 2. The tools probe, before any actor starts (the run's read of its prompts, and --dry-run's)
# ---------------------------------------------------------------------------------------------------------------

MUL = {
    "type": "function",
    "function": {
        "name": "mul",
        "description": "Multiply two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _agent_run(tiny_model, prompts, tmp_path, *overrides):
    from rlhf.config import load_config
    from rlhf.config.rl_schema import RLRunConfig

    agent = tmp_path / "agent.py"
    agent.write_text("async def run(client, row):\n    return 0.0\n")
    keys = [f"model.path={tiny_model}", f"data.train_path={prompts}", f"env.spec={agent}:run", "rollout.max_turns=2"]
    keys += ["rollout.max_prompt_length=64", "rollout.max_episode_tokens=128", *overrides]
    return load_config(RLRunConfig, "grpo_tiny", keys)


def _read(cfg):
    """The prompts as the run reads them, every check before any actor included."""
    from rlhf.data.vocab import load_tokenizer
    from rlhf.trainers.online.prompts import read_prompt_sets

    return read_prompt_sets(cfg, load_tokenizer(cfg))


def test_tools_the_agent_sends_to_a_template_that_drops_them_are_refused_before_any_actor(
    tiny_model, rl_prompts, tmp_path
):
    """The tiny model's ChatML has no ``tools``: with ``env.tool_parser`` set the run expects calls that can never
    come. The run's read of its prompts and ``--dry-run`` refuse it, naming env.chat_template and both ways on."""
    from shared_helpers import preflight

    from rlhf.config.schema import ConfigError
    from rlhf.models.tiny import SHORT_TOOLS_CHAT_TEMPLATE, write_tools_template

    cfg = _agent_run(tiny_model, rl_prompts, tmp_path, "env.tool_parser=hermes")
    expected = (
        rf"env.chat_template: the endpoint's chat template \(the tokenizer's own, of model.path={tiny_model}\) does "
        r"not write tools: a request renders to the same prompt with a tool and without, so the tools the agent "
        r"sends \(env.tool_parser=hermes\) would never reach the policy. Set env.chat_template to a template that "
        r"renders `tools` \(for the tiny model: tools.jinja, .*\), or env.allow_unrendered_tools=true to run anyway"
    )
    with pytest.raises(ConfigError, match=expected):
        _read(cfg)
    with pytest.raises(ConfigError, match=expected):
        preflight(cfg, here=False)  # --dry-run
    # a data.chat_template that writes tools is the prompt rows' template, not the endpoint's: still refused
    tools = write_tools_template(str(tmp_path / "tools.jinja"), SHORT_TOOLS_CHAT_TEMPLATE)
    with pytest.raises(ConfigError, match=expected):
        _read(_agent_run(tiny_model, rl_prompts, tmp_path, "env.tool_parser=hermes", f"data.chat_template={tools}"))
    prompts, _ = _read(_agent_run(tiny_model, rl_prompts, tmp_path))  # no tools in play: ChatML is fine
    assert len(prompts.prompt_ids) == 64


def test_tools_in_the_data_are_refused_with_a_template_that_drops_them(tiny_model, tmp_path):
    from rlhf.config.schema import ConfigError

    rows = tmp_path / "tools.jsonl"
    asks = [{"prompt": [{"role": "user", "content": q}], "tools": [MUL]} for q in ("3*4=", "5*6=")]
    rows.write_text("".join(json.dumps(ask) + "\n" for ask in asks))
    with pytest.raises(ConfigError, match=r"so the tools of 2 prompt rows \(data.tools_key=tools\) would never reach"):
        _read(_agent_run(tiny_model, rows, tmp_path))


def test_a_template_that_writes_the_tools_is_accepted(tiny_model, rl_prompts, tmp_path):
    """The tools template make_assets writes (short header), the example's (JSON header), and a template given as
    text: each renders the tools, so the run reads its prompts."""
    from rlhf.cli.make_assets import make_assets
    from rlhf.models.tiny import SHORT_TOOLS_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, write_tools_template

    written = make_assets(str(tmp_path / "assets"), num_sft=1, num_pref=1, num_prompts=1, num_eval_prompts=1)
    assert open(written["tools_template"], encoding="utf-8").read() == SHORT_TOOLS_CHAT_TEMPLATE
    model = written["model"]
    json_header = write_tools_template(str(tmp_path / "json_tools.jinja"))
    for template in (written["tools_template"], json_header, TOOLS_CHAT_TEMPLATE):
        cfg = _agent_run(model, rl_prompts, tmp_path, "env.tool_parser=hermes", f"env.chat_template={template}")
        prompts, _ = _read(cfg)
        assert len(prompts.prompt_ids) == 64


def test_env_allow_unrendered_tools_turns_the_refusal_into_a_warning(tiny_model, rl_prompts, tmp_path, capsys):
    cfg = _agent_run(tiny_model, rl_prompts, tmp_path, "env.tool_parser=hermes", "env.allow_unrendered_tools=true")
    prompts, _ = _read(cfg)
    assert len(prompts.prompt_ids) == 64
    err = capsys.readouterr().err
    assert "warning: the endpoint's chat template (the tokenizer's own, of model.path=" in err
    assert "does not write tools" in err and "(env.allow_unrendered_tools=true: the run goes on)" in err


def test_the_probe_agrees_with_the_endpoints_own_render_and_the_short_header_fits_the_tiny_model(tiny_model, tmp_path):
    """The probe (the tokenizer's apply_chat_template) says what vLLM's renderer, the endpoint's, does: ChatML
    renders the same ids with tools and without, the tools templates do not. The short header of a two-argument
    tool is ~1/3 of the JSON one, and the endpoint's replies stop at the tools template's end of turn too."""
    from transformers import AutoTokenizer

    from rlhf.models.tiny import SHORT_TOOLS_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, write_tools_template
    from rlhf.rollout.openai.endpoint import AgentEndpoint
    from rlhf.rollout.openai.render import OpenAIRenderer
    from rlhf.trainers.online.agent_template import endpoint_template, renders_tools

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    short = write_tools_template(str(tmp_path / "tools.jinja"), SHORT_TOOLS_CHAT_TEMPLATE)
    ask = {"model": "p", "messages": [{"role": "user", "content": "3*4="}]}
    lengths = {}
    for name, template in (("chatml", None), ("short", short), ("json", TOOLS_CHAT_TEMPLATE)):
        renderer = OpenAIRenderer(tiny_model, tool_parser="hermes", chat_template=template, served_model_name="p")
        plain = renderer.render_chat(ask).prompt_ids
        with_tools = renderer.render_chat({**ask, "tools": [MUL]}).prompt_ids
        assert renders_tools(tokenizer, endpoint_template(template or "")) == (plain != with_tools), name
        lengths[name] = len(with_tools) - len(plain)
        endpoint = AgentEndpoint(renderer, lambda prompts, samplings: [], SamplingSpec(max_new_tokens=4))
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert endpoint.stop_token_ids == (tokenizer.eos_token_id, end), name
        endpoint.stop()
    assert lengths["chatml"] == 0 and 0 < lengths["short"] < 120 < 300 < lengths["json"], lengths


def test_the_short_tools_template_masks_a_tool_calling_warm_up_exactly(tiny_model):
    """As data.chat_template for an SFT warm-up: its turns are the JSON template's, so a call and the answer after
    the tool's result are what the loss covers, each with its end of turn."""
    from transformers import AutoTokenizer

    from rlhf.data.chat import ChatFormatter
    from rlhf.models.tiny import SHORT_TOOLS_CHAT_TEMPLATE

    chat = ChatFormatter(AutoTokenizer.from_pretrained(tiny_model), template=SHORT_TOOLS_CHAT_TEMPLATE)
    call = {"type": "function", "function": {"name": "mul", "arguments": {"a": 3, "b": 4}}}
    messages = [
        {"role": "user", "content": "3*4="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "12"},
    ]
    encoded = chat.encode(messages, [1, 3], tools=[MUL])
    trained = chat.tokenizer.decode([t for t, m in zip(encoded.input_ids, encoded.loss_mask) if m])
    assert trained == '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>12<|im_end|>'
    assert "mul(a, b) Multiply two integers" in chat.render(messages, tools=[MUL])
