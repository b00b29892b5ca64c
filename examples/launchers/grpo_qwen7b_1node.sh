#!/usr/bin/env bash
# GRPO of Qwen2.5-7B-Instruct on one 8-GPU node, hybrid engine: policy, reference and vLLM engine r share
# GPU r; engines sleep while the policy trains; weights reach the engines by CUDA IPC.
# cluster: 1x8gpu
#
#   RAY_ADDRESS=http://HEAD_IP:8265 examples/launchers/grpo_qwen7b_1node.sh [KEY=VALUE ...]   # submit
#   DRY_RUN=1 examples/launchers/grpo_qwen7b_1node.sh [KEY=VALUE ...]   # plan for 1x8gpu, here
#
# The configuration is examples/launchers/grpo_qwen7b_1node.yaml; KEY=VALUE overrides go after it (e.g.
# train.output_dir=/shared/runs/try2). Every node needs the same install (make install-gpu); submit.sh says
# how the job is submitted (NCCL settings, token auth).
set -euo pipefail

MODULE=rlhf.cli.train_ppo
CONFIG=examples/launchers/grpo_qwen7b_1node.yaml
exec "$(dirname "${BASH_SOURCE[0]}")/submit.sh" "${BASH_SOURCE[0]}" "$MODULE" "$CONFIG" "$@"
