"""Multi-turn GRPO from the Python API: an SFT warm-up, then RL turn by turn against an environment pool.

Run from the repo root (2 and 4 minutes on 2 CPU cores; examples/multi_turn/README.md has the figures)::

    .venv/bin/python examples/multi_turn/train_loop.py --env calculator   # a tool call pays off
    .venv/bin/python examples/multi_turn/train_loop.py --env retry        # feedback and one retry

Both build the tiny model, write the example's data (examples/multi_turn/data.py), warm it up with SFT
(``rlhf.trainers.offline.sft.train_sft``, the ``sft_tiny`` preset) and then run GRPO. One RL step::

    records = run_episodes(engines, pool, ...)      # every live episode's next turn together, then the envs'
    batch = episodes_batch(episodes, pad_id)        # one row per episode; loss on the policy's tokens only
    old_logps = policy.score_batch(batch, TokenLogps())
    batch = advantages_for(batch, rewards, group_ids, estimator="grpo")
    policy.train_batch(batch, objective); policy.push_weights()

It prints one line per step (reward, accuracy, turns per episode, how often the tool was called or a retry was
needed, the trainer-vs-vLLM log-prob mismatch), a held-out evaluation of the warmed-up model and of the final
one (the same rollout on prompts of another seed), and a ``done:`` line with the first and last steps' rewards.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

os.environ.setdefault("DS_ACCELERATOR", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
SMOOTH = 5  # steps averaged in the done: line's first / last reward


@dataclass(frozen=True)
class Settings:
    """What an example trains with; the README's table (and the CLI presets) copy these."""

    sft_epochs: int  # warm-up epochs over data.py's SFT rows
    sft_lr: float
    lr: float  # RL: constant, one optimizer step per RL step
    steps: int  # RL steps
    prompts_per_step: int
    samples_per_prompt: int  # the GRPO group of each prompt
    max_turns: int  # rollout.max_turns
    max_episode_tokens: int  # rollout.max_episode_tokens: prompt + responses + observations
    max_new_tokens: int  # per turn


SETTINGS = {
    # A call is 18 tokens + EOS; up to 2 calls and an answer. Calling is one decision at the first token, which
    # GRPO moves in ~10 steps at 2e-4.
    "calculator": Settings(
        sft_epochs=8,
        sft_lr=1e-3,
        lr=2e-4,
        steps=30,
        prompts_per_step=8,
        samples_per_prompt=8,
        max_turns=3,
        max_episode_tokens=96,
        max_new_tokens=20,
    ),
    # Sums are per-problem knowledge, which RL sharpens slowly on this model: 5e-5 rises steadily over 300 steps,
    # 1e-4 dips first, 3e-4 and above collapse the warmed-up model (measured; README).
    "retry": Settings(
        sft_epochs=8,
        sft_lr=1e-3,
        lr=5e-5,
        steps=300,
        prompts_per_step=16,
        samples_per_prompt=8,
        max_turns=2,
        max_episode_tokens=48,
        max_new_tokens=6,
    ),
}


def _sibling(name: str):
    """``examples/multi_turn/<name>.py`` as a module (this directory is not a package on the path)."""
    spec = importlib.util.spec_from_file_location(f"multi_turn_example_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: pickling and dataclasses look a module up by name
    spec.loader.exec_module(module)
    return module


data = _sibling("data")


# ---------------------------------------------------------------------------- what an episode did
def episode_stats(env: str, records: Sequence, decode: Callable[[Sequence[int]], str]) -> Dict[str, float]:
    """Means over episodes: ``reward``, ``accuracy`` (a right answer at any turn), ``turns``, and per example
    ``tool_rate`` / ``tool_calls`` and the accuracy with and without a call (calculator) or ``retry_rate`` and
    ``retry_success`` (retry)."""
    n = max(len(records), 1)
    stats = {
        "reward": sum(r.reward for r in records) / n,
        "accuracy": sum(r.reward > 0 for r in records) / n,
        "turns": sum(r.episode.turns for r in records) / n,
    }
    if env == "calculator":
        from rlhf.envs import load_environment

        is_call = load_environment(data.SPECS["calculator"]).is_call
        calls = [sum(is_call(decode(s.ids)) for s in r.episode.segments if s.source == "policy") for r in records]
        used = [r for r, c in zip(records, calls) if c]
        direct = [r for r, c in zip(records, calls) if not c]
        stats.update(
            tool_rate=len(used) / n,
            tool_calls=sum(calls) / n,
            acc_tool=_share(r.reward > 0 for r in used),
            acc_direct=_share(r.reward > 0 for r in direct),
        )
    else:
        retried = [r for r in records if r.episode.turns > 1]
        stats.update(
            retry_rate=len(retried) / n,
            first_try=sum(r.reward == 1.0 for r in records) / n,
            retry_success=_share(r.reward > 0 for r in retried),
        )
    return stats


def _share(flags) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else float("nan")


def _line(env: str, s: Dict[str, float]) -> str:
    show = lambda x: "-" if x != x else f"{x:.2f}"  # noqa: E731  (NaN: no episode of that kind)
    extra = (
        f"tool rate {show(s['tool_rate'])}  calls/ep {show(s['tool_calls'])}  acc via tool {show(s['acc_tool'])}  "
        f"direct {show(s['acc_direct'])}"
        if env == "calculator"
        else f"first try {show(s['first_try'])}  retried {show(s['retry_rate'])}  retry ok {show(s['retry_success'])}"
    )
    return f"reward {s['reward']:.3f}  acc {show(s['accuracy'])}  turns {show(s['turns'])}  {extra}"


# ---------------------------------------------------------------------------- the stages
def warm_up(model_dir: str, sft_path: str, out_dir: str, settings: Settings) -> str:
    """The SFT warm-up through the toolkit's trainer; returns its final model directory."""
    from rlhf.config.loader import load_config
    from rlhf.config.schema import SFTRunConfig
    from rlhf.trainers.offline.sft import train_sft

    cfg = load_config(
        SFTRunConfig,
        "sft_tiny",
        [
            f"model.path={model_dir}",
            f"data.train_path={sft_path}",
            f"train.output_dir={out_dir}",
            f"train.max_epochs={settings.sft_epochs}",
            f"train.lr={settings.sft_lr}",
            "train.global_batch_size=32",
            "train.micro_batch_size=32",
            "train.num_workers=1",
            "logging.print_every=50",
            "train.overwrite=true",
            # the first ~100 steps of a random tiny model at this lr see grad-norm spikes of 10-20x the running median
            # (measured); clipping at 1.0 bounds the update, so a spike is reported, not a reason to stop
            "health.action=warn",
        ],
    )
    return train_sft(cfg).final_dir


class Rollout:
    """Episodes of one example on the engines and the environment pool, tokens in / tokens out."""

    def __init__(self, env: str, engines, pool, tokenizer, settings: Settings) -> None:
        from rlhf.rl import TurnLimits

        self.env, self.engines, self.pool, self.tokenizer = env, engines, pool, tokenizer
        self.limits = TurnLimits(settings.max_turns, settings.max_episode_tokens)
        self.max_new_tokens = settings.max_new_tokens

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def run(self, rows: Sequence[Dict[str, str]], seed: int):
        """One episode per row -> (records, stats). Observations are their own text's tokens, no special tokens
        (what data.py's SFT rows were built for)."""
        from rlhf.rl import SamplingSpec, TextObservations, run_episodes

        sampling = SamplingSpec(
            max_new_tokens=self.max_new_tokens, seed=seed, stop_token_ids=(self.tokenizer.eos_token_id,)
        )
        prompt_ids = [self.tokenizer(r["prompt"])["input_ids"] for r in rows]
        records = run_episodes(
            self.engines,
            self.pool,
            prompt_ids,
            rows,
            sampling,
            TextObservations.of(self.tokenizer),
            self.decode,
            self.limits,
        )
        return records, episode_stats(self.env, records, self.decode)


def rl_step(
    rollout: Rollout,
    policy,
    objective,
    rows: Sequence[Dict[str, str]],
    group_ids: Sequence[int],
    step: int,
    observe: Optional[Callable] = None,
) -> Dict[str, Any]:
    """One GRPO step on ``rows`` (one per episode; ``group_ids[i]``: the prompt of episode ``i``)."""
    from rlhf.rl import TokenLogps, advantages_for, episodes_batch, logp_mismatch

    started = time.perf_counter()
    records, stats = rollout.run(rows, seed=1000 * (step + 1))
    batch = episodes_batch([r.episode for r in records], rollout.tokenizer.pad_token_id)
    batch = batch.replace(old_logps=policy.score_batch(batch, TokenLogps()))
    batch, _ = advantages_for(batch, [r.reward for r in records], group_ids, estimator="grpo")
    result = policy.train_batch(batch, objective, schedule_step=step)
    policy.push_weights()
    if observe is not None:
        observe(step + 1, records, batch)
    return {
        "split": "train",
        "step": step + 1,
        **stats,
        "logp_mismatch": logp_mismatch(batch),
        "loss": result.metrics["loss"],
        "grad_norm": result.grad_norm,
        "seconds": time.perf_counter() - started,
    }


def evaluate(rollout: Rollout, rows: Sequence[Dict[str, str]], samples: int, step: int) -> Dict[str, Any]:
    """The held-out prompts, ``samples`` episodes each at the rollout's temperature (what the reward measures)."""
    records, stats = rollout.run([r for r in rows for _ in range(samples)], seed=7)
    return {"split": "held_out", "step": step, "episodes": len(records), **stats}


# ---------------------------------------------------------------------------- the run
def main(
    env: str = "calculator",
    *,
    num_sft: int = 2000,
    sft_share: Optional[float] = None,
    micro_batch_size: int = 32,
    eval_samples: int = 4,
    num_eval: int = 64,
    seed: int = 0,
    work_dir: Optional[str] = None,
    observe: Optional[Callable] = None,
    **overrides: Any,
) -> List[Dict[str, Any]]:
    """The SFT warm-up, then GRPO with the example's :data:`SETTINGS` (``overrides``: any of its fields, e.g.
    ``steps=3``).

    Args:
        env: ``calculator`` or ``retry``.
        num_sft: SFT problems (data.py); ``sft_share`` their tool / retry share (``None``: data.py's default).
        micro_batch_size: rows per forward of the trainer (it must divide the episodes per step).
        eval_samples: episodes per held-out prompt (``num_eval`` prompts), before and after RL.
        observe: ``observe(step, records, batch)`` sees each step's episode records and train batch.

    Returns:
        One record per RL step (``split="train"``: ``reward``, ``accuracy``, ``turns``, the example's own rates,
        ``logp_mismatch``, ``loss``, ``grad_norm``, ``seconds``) and the held-out evaluations before and after RL
        (``split="held_out"``, steps 0 and ``steps``).
    """
    from transformers import AutoTokenizer

    from rlhf.distributed.cluster import actor_env, init_ray
    from rlhf.models.tiny import build_tiny_model

    if env not in SETTINGS:
        raise ValueError(f"unknown example {env!r}; choose one of {sorted(SETTINGS)}")
    settings = dataclasses.replace(SETTINGS[env], **overrides)
    started = time.time()
    work_dir = work_dir or tempfile.mkdtemp(prefix=f"multi-turn-{env}-")
    model_dir = build_tiny_model(os.path.join(work_dir, "model"), seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    paths = data.write_example_data(
        env,
        os.path.join(work_dir, "data"),
        seed=seed,
        num_sft=num_sft,
        num_prompts=settings.steps * settings.prompts_per_step,
        num_eval=num_eval,
        share=sft_share,
        eos=tokenizer.eos_token,
    )
    init_ray(needed_cpus=3)  # joins a Ray that is already up (a test session, `ray job submit`)
    print(f"== SFT warm-up: {settings.sft_epochs} epochs on {paths['sft']}", flush=True)
    sft_dir = warm_up(model_dir, paths["sft"], os.path.join(work_dir, "sft"), settings)
    print(
        f"== GRPO: {settings.steps} steps x {settings.prompts_per_step} prompts x {settings.samples_per_prompt} "
        f"episodes, lr {settings.lr:g} (SFT done at {time.time() - started:.0f} s)",
        flush=True,
    )
    history = train(env, sft_dir, tokenizer, paths, settings, micro_batch_size, eval_samples, actor_env(0), observe)
    _summary(env, history, time.time() - started)
    return history


def train(
    env: str,
    sft_dir: str,
    tokenizer,
    paths: Dict[str, str],
    settings: Settings,
    micro_batch_size: int,
    eval_samples: int,
    actor_vars: Dict[str, str],
    observe: Optional[Callable],
) -> List[Dict[str, Any]]:
    """The GRPO part of :func:`main`: its actors live and die here."""
    from rlhf.distributed.engine import EngineSpec, OptimSpec
    from rlhf.distributed.group import GroupResources, WorkerGroup
    from rlhf.envs import EnvironmentPool
    from rlhf.models.loading import ModelSpec
    from rlhf.rl import PolicyObjective, RolloutEngines, VLLMSpec

    prompts, held_out = _read(paths["prompts"]), _read(paths["eval_prompts"])
    per_step = settings.prompts_per_step
    group_ids = [p for p in range(per_step) for _ in range(settings.samples_per_prompt)]  # episode j answers p
    policy = WorkerGroup("policy", GroupResources(num_workers=1, env_vars=actor_vars), backend="gloo")
    engines = pool = None
    try:
        policy.build(
            ModelSpec(path=sft_dir),
            EngineSpec.for_global_batch(len(group_ids), micro_batch_size, 1),
            OptimSpec(lr=settings.lr, total_steps=settings.steps, scheduler="constant"),
        )
        # room for the longest episode plus one turn's tokens: the last response is cut to the episode budget
        engines = RolloutEngines(
            VLLMSpec(model_path=sft_dir, max_model_len=settings.max_episode_tokens + settings.max_new_tokens),
            num_engines=1,
            env_vars=actor_vars,
        )
        engines.connect_weight_sync(policy, "broadcast", bucket_bytes=64 << 20, backend="gloo")
        pool = EnvironmentPool(data.SPECS[env], num_actors=1, cpus_per_actor=0.25, step_timeout_s=30)
        rollout = Rollout(env, engines, pool, tokenizer, settings)
        # GRPO's paper aggregation: each episode weighs the same, whatever its number of turns and tokens
        objective = PolicyObjective(agg_mode="seq-mean-token-mean")
        history = [evaluate(rollout, held_out, eval_samples, 0)]
        print(f"held-out before RL: {_line(env, history[0])}", flush=True)
        for step in range(settings.steps):
            chunk = prompts[step * per_step : (step + 1) * per_step]
            record = rl_step(rollout, policy, objective, [chunk[p] for p in group_ids], group_ids, step, observe)
            history.append(record)
            print(
                f"step {record['step']:3d}  {_line(env, record)}  grad_norm {record['grad_norm']:.2f}  "
                f"logp mismatch {record['logp_mismatch']:.1e}  ({record['seconds']:.1f} s)",
                flush=True,
            )
        history.append(evaluate(rollout, held_out, eval_samples, settings.steps))
        print(f"held-out after RL:  {_line(env, history[-1])}", flush=True)
    finally:
        for part in (pool, engines, policy):
            if part is not None:
                part.shutdown()
    return history


def _read(path: str) -> List[Dict[str, str]]:
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _summary(env: str, history: List[Dict[str, Any]], seconds: float) -> None:
    steps = [h for h in history if h["split"] == "train"]
    before, after = (h for h in history if h["split"] == "held_out")
    window = max(1, min(SMOOTH, len(steps) // 2))
    first = sum(h["reward"] for h in steps[:window]) / window
    last = sum(h["reward"] for h in steps[-window:]) / window
    key = "tool_rate" if env == "calculator" else "retry_rate"
    mismatch = max((h["logp_mismatch"] for h in steps[1:]), default=float("nan"))
    print(
        f"done: reward {first:.3f} -> {last:.3f} (mean of the first / last {window} steps); held-out reward "
        f"{before['reward']:.3f} -> {after['reward']:.3f}, accuracy {before['accuracy']:.2f} -> "
        f"{after['accuracy']:.2f}, {key} {before[key]:.2f} -> {after[key]:.2f}; largest logp mismatch from "
        f"step 2 {mismatch:.1e}; {seconds:.0f} s",
        flush=True,
    )


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python examples/multi_turn/train_loop.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--env", choices=sorted(SETTINGS), default="calculator")
    for field in dataclasses.fields(Settings):  # every setting, default the example's
        kind = int if field.type == "int" else float  # the annotations are strings (postponed evaluation)
        ap.add_argument(
            f"--{field.name.replace('_', '-')}",
            dest=field.name,
            type=kind,
            default=None,
            help=f"default: the example's {field.name}",
        )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None, help="default: a new temporary directory")
    return ap.parse_args(argv)


if __name__ == "__main__":
    args = vars(_parse(sys.argv[1:]))
    env, seed, work_dir = args.pop("env"), args.pop("seed"), args.pop("work_dir")
    main(env, seed=seed, work_dir=work_dir, **{k: v for k, v in args.items() if v is not None})
