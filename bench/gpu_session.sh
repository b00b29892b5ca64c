#!/bin/bash
# One lent GPU's measuring session in one call, each command bounded so the whole fits a device lease:
#   BUDGET=430 bash bench/gpu_session.sh        (on the GPU machine, from the repo root; $OUT collects the logs)
# DeepSpeed and its dependencies travel as wheels in .whl/ (docs/multinode.md, "First, the one-GPU check").
# What it runs (docs/performance.md): the 1.5B SFT step at ZeRO 0, 1 and 2 in two interleaved rounds, each profiled
# (launches, syncs, host reads), the best packed configuration (2,048-token rows, a 16,384-token budget) eager
# (profiled) and compiled, the one-GPU check at 0.5B, and the DPO / RL / log-prob steps. A command that would overrun
# the budget gets what is left (at least 5 s).
T0=$(date +%s); END=$(( T0 + ${BUDGET:-430} )); OUT=${OUT:-/tmp/gpu_session}; mkdir -p "$OUT"
cap() { local l=$(( END - $(date +%s) )); echo $(( l < $1 ? (l > 5 ? l : 5) : $1 )); }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "from rlhf.models.sizes import build_sized_model as b; b('/tmp/m15', '1.5b', device='cuda', max_positions=4096)" \
  || exit 1
echo "built at $(( $(date +%s) - T0 )) s"
S="python3 bench/bench_step.py --model /tmp/m15"
# Two interleaved rounds (one engine measured 0.56 and 0.72 s a step in two runs of one session): ZeRO 3 on one rank
# builds ZeRO 1 as ZeRO 2 does (rlhf.distributed.engine.effective_zero_stage), so it is left to ZeRO 2's row.
timeout "$(cap 150)" $S --trainers sft --steps 3 --rounds 2 --zero-stage 0,1,2 --profile zero,plain-autocast \
  --json "$OUT/sft15.json" > "$OUT/sft15.log" 2>&1; echo "sft15 rc=$? at $(( $(date +%s) - T0 )) s"
grep -h "^RESULT\|^ROUND\|kernel launches\|host reads" "$OUT/sft15.log"
B="$S --trainers sft --steps 4 --seq 2048 --micro 4 --ga 4 --zero-stage 1 --packing --max-tokens 16384"
timeout "$(cap 70)" $B --plain autocast,bf16 --profile rlhf > "$OUT/best.log" 2>&1; echo "best rc=$? at $(( $(date +%s) - T0 )) s"
timeout "$(cap 90)" $B --plain autocast --compile >> "$OUT/best.log" 2>&1; echo "best compiled rc=$?"
grep -h "^RESULT\|kernel launches\|host reads" "$OUT/best.log"
timeout "$(cap 150)" python3 bench/gpu_check.py --size 0.5b --zero-stage 2 > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$? at $(( $(date +%s) - T0 )) s"
grep -h "^CHECK\|ALL PASSED\|FAILED" "$OUT/gpu_check.log"
timeout "$(cap 120)" $S --trainers dpo,rl,logprob --steps 3 --plain autocast --zero-stage 1 > "$OUT/others.log" 2>&1
echo "others rc=$? at $(( $(date +%s) - T0 )) s"
grep -h "^RESULT" "$OUT/others.log"
