"""Write the tiny model and the synthetic arithmetic datasets that tests, examples and the demo train on.

Usage::

    python -m rlhf.cli.make_assets --out assets/ [--seed 0] [--num-sft 2000] [--num-pref 2000]
        [--num-prompts 512] [--num-eval-prompts 128] [--max-operand 20] [--force]

Writes under ``--out`` the files of :data:`WRITES` (what ``--help`` lists): ``model/`` (tiny Qwen2 + tokenizer
with a ChatML chat template), ``sft.jsonl``, ``preference.jsonl``, ``unpaired.jsonl`` (its pairs as KTO's
thumbs-up / down rows), ``prompts.jsonl`` and ``eval_prompts.jsonl``, the conversational forms of the training
files (``sft_chat.jsonl``, ``preference_chat.jsonl``, ``prompts_chat.jsonl``), and ``tools.jinja``: the model's
ChatML with tools (:data:`rlhf.models.tiny.SHORT_TOOLS_CHAT_TEMPLATE`; its own template drops them), for an agent
run's ``env.chat_template`` and a tool-calling warm-up's ``data.chat_template``. Anything that already exists is kept
unless ``--force``; every output appears atomically, so an existing path is always a complete one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import textwrap
from typing import Callable, Sequence

from rlhf.models.tiny import SHORT_TOOLS_CHAT_TEMPLATE, build_tiny_model, write_tools_template
from rlhf.synthetic import arithmetic

#: Each output under --out, what it holds and what reads it (``--help`` prints this list; README.md names them).
WRITES = (
    (
        "model/",
        "a tiny random Qwen2 causal LM (0.5M parameters, 512 positions) with a byte-level BPE tokenizer trained on the "
        "task and a ChatML chat template (<|im_start|>role ... <|im_end|>; no tools): model.path",
    ),
    ("sft.jsonl", "--num-sft rows {prompt: '12+7=', response: '19'}: SFT (sft_tiny)"),
    (
        "preference.jsonl",
        "--num-pref pairs {prompt, chosen, rejected, margin}: DPO (dpo_tiny), reward models (rm_tiny)",
    ),
    (
        "unpaired.jsonl",
        "preference.jsonl as thumbs-up / thumbs-down rows {prompt, completion, label}, two per pair: KTO "
        "(dpo_tiny with dpo.loss_type=kto)",
    ),
    ("prompts.jsonl", "--num-prompts RL prompts {prompt, answer}: online RL (grpo_tiny)"),
    ("eval_prompts.jsonl", "--num-eval-prompts held-out RL prompts, another draw: data.eval_path"),
    (
        "sft_chat.jsonl",
        "sft.jsonl as conversations {messages: [system, user, assistant, ...]}, every third with a second "
        "question: a chat warm-up (sft_chat_tiny)",
    ),
    (
        "preference_chat.jsonl",
        "preference.jsonl as a prompt conversation and one assistant message each chosen / rejected",
    ),
    (
        "prompts_chat.jsonl",
        "prompts.jsonl as conversations {prompt: [system, user], answer}: chat RL, agents and multi-turn "
        "environments (agent_tiny)",
    ),
    (
        "tools.jinja",
        "the model's ChatML with a short tools header (its own template drops tools): env.chat_template of a "
        "tool-calling agent run, data.chat_template of its warm-up",
    ),
)

# Each file samples from its own seed so that the files are independent draws. Multiplying keeps runs with
# neighbouring --seed values from sharing streams (seed 1's SFT rows are not seed 0's preference rows).
_SEED_STRIDE = 1000
_SFT, _PREF, _PROMPTS, _EVAL = 0, 1, 2, 3


def _derived_seed(seed: int, offset: int) -> int:
    return seed * _SEED_STRIDE + offset


def _build_model_atomically(model_dir: str, seed: int) -> None:
    """Build into a sibling temp dir and rename, so a crash never leaves a half model that a rerun would skip."""
    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".model-", dir=parent)
    try:
        build_tiny_model(tmp, seed=seed)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if os.path.exists(model_dir):
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def make_assets(
    out: str,
    seed: int = 0,
    num_sft: int = 2000,
    num_pref: int = 2000,
    num_prompts: int = 512,
    num_eval_prompts: int = 128,
    max_operand: int = arithmetic.DEFAULT_MAX_OPERAND,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """Write the model and datasets under ``out``; keep existing outputs unless ``force``.

    Args:
        out: Output directory (created).
        seed: Master seed for the model weights and all datasets.
        num_sft: Rows in ``sft.jsonl``.
        num_pref: Pairs in ``preference.jsonl``.
        num_prompts: Prompts in ``prompts.jsonl`` (online RL).
        num_eval_prompts: Prompts in ``eval_prompts.jsonl``. They come from a different seed than the training
            files; with small operands the problem space is tiny, so they are a fresh sample, not a disjoint set.
        max_operand: Operands are drawn from ``0..max_operand``.
        force: Rebuild outputs that already exist.
        log: Called with one line per output (e.g. ``print``); silent if None.

    Returns:
        Paths keyed ``model``, ``sft``, ``preference``, ``unpaired``, ``prompts``, ``eval_prompts``, ``sft_chat``,
        ``preference_chat``, ``prompts_chat``, ``tools_template``.
    """
    say = log or (lambda _msg: None)
    os.makedirs(out, exist_ok=True)
    paths = {
        "model": os.path.join(out, "model"),
        "sft": os.path.join(out, "sft.jsonl"),
        "preference": os.path.join(out, "preference.jsonl"),
        "unpaired": os.path.join(out, "unpaired.jsonl"),
        "prompts": os.path.join(out, "prompts.jsonl"),
        "eval_prompts": os.path.join(out, "eval_prompts.jsonl"),
        "sft_chat": os.path.join(out, "sft_chat.jsonl"),
        "preference_chat": os.path.join(out, "preference_chat.jsonl"),
        "prompts_chat": os.path.join(out, "prompts_chat.jsonl"),
        "tools_template": os.path.join(out, "tools.jinja"),
    }
    makers: dict[str, Callable[[], list[dict]]] = {
        "sft": lambda: arithmetic.make_sft_rows(num_sft, _derived_seed(seed, _SFT), max_operand),
        "preference": lambda: arithmetic.make_preference_rows(num_pref, _derived_seed(seed, _PREF), max_operand),
        "prompts": lambda: arithmetic.make_rl_prompts(num_prompts, _derived_seed(seed, _PROMPTS), max_operand),
        "eval_prompts": lambda: arithmetic.make_rl_prompts(num_eval_prompts, _derived_seed(seed, _EVAL), max_operand),
        # The same draws as conversations (the chat template of the tiny tokenizer renders them).
        "sft_chat": lambda: arithmetic.to_chat_sft(makers["sft"]()),
        "preference_chat": lambda: arithmetic.to_chat_preference(makers["preference"]()),
        "unpaired": lambda: arithmetic.to_unpaired(makers["preference"]()),
        "prompts_chat": lambda: arithmetic.to_chat_prompts(makers["prompts"]()),
    }

    if os.path.exists(paths["model"]) and not force:
        say(f"kept    {paths['model']} (exists; --force to rebuild)")
    else:
        _build_model_atomically(paths["model"], seed)
        say(f"wrote   {paths['model']}")
    if os.path.exists(paths["tools_template"]) and not force:
        say(f"kept    {paths['tools_template']} (exists; --force to rebuild)")
    else:
        write_tools_template(paths["tools_template"], SHORT_TOOLS_CHAT_TEMPLATE)
        say(f"wrote   {paths['tools_template']} (the model's chat template with tools, for env.chat_template)")
    for name, make in makers.items():
        path = paths[name]
        if os.path.exists(path) and not force:
            say(f"kept    {path} (exists; --force to rebuild)")
            continue
        rows = make()
        arithmetic.write_jsonl(path, rows)
        say(f"wrote   {path} ({len(rows)} rows)")
    return paths


def _epilog() -> str:
    """``--help``'s list of the outputs: a user picks the files for the next command from it."""
    width = max(len(name) for name, _ in WRITES)
    lines = ["writes, under --out:"]
    for name, what in WRITES:
        wrapped = textwrap.wrap(what, width=100 - width - 4)
        lines.append(f"  {name.ljust(width)}  {wrapped[0]}")
        lines += [f"  {'':{width}}  {line}" for line in wrapped[1:]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf.cli.make_assets",
        description="Write the tiny model and the datasets of a synthetic addition task (a+b=, answers a reward\n"
        "function checks) under --out. What exists is kept unless --force.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="the model's weights and every file's draws (default 0)")
    parser.add_argument("--num-sft", type=int, default=2000, help="rows of sft.jsonl and sft_chat.jsonl")
    parser.add_argument("--num-pref", type=int, default=2000, help="pairs of preference(_chat).jsonl")
    parser.add_argument("--num-prompts", type=int, default=512, help="prompts of prompts(_chat).jsonl")
    parser.add_argument("--num-eval-prompts", type=int, default=128, help="prompts of eval_prompts.jsonl")
    parser.add_argument(
        "--max-operand", type=int, default=arithmetic.DEFAULT_MAX_OPERAND, help="operands are drawn from 0..this"
    )
    parser.add_argument("--force", action="store_true", help="rebuild outputs that already exist")
    args = parser.parse_args(argv)
    make_assets(
        args.out,
        seed=args.seed,
        num_sft=args.num_sft,
        num_pref=args.num_pref,
        num_prompts=args.num_prompts,
        num_eval_prompts=args.num_eval_prompts,
        max_operand=args.max_operand,
        force=args.force,
        log=print,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
