#!/usr/bin/env bash
# GPU plan (one command, ~3-4 min): 9B c=64 closed loop in process, cache on and off, plus a traced loop of 64
# prompts each: device busy share and the kernels whose time differs (where the no-hit 2-3% goes).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
python3 scripts/gpu/profile_engine.py --size 9b --variants on off --trace-prompts 64 --out $OUT/trace_onoff.json \
  > $OUT/trace_onoff.log 2>&1
tail -40 $OUT/trace_onoff.log
