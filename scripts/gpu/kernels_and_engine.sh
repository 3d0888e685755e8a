#!/usr/bin/env bash
# On the GPU machine: the kernels' compiled tests, the fused GDN decode sweep, a 9B decode-step profile, the
# engine's 9B c=1 timings and the kernel benchmarks (quick shapes), most telling first.
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end.
set -u
source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
run gemv_gpu_tests 60 python3 -m pytest -q -x tests/kernels/test_gemv.py tests/kernels/test_gemv_in_model.py
run decode_sweep 100 python3 scripts/bench_kernels.py --decode-sweep --out "$OUT/decode_sweep.json"
run profile_9b 90 python3 scripts/gpu/profile_decode.py --size 9b --batch 1 --out "$OUT/profile_decode_9b.json"
run engine_9b 120 python3 scripts/bench_engine.py --size 9b --decode-steps 4 --out "$OUT/engine_9b.json"
run bench_kernels 120 python3 scripts/bench_kernels.py --quick --out "$OUT/bench_kernels.json"
run gdn_gpu_tests 150 python3 -m pytest -q -x tests/kernels/test_gdn_decode.py tests/kernels/test_gdn_chunk.py
cat "$OUT/gpu.txt"
for f in gemv_gpu_tests decode_sweep profile_9b engine_9b bench_kernels gdn_gpu_tests; do
  echo "== $f"; tail -n 12 "$OUT/$f.log" | cut -c1-150
done
if [ -f "$OUT/failures.txt" ]; then cat "$OUT/failures.txt"; fi
