#!/usr/bin/env bash
# What every launcher here does after naming its module, config and cluster shape:
#
#   examples/launchers/submit.sh LAUNCHER MODULE CONFIG [KEY=VALUE ...]
#
# DRY_RUN=1: plan the run here against the cluster shape in LAUNCHER's "# cluster:" line (--dry-run --cluster);
# nothing starts. Otherwise submit it as a Ray job to RAY_ADDRESS (the head node's dashboard) with the submit
# command of every page here (README.md, docs/multinode.md), plus NCCL settings from this shell for every actor:
#
#   RAY_AUTH_MODE=token ray job submit --address "$RAY_ADDRESS" --working-dir . \
#     --runtime-env-json '{"env_vars": {"NCCL_DEBUG": "WARN"}}' -- python -m MODULE --config CONFIG [KEY=VALUE ...]
#
# The repository root is uploaded as the job's working directory (minus what .gitignore lists). NCCL_DEBUG
# defaults to WARN; NCCL_SOCKET_IFNAME / NCCL_IB_HCA / NCCL_IB_DISABLE / DEEPSPEED_TIMEOUT are added when
# set. Ray 2.60 clusters use token authentication: RAY_AUTH_MODE=token makes the job client send the token in
# ~/.ray/auth_token (copy it from the head node).
set -euo pipefail

LAUNCHER=$1 MODULE=$2 CONFIG=$3
shift 3
CLUSTER=$(sed -n 's/^# cluster: *//p' "$LAUNCHER" | head -n 1)
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # the repository root: the job's working directory

if [ "${DRY_RUN:-0}" = 1 ]; then
  PYTHON=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python; fi)}
  exec "$PYTHON" -m "$MODULE" --config "$CONFIG" --dry-run --cluster "$CLUSTER" "$@"
fi

: "${RAY_ADDRESS:?set RAY_ADDRESS=http://HEAD_IP:8265 (the dashboard of the head node), or DRY_RUN=1 to print the plan}"
env_vars="\"NCCL_DEBUG\": \"${NCCL_DEBUG:-WARN}\""
for var in NCCL_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_DISABLE DEEPSPEED_TIMEOUT; do
  if [ -n "${!var:-}" ]; then env_vars+=", \"$var\": \"${!var}\""; fi
done
RAY_AUTH_MODE=token exec ray job submit --address "$RAY_ADDRESS" --working-dir . \
  --runtime-env-json "{\"env_vars\": {$env_vars}}" -- python -m "$MODULE" --config "$CONFIG" "$@"
