#!/usr/bin/env bash
# On the GPU machine: the in-process engine figures of the serving issue in one call. c=1 TTFT/TPOT at
# 1024-token prompts for every size, 9B TTFT at 4097 and 32768-token prompts, and 9B at c=120 with
# 4096-token prompts (every request must finish). Random weights at real shapes (bf16).
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end.
set -u
source "$(dirname "$0")/common.sh"
bench() {  # name, time limit (s), bench_engine.py flags...
  run "$1" "$2" python3 scripts/bench_engine.py --decode-steps 4 --out "$OUT/$1.json" "${@:3}"
}
for size in 0.8b 2b 4b 9b 27b; do
  bench "c1_$size" 200 --size "$size"
done
bench ttft_9b_4097 150 --size 9b --prompt-len 4097 --output-len 16
bench ttft_9b_32k 200 --size 9b --prompt-len 32768 --output-len 16
bench c120_9b 300 --size 9b --prompt-len 4096 --concurrency 120
for f in "$OUT"/c1_*.log "$OUT"/ttft_*.log "$OUT"/c120_*.log; do echo "== $f"; tail -n 2 "$f"; done
if [ -f "$OUT/failures.txt" ]; then cat "$OUT/failures.txt"; fi
