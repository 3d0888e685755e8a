#!/usr/bin/env bash
# Last GPU run of the session (HEAD): 9B warm-hit TTFT over HTTP (the 1K / 16K targets), c=1 serving, then
# profile_engine on/off.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
git log --oneline -1
OUT=$OUT MAX_MODEL_LEN=20480 HF=0 ALL_TIMEOUT=200 SERVER_FLAGS="--decode-sizes 1 64 --no-background-compile" \
  PREFIX_ARGS="--scenarios cold-warm repeat --lengths 1024 16384 --seed 1" \
  timeout 300 bash scripts/gpu/serve_bench.sh 9b --concurrency 1 --num-prompts 16 > $OUT/serve.log 2>&1
grep -v "^W1205" $OUT/serve.log | tail -30
timeout 170 python3 scripts/gpu/profile_engine.py --size 9b --variants on off --out $OUT/prof_head.json > $OUT/prof_head.log 2>&1
grep "^== " $OUT/prof_head.log
