#!/usr/bin/env bash
# No-hit c=64 at 9B, one process per variant, alternating: on off on off on off (512 prompts each).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
i=0
for v in on off on off on off; do
  i=$((i+1))
  s=$(date +%s)
  timeout 240 python3 scripts/gpu/profile_engine.py --size 9b --variants $v --num-prompts 512 --top 8 \
    --compilation-cache-dir /tmp/pe_cache --out $OUT/proc_${i}_$v.json > $OUT/proc_${i}_$v.log 2>&1
  echo "run $i $v: $(grep '^== ' $OUT/proc_${i}_$v.log) (process $(( $(date +%s) - s )) s)"
  nvidia-smi --query-gpu=temperature.gpu,clocks.sm --format=csv,noheader
done
