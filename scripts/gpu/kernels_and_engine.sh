#!/usr/bin/env bash
# On the GPU machine: the kernels' compiled tests, the fused GDN decode sweep, a 9B decode-step profile, the
# engine's 9B c=1 timings and the kernel benchmarks (quick shapes), most telling first.
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || echo "$name: exit $?" >> "$OUT/failures.txt"
}
step gemv_gpu_tests 60 python3 -m pytest -q -x tests/kernels/test_gemv.py tests/kernels/test_gemv_in_model.py
step decode_sweep 100 python3 scripts/bench_kernels.py --decode-sweep --out "$OUT/decode_sweep.json"
step profile_9b 90 python3 scripts/gpu/profile_decode.py --size 9b --batch 1 --out "$OUT/profile_decode_9b.json"
step engine_9b 120 python3 scripts/bench_engine.py --size 9b --decode-steps 4 --out "$OUT/engine_9b.json"
step bench_kernels 120 python3 scripts/bench_kernels.py --quick --out "$OUT/bench_kernels.json"
step gdn_gpu_tests 150 python3 -m pytest -q -x tests/kernels/test_gdn_decode.py tests/kernels/test_gdn_chunk.py
cat "$OUT/gpu.txt"
for f in gemv_gpu_tests decode_sweep profile_9b engine_9b bench_kernels gdn_gpu_tests; do
  echo "== $f"; tail -n 12 "$OUT/$f.log" | cut -c1-150
done
cat "$OUT/failures.txt" 2> /dev/null
