"""Does the chat template an agent run's endpoint renders with write the tools? Checked before any actor starts.

The endpoint (:mod:`rlhf.rollout.openai.endpoint`) renders every chat request with ``env.chat_template``, else with the
template of the tokenizer at ``model.path`` (vLLM loads it from there). A template without a ``tools`` variable (the
tiny model's ChatML, many base models' templates) renders a request with tools exactly as one without: the agent
sends its tools, the policy never sees them, no call is ever made, and nothing says so. :func:`check_tools_rendered`
renders a one-message request with a tool and without, and refuses the run naming ``env.chat_template`` when the two
are the same while tools are in play: the agent's (``env.tool_parser`` set: the run expects calls) or the data's
(rows with ``data.tools_key``). ``env.allow_unrendered_tools=true`` turns the refusal into a warning.

The run and ``--dry-run`` both check it as they read the prompts (:func:`rlhf.trainers.online.runner.read_prompt_sets`),
with the tokenizer's own ``apply_chat_template``, which is what vLLM's renderer calls for a Hugging Face tokenizer:
no vLLM, no engine.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from rlhf.config.rl_schema import RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.chat import row_tools
from rlhf.hub import model_dir
from rlhf.rollout.prompts import PromptSet
from rlhf.utils.log import get_logger

log = get_logger(__name__)

#: the tool of the probe request: any template that writes tools writes this one
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe tool",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}
_PROBE_MESSAGES = [{"role": "user", "content": "1"}]
#: where the docs point a user whose template drops the tools
TOOLS_TEMPLATE_HINT = "for the tiny model: tools.jinja, which python -m rlhf.cli.make_assets writes"


def renders_tools(tokenizer: Any, template: Optional[str]) -> bool:
    """Whether ``template`` (its text; None: the tokenizer's own) writes a request's tools into the prompt: a request
    rendered with :data:`PROBE_TOOL` and without differ. Raises what the template raises (no template at all, a
    template that fails on tools)."""

    def render(tools: Optional[list]) -> str:
        return tokenizer.apply_chat_template(
            _PROBE_MESSAGES, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
        )

    return render([PROBE_TOOL]) != render(None)


def endpoint_template(setting: str) -> Optional[str]:
    """``env.chat_template`` as the endpoint reads it (vLLM's ``load_chat_template``): a file's text, else the text
    given when it is a template's, else a vLLM built-in template's name; None for "" (the tokenizer's own)."""
    if not setting:
        return None
    if os.path.isfile(setting):
        with open(setting, encoding="utf-8") as f:
            return f.read()
    if any(c in setting for c in "{}\n"):
        return setting
    from vllm.renderers.chat_utils import load_chat_template  # a built-in template's name: vLLM's to find

    try:
        return load_chat_template(setting)
    except ValueError as e:
        raise ConfigError(f"env.chat_template: {setting!r} is not a file nor a template's text ({e})") from None


def endpoint_tokenizer(cfg: RLRunConfig, tokenizer: Any) -> Any:
    """The tokenizer the endpoint renders with: ``model.path``'s own, as vLLM loads it. That is the run's tokenizer
    unless ``model.tokenizer_path`` names another or a ``data.chat_template`` file replaced its template."""
    if not cfg.model.tokenizer_path and cfg.data.chat_template in ("auto", "none"):
        return tokenizer
    from transformers import AutoTokenizer  # lazy: the run's own tokenizer serves unless another is named

    return AutoTokenizer.from_pretrained(model_dir(cfg.model.path))


def tools_in_play(cfg: RLRunConfig, prompt_sets: Sequence[Optional[PromptSet]]) -> str:
    """Why the run's requests carry tools, as a phrase for the refusal; "" when nothing says they do."""
    if cfg.env.tool_parser:
        return f"the agent sends (env.tool_parser={cfg.env.tool_parser})"
    rows = sum(bool(row_tools(row, ps.tools_key)) for ps in prompt_sets if ps is not None for row in ps.env_rows)
    return f"of {rows} prompt rows (data.tools_key={cfg.data.tools_key})" if rows else ""


def check_tools_rendered(cfg: RLRunConfig, tokenizer: Any, prompt_sets: Sequence[Optional[PromptSet]]) -> None:
    """Refuse (or, with ``env.allow_unrendered_tools``, warn about) an agent run whose tools the endpoint's template
    would drop (the module docstring). ``tokenizer``: the run's; ``prompt_sets``: its prompt sets, None skipped.

    Raises:
        ConfigError: Naming ``env.chat_template``, what carries the tools and the two ways on.
    """
    why = tools_in_play(cfg, prompt_sets)
    if not why:
        return
    which = _which(cfg)
    try:
        rendered = renders_tools(endpoint_tokenizer(cfg, tokenizer), endpoint_template(cfg.env.chat_template))
    except Exception as e:  # noqa: BLE001 - no template, or a Jinja error: the endpoint would fail the same way
        raise ConfigError(
            f"env.chat_template: the endpoint's chat template ({which}) cannot render a request with tools: "
            f"{type(e).__name__}: {e}"
        ) from None
    if rendered:
        return
    problem = (
        f"the endpoint's chat template ({which}) does not write tools: a request renders to the same prompt with a "
        f"tool and without, so the tools {why} would never reach the policy"
    )
    if cfg.env.allow_unrendered_tools:
        log.warning(f"warning: {problem} (env.allow_unrendered_tools=true: the run goes on)")
        return
    raise ConfigError(
        f"env.chat_template: {problem}. Set env.chat_template to a template that renders `tools` "
        f"({TOOLS_TEMPLATE_HINT}), or env.allow_unrendered_tools=true to run anyway"
    )


def _which(cfg: RLRunConfig) -> str:
    """The endpoint's template, as the refusal names it."""
    setting = cfg.env.chat_template
    if not setting:
        return f"the tokenizer's own, of model.path={cfg.model.path}"
    return f"env.chat_template={setting}" if os.path.isfile(setting) else "the template text of env.chat_template"
