#!/usr/bin/env bash
# On the GPU machine: kernel benchmarks, the GDN kernels' compiled tests, and in-process engine timings.
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
timeout 150 python3 scripts/bench_kernels.py --quick --out "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1
timeout 120 python3 -m pytest -q -x tests/kernels/test_gdn_chunk.py tests/kernels/test_gdn_decode.py \
  > "$OUT/gdn_gpu_tests.log" 2>&1
timeout 110 python3 scripts/bench_engine.py --size 0.8b --decode-steps 4 --out "$OUT/engine_0.8b.json" \
  > "$OUT/engine_0.8b.log" 2>&1
timeout 130 python3 scripts/bench_engine.py --size 9b --decode-steps 4 --out "$OUT/engine_9b.json" \
  > "$OUT/engine_9b.log" 2>&1
cat "$OUT/gpu.txt"
for f in bench_kernels gdn_gpu_tests engine_0.8b engine_9b; do echo "== $f"; tail -n 14 "$OUT/$f.log"; done
