#!/usr/bin/env bash
# Prefix caching on one size, on or off (PREFIX=on|off): the kernels' GPU tests, then a server (all programs
# built first) measured by scripts/bench_prefix.py (cold-warm at 1K and 16K, a 10-turn chat held as token ids,
# one as text) and scripts/bench_serving.py (c=1 and c=64, random 1024/128: the cost without hits).
#   OUT=out PREFIX=on bash scripts/gpu/prefix_ab.sh 9b
set -u
SIZE=${1:?size}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if [ "${PREFIX:-on}" = on ]; then
  python3 -m pytest -q tests/kernels/test_gdn_decode.py > "$OUT/kernel_tests.log" 2>&1; tail -1 "$OUT/kernel_tests.log"
  ARGS="--scenarios cold-warm chat --lengths 1024 16384 --chat-ids --seed 1"
else
  export SERVER_FLAGS="--no-enable-prefix-caching"
  ARGS="--scenarios chat --chat-ids --seed 1"
fi
MAX_MODEL_LEN=20480 HF=0 PREFIX_ARGS="$ARGS" CACHE=/tmp/cc_$SIZE ALL_TIMEOUT=500 \
  bash scripts/gpu/serve_bench.sh "$SIZE" --concurrency 1 64
