#!/usr/bin/env bash
# No-hit c=64 at 9B, one process per variant, alternating, in the order given; stops starting new processes
# once DEADLINE seconds have passed since the start (the call's limit is 600 s).
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-470}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
git log --oneline -1 2>/dev/null || true
ls /tmp/pe_cache 2>/dev/null | wc -l
i=${START_INDEX:-0}
for v in "$@"; do
  el=$(( $(date +%s) - T0 ))
  if [ $el -gt $DEADLINE ]; then echo "deadline: stop before $v at ${el}s"; break; fi
  i=$((i+1))
  s=$(date +%s)
  timeout $(( 590 - el )) python3 scripts/gpu/profile_engine.py --size 9b --variants $v --num-prompts 512 --top 8 \
    --compilation-cache-dir /tmp/pe_cache --out $OUT/proc_${i}_$v.json > /tmp/proc_${i}_$v.log 2>&1
  echo "run $i $v: $(grep '^== ' /tmp/proc_${i}_$v.log) (process $(( $(date +%s) - s )) s)"
  nvidia-smi --query-gpu=temperature.gpu,clocks.sm --format=csv,noheader
done
