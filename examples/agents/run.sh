#!/usr/bin/env bash
# The agent example from the command line, from the repository root:
#
#   bash examples/agents/run.sh [WORKDIR] [overrides for train_ppo ...]
#
# 1. the tiny model (python -m rlhf.cli.make_assets) and the example's chat data (examples/agents/data.py);
# 2. an SFT warm-up on the conversations (python -m rlhf.cli.train_sft, sft_tiny preset);
# 3. GRPO whose episodes are examples/agents/retry_agent.py:run, an openai-client agent, talking to the policy
#    through the run's endpoint; held-out reward every 10 steps (step 0: before RL);
# 4. the plots (python -m rlhf.cli.report).
set -euo pipefail
work=${1:-.assets/agents}
shift $(( $# >= 1 ? 1 : 0 ))
py=${PYTHON:-.venv/bin/python}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TOKENIZERS_PARALLELISM=false

"$py" -m rlhf.cli.make_assets --out "$work/assets" --num-sft 1 --num-pref 1 --num-prompts 1 --num-eval-prompts 1
"$py" examples/agents/data.py --out "$work/data"
"$py" -m rlhf.cli.train_sft --config sft_tiny model.path="$work/assets/model" data.train_path="$work/data/sft.jsonl" \
    train.output_dir="$work/sft" train.max_epochs=8 train.lr=1e-3 train.global_batch_size=32 \
    train.micro_batch_size=32 train.num_workers=1 health.action=warn logging.print_every=50 train.overwrite=true
"$py" -m rlhf.cli.train_ppo --config grpo_retry_tiny model.path="$work/sft/final" \
    env.spec=examples/agents/retry_agent.py:run env.num_actors=2 rollout.max_prompt_length=32 \
    rollout.max_episode_tokens=96 data.train_path="$work/data/prompts.jsonl" \
    data.eval_path="$work/data/eval_prompts.jsonl" train.eval_every=10 train.output_dir="$work/grpo" \
    train.overwrite=true "$@"
"$py" -m rlhf.cli.report "$work/grpo" --smooth 5
