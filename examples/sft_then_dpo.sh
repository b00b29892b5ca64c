#!/usr/bin/env bash
# SFT, then DPO from the SFT model, the reference-free SimPO, CPO and ORPO from it (no reference workers), KTO
# from it on the same pairs as thumbs-up / down rows, then a reward model, on the tiny local model and synthetic
# addition task. docs/algorithms/dpo.md ("Measured on the demo task") gives what each run reaches.
# Running it again replaces the runs in WORKDIR (train.overwrite=true; without it a finished run is kept and
# the new one refused).
# Usage: examples/sft_then_dpo.sh [WORKDIR]      (run from the repo root after `make install`)
# On a Ray cluster, submit it from the repo root as one job (every step joins the cluster through RAY_ADDRESS;
# WORKDIR on storage every node can write):
#   RAY_AUTH_MODE=token ray job submit --address http://HEAD_IP:8265 --working-dir . -- bash examples/sft_then_dpo.sh /shared/runs/example
set -euo pipefail
WORK=${1:-.assets/example}
PY=${PY:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python; fi)}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}

$PY -m rlhf.cli.make_assets --out "$WORK/assets"
$PY -m rlhf.cli.train_sft --config sft_tiny \
    model.path="$WORK/assets/model" data.train_path="$WORK/assets/sft.jsonl" \
    train.output_dir="$WORK/sft" train.overwrite=true train.max_epochs=2 train.num_workers=2 train.micro_batch_size=2
$PY -m rlhf.cli.train_dpo --config dpo_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/preference.jsonl" \
    train.output_dir="$WORK/dpo" train.overwrite=true dpo.loss_type=sigmoid dpo.label_smoothing=0.1
$PY -m rlhf.cli.train_dpo --config dpo_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/preference.jsonl" \
    train.output_dir="$WORK/simpo" train.overwrite=true dpo.loss_type=simpo train.lr=1e-4
$PY -m rlhf.cli.train_dpo --config dpo_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/preference.jsonl" \
    train.output_dir="$WORK/cpo" train.overwrite=true dpo.loss_type=cpo
$PY -m rlhf.cli.train_dpo --config dpo_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/preference.jsonl" \
    train.output_dir="$WORK/orpo" train.overwrite=true dpo.loss_type=orpo
$PY -m rlhf.cli.train_dpo --config dpo_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/unpaired.jsonl" \
    train.output_dir="$WORK/kto" train.overwrite=true dpo.loss_type=kto train.lr=1e-4
$PY -m rlhf.cli.train_rm --config rm_tiny \
    model.path="$WORK/sft/final" data.train_path="$WORK/assets/preference.jsonl" \
    train.output_dir="$WORK/rm" train.overwrite=true rm.use_margin=true
echo "metrics: $WORK/{sft,dpo,simpo,cpo,orpo,kto,rm}/metrics.jsonl   models: $WORK/{sft,dpo,simpo,cpo,orpo,kto,rm}/final"
