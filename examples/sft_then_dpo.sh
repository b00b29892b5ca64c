#!/usr/bin/env bash
# SFT, then DPO from the SFT model, then a reward model, on the tiny local model and synthetic addition task.
# Usage: examples/sft_then_dpo.sh [WORKDIR]      (run from the repo root after `make install`)
# On a running Ray cluster, prefix each python command with `ray job submit --address http://HEAD:8265 --`.
set -euo pipefail
WORK=${1:-.assets/example}
PY=${PY:-.venv/bin/python}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}

$PY -m rlhf.cli.make_assets --out "$WORK/assets"
$PY -m rlhf.cli.train_sft --config sft_tiny \
    model.path="$WORK/assets/model" data.train_path="$WORK/assets/sft.jsonl" \
    train.output_dir="$WORK/sft" train.max_epochs=2 train.num_workers=2 train.micro_batch_size=2
$PY -m rlhf.cli.train_dpo --config dpo_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/preference.jsonl" \
    train.output_dir="$WORK/dpo" dpo.loss_type=sigmoid dpo.label_smoothing=0.1
$PY -m rlhf.cli.train_rm --config rm_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/preference.jsonl" \
    train.output_dir="$WORK/rm" rm.use_margin=true
echo "metrics: $WORK/{sft,dpo,rm}/metrics.jsonl   models: $WORK/{sft,dpo,rm}/final"
