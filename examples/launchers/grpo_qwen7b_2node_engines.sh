#!/usr/bin/env bash
# GRPO of Qwen2.5-7B-Instruct on two 8-GPU nodes, trainer and generator apart: policy + reference on the
# 8 GPUs of one node, 4 vLLM engines x 2 GPUs (tensor parallel) on the other; NCCL weight broadcast across.
# cluster: 2x8gpu
#
#   RAY_ADDRESS=http://HEAD_IP:8265 examples/launchers/grpo_qwen7b_2node_engines.sh [KEY=VALUE ...]   # submit
#   DRY_RUN=1 examples/launchers/grpo_qwen7b_2node_engines.sh [KEY=VALUE ...]   # plan for 2x8gpu, here
#
# The configuration is examples/launchers/grpo_qwen7b_2node_engines.yaml; KEY=VALUE overrides go after it (e.g.
# train.output_dir=/shared/runs/try2). Every node needs the same install (make install-gpu); submit.sh says
# how the job is submitted (NCCL settings, token auth).
set -euo pipefail

MODULE=rlhf.cli.train_ppo
CONFIG=examples/launchers/grpo_qwen7b_2node_engines.yaml
exec "$(dirname "${BASH_SOURCE[0]}")/submit.sh" "${BASH_SOURCE[0]}" "$MODULE" "$CONFIG" "$@"
