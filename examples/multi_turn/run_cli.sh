#!/usr/bin/env bash
# The multi-turn examples from the command line, as a user runs them from the repository root:
#
#   bash examples/multi_turn/run_cli.sh calculator [WORKDIR] [overrides for train_ppo ...]
#   bash examples/multi_turn/run_cli.sh retry
#
# 1. the tiny model (python -m rlhf.cli.make_assets) and the example's data (examples/multi_turn/data.py);
# 2. an SFT warm-up that teaches the formats (python -m rlhf.cli.train_sft, sft_tiny preset);
# 3. GRPO with the environment (python -m rlhf.cli.train_ppo --config grpo_<example>_tiny), evaluated on held-out
#    prompts every 10 steps;
# 4. the plots (python -m rlhf.cli.report): reward, turns per episode, tokens, per-turn rewards.
# The runs go to WORKDIR (default .assets/multi_turn/<example>) and replace an earlier run's.
set -euo pipefail
example=${1:?usage: run_cli.sh calculator|retry [WORKDIR] [train_ppo overrides ...]}
work=${2:-.assets/multi_turn/$example}
shift $(( $# >= 2 ? 2 : 1 ))
py=${PYTHON:-.venv/bin/python}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TOKENIZERS_PARALLELISM=false
case $example in calculator|retry) ;; *) echo "unknown example '$example': calculator or retry" >&2; exit 2;; esac

"$py" -m rlhf.cli.make_assets --out "$work/assets" --num-sft 1 --num-pref 1 --num-prompts 1 --num-eval-prompts 1
"$py" examples/multi_turn/data.py --env "$example" --out "$work/data"
"$py" -m rlhf.cli.train_sft --config sft_tiny model.path="$work/assets/model" data.train_path="$work/data/sft.jsonl" \
    train.output_dir="$work/sft" train.max_epochs=8 train.lr=1e-3 train.global_batch_size=32 \
    train.micro_batch_size=32 train.num_workers=1 health.action=warn logging.print_every=50 train.overwrite=true
"$py" -m rlhf.cli.train_ppo --config "grpo_${example}_tiny" model.path="$work/sft/final" \
    data.train_path="$work/data/prompts.jsonl" data.eval_path="$work/data/eval_prompts.jsonl" train.eval_every=10 \
    train.output_dir="$work/grpo" train.overwrite=true "$@"
"$py" -m rlhf.cli.report "$work/grpo" --smooth 5
