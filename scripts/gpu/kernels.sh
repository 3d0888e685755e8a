#!/usr/bin/env bash
# On the GPU machine: the kernels' compiled tests, the gdn_chunk tile sweep (with each tile's error against the
# reference) and the full kernel benchmark, as named (default: all three, in that order):
#     bash scripts/gpu/kernels.sh [tests] [sweep] [bench]
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end.
set -u
source "$(dirname "$0")/common.sh"
steps=("$@")
if [ $# -eq 0 ]; then steps=(tests sweep bench); fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
for step in "${steps[@]}"; do
  case $step in
    tests) run kernel_tests 200 python3 -m pytest -q tests/kernels ;;
    sweep) run chunk_sweep 540 python3 scripts/bench_kernels.py --chunk-sweep --out "$OUT/chunk_sweep.json" ;;
    bench) run bench_kernels 400 python3 scripts/bench_kernels.py --out "$OUT/bench_kernels.json" ;;
    *) echo "unknown step: $step (tests, sweep or bench)" >&2; exit 2 ;;
  esac
done
cat "$OUT/gpu.txt"
for log in kernel_tests chunk_sweep bench_kernels; do
  if [ -f "$OUT/$log.log" ]; then echo "== $log"; tail -n 20 "$OUT/$log.log" | cut -c1-160; fi
done
if [ -f "$OUT/failures.txt" ]; then cat "$OUT/failures.txt"; fi
