#!/usr/bin/env bash
# On the GPU machine: which part of the server's engine configuration costs 9B's c=1 decode ~0.13 ms a token
# (docs/BENCHMARKS.md, tenth session). In process, one 1024-token prompt and 128 greedy tokens, 4 steps a
# call: the benchmark's small configuration, then the server's, then the server's with one setting at a
# time taken back to the small one; and the decode program back to back in the server's configuration.
# Random weights at real shapes (bf16). Logs and JSON under $OUT (default ./gpu_out); a table at the end.
set -u
source "$(dirname "$0")/common.sh"
SIZE=${SIZE:-9b}
bench() {  # name, bench_engine.py flags...
  run "$1" 200 python3 scripts/bench_engine.py --size "$SIZE" --decode-steps 4 --output-len 128 \
    --out "$OUT/$1.json" "${@:2}"
}
bench small --max-model-len 1168 --memory-utilization 0.85
bench server --max-model-len 4096 --max-batch 64 --memory-utilization 0.9
bench server_len1168 --max-model-len 1168 --max-batch 64 --memory-utilization 0.9
bench server_batch1 --max-model-len 4096 --memory-utilization 0.9
bench server_mem085 --max-model-len 4096 --max-batch 64 --memory-utilization 0.85
run back_to_back 150 python3 scripts/gpu/profile_decode.py --size "$SIZE" --decode-steps 4 --max-batch 64 \
  --max-model-len 4096 --memory-utilization 0.9 --chained --top 5 --out "$OUT/back_to_back.json"
for name in small server server_len1168 server_batch1 server_mem085; do
  printf "%-16s %s\n" "$name" "$(tail -n 1 "$OUT/$name.log")"
done
printf "%-16s %s\n" back_to_back "$(tail -n 1 "$OUT/back_to_back.log" | cut -c1-300)"
if [ -f "$OUT/failures.txt" ]; then cat "$OUT/failures.txt"; fi
