"""Online RL's prompt data: what a prompt row holds (the descriptor's ``row_fields``), the training and held-out
prompt sets read and tokenized with every check a run makes of them before any actor starts (``read_data`` for
``--dry-run``), an agent run once on the first row (:func:`probe_row_reads`), and the reward functions' parameters
against the columns each set gives them."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from rlhf.config.rl_schema import RewardConfig, RLRunConfig
from rlhf.config.schema import ConfigError
from rlhf.data.formats import located, prompt_fields, read_formatted, text_prompts_note
from rlhf.data.io import DataError
from rlhf.envs import EnvError, load_environment
from rlhf.envs.loading import is_agent
from rlhf.envs.rows import MissingColumn, probe_agent
from rlhf.rewards.functions import RewardFunctionError, RewardFunctionScorer, compute_rewards
from rlhf.rollout.observations import ChatObservations
from rlhf.rollout.prompts import PromptSet, prepare_prompts
from rlhf.rollout.sources import EPISODE_COLUMNS, observation_format
from rlhf.trainers.online.agent_template import check_tools_rendered
from rlhf.utils.log import get_logger
from rlhf.utils.specs import clip_plain

log = get_logger(__name__)


def row_fields(cfg: RLRunConfig) -> Dict[str, Any]:
    """The :func:`rlhf.data.io.read_rows` arguments of the prompt rows (the descriptor's ``row_fields``: no tokenizer
    needed, ``--dry-run`` reads them too). ``reward.columns`` as a user set it, and a multi-turn run's
    ``env.columns``, must be in every row, so a typo fails as the data is read, before any actor; the default
    (``answer``) is passed when present, and required when the judge's template reads it."""
    columns = tuple(dict.fromkeys(cfg.reward.columns + cfg.env.columns))  # an environment's row holds both
    named = cfg.reward.columns if cfg.reward.columns != RewardConfig().columns else ()
    required = {
        "reward.columns": named,
        "env.columns": cfg.env.columns if cfg.env.spec else (),
        "reward.judge.template": _judge_columns(cfg),
    }
    return prompt_fields(cfg.data.prompt_key, columns, required_columns=required, tools_key=cfg.data.tools_key)


def _judge_columns(cfg: RLRunConfig) -> Tuple[str, ...]:
    """The prompt-data columns the judge's template reads: a row without one would fail its rendering at the first
    scoring. Fields outside ``reward.columns`` are the preflight's to refuse (rlhf.trainers.preflight)."""
    if not cfg.reward.judge.path:
        return ()
    from rlhf.rewards.judge_spec import JudgeSpec  # imports torch's judge maths: only a run with a judge needs it

    return tuple(f for f in JudgeSpec.of(cfg.reward.judge).column_fields if f in cfg.reward.columns)


def read_prompts(cfg: RLRunConfig, tokenizer, key: str, path: str, split: str):
    d, r = cfg.data, cfg.rollout
    rows, chat = read_formatted(
        d,
        path,
        split,
        tokenizer,
        row_fields(cfg),
        chat_keys=(d.prompt_key,),
        user_turn_key=d.prompt_key if d.template_text_prompts else "",
    )
    if note := text_prompts_note(rows, d.prompt_key, tokenizer):
        log.info(f"[rl] {key}: {note}")
    with located(key, path):
        return prepare_prompts(
            rows,
            tokenizer,
            prompt_key=d.prompt_key,
            columns=cfg.reward.columns,
            max_prompt_length=r.max_prompt_length,
            overflow=r.prompt_overflow,
            chat=chat,
            tools_key=d.tools_key,
        )


def read_prompt_sets(cfg: RLRunConfig, tokenizer) -> Tuple[PromptSet, Optional[PromptSet]]:
    """The training and held-out prompts, tokenized, with every check a run makes of them before any actor starts
    (a set left empty by rollout.max_prompt_length, a multi-turn run's observations, an agent run's tools against
    the endpoint's chat template: rlhf.trainers.online.agent_template)."""
    d, r = cfg.data, cfg.rollout
    prompts = read_prompts(cfg, tokenizer, "data.train_path", d.train_path, d.split)
    eval_prompts = (
        read_prompts(cfg, tokenizer, "data.eval_path", d.eval_path, d.eval_split or d.split) if d.eval_path else None
    )
    for key, path, prompt_set in (
        ("data.train_path", d.train_path, prompts),
        ("data.eval_path", d.eval_path, eval_prompts),
    ):
        if prompt_set is not None and not prompt_set.prompt_ids:  # an evaluation of nothing: no reward, NaN lengths
            raise DataError(
                f"{key}={path}: every prompt is longer than rollout.max_prompt_length="
                f"{r.max_prompt_length} ({prompt_set.skipped} skipped); raise it or set "
                f"rollout.prompt_overflow=truncate"
            )
    if cfg.multi_turn:
        check_episodes(cfg, prompts, eval_prompts)
    if cfg.multi_turn and _agent_run(cfg):  # the endpoint's template must write the tools the episodes carry
        check_tools_rendered(cfg, tokenizer, (prompts, eval_prompts))
    return prompts, eval_prompts


def _agent_run(cfg: RLRunConfig) -> bool:
    """Whether ``env.spec`` names an agent function. False when it does not load here: the preflight refuses it in a
    run, and ``--dry-run`` leaves a spec only the cluster has to the run."""
    try:
        return is_agent(load_environment(cfg.env.spec))
    except EnvError:
        return False


def check_episodes(cfg: RLRunConfig, *prompt_sets: Optional[PromptSet]) -> None:
    """What a multi-turn run needs of its prompts, checked before any actor starts (the environment class loaded in
    the preflight): each prompt set (training, held-out) can take its observations (chat format: conversational
    prompts whose template renders observation turns, rlhf.rollout.observations)."""
    r = cfg.rollout
    for prompts in filter(None, prompt_sets):
        if observation_format(r.observation_format, prompts.chat is not None) == "chat":
            try:
                ChatObservations(prompts.chat, r.observation_role)
            except ValueError as e:  # names rollout.observation_role
                raise ConfigError(str(e)) from None


def check_reward_columns(
    cfg: RLRunConfig, scorer: RewardFunctionScorer, prompts: PromptSet, eval_prompts: Optional[PromptSet]
) -> None:
    """Each reward function's parameters against the columns each prompt set gives it: the ``reward.columns`` every
    row of the set has (the default, ``answer``, is optional) and an episode's. A parameter that no column fills
    would stop the run at the evaluation before its first step, or at the first step, after every actor started."""
    episode = EPISODE_COLUMNS if cfg.multi_turn else ()
    for key, prompt_set in (("data.train_path", prompts), ("data.eval_path", eval_prompts)):
        if prompt_set is None:
            continue
        columns = [*prompt_set.columns, *episode]
        try:  # no sample: the functions are not called, their parameters are bound (as each scoring binds them)
            compute_rewards(scorer.load(), [], [], {c: [] for c in columns})
        except RewardFunctionError as e:
            raise ConfigError(
                f"reward.functions: with the columns of {key} ({', '.join(columns) or 'none'}), {e}"
            ) from None


def read_data(cfg: RLRunConfig, tokenizer) -> str:
    """``--dry-run``: the prompts read and tokenized as the run reads them (the descriptor's ``read_data``), and an
    agent (``env.spec`` naming a function) run once on the first row (:func:`probe_row_reads`)."""
    prompts, eval_prompts = read_prompt_sets(cfg, tokenizer)
    held_out = f"; {len(eval_prompts.prompt_ids)} held-out" if eval_prompts is not None else ""
    return (
        f"{len(prompts.prompt_ids)} prompts tokenized ({prompts.skipped} skipped, {prompts.truncated} truncated)"
        f"{held_out}{probe_row_reads(cfg, prompts)}"
    )


def probe_row_reads(cfg: RLRunConfig, prompts: PromptSet) -> str:
    """An agent run once on the first prompt row as the run would give it, with a stand-in client
    (:func:`rlhf.envs.rows.probe_agent`): a field it reads that no key passes is a :class:`ConfigError` naming
    ``env.columns``, here rather than in every episode after the start-up. Returns what the dry run prints."""
    if not cfg.env.spec or not prompts.env_rows:
        return ""
    agent = load_environment(cfg.env.spec)
    if not is_agent(agent):
        return ""
    try:
        stopped = probe_agent(agent, prompts.env_rows[0])
    except MissingColumn as e:
        where = f"env.columns: agent {cfg.env.spec} read a field of prompt row 0 it does not get"
        raise ConfigError(f"{where}: {e}") from None
    if stopped is None:
        return "; the agent ran on row 0 (stand-in replies)"
    return f"; the agent ran on row 0 until the stand-in's empty reply stopped it ({clip_plain(stopped, 120)})"
