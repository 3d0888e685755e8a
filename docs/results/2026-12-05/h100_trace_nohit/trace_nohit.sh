#!/usr/bin/env bash
# One process, 9B, cache on then off: closed loop of 128 no-hit prompts, then a traced loop of 128 after the fills
# ran (settle): the kernels whose device time differs most, with their call counts.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1
timeout ${LIMIT:-560} python3 scripts/gpu/profile_engine.py --size 9b --variants ${VARIANTS:-on off} --num-prompts 128 \
  --trace-prompts 128 --top 30 --out $OUT/trace_nohit.json 2>&1 | grep -v -i "warning\|^ *$" | tail -120
