#!/usr/bin/env bash
# On a 2-GPU machine, for each size given (default 9b): logits at tp=1 vs tp=2 from the same random
# weights, and the engine's c=1 TTFT/TPOT and c=32 output tok/s at tp=1 and tp=2 (1024-token prompts).
#     bash scripts/gpu/tp_compare.sh 9b 27b
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end. Random weights at real shapes, bf16.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
sizes=("${@:-9b}")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
for size in "${sizes[@]}"; do
  timeout 200 python3 scripts/gpu/tp_logits.py --size "$size" --tp 2 > "$OUT/tp_logits_$size.log" 2>&1 \
    || echo "tp_logits $size: exit $?" >> "$OUT/failures.txt"
  for tp in 1 2; do
    timeout 240 python3 scripts/bench_engine.py --size "$size" --decode-steps 4 --output-len 64 --concurrency 1 32 \
      --tensor-parallel-size $tp --out "$OUT/engine_${size}_tp$tp.json" > "$OUT/engine_${size}_tp$tp.log" 2>&1 \
      || echo "engine $size tp$tp: exit $?" >> "$OUT/failures.txt"
  done
done
cat "$OUT/gpu.txt"
for size in "${sizes[@]}"; do
  echo "== $size logits"; tail -n 1 "$OUT/tp_logits_$size.log"
  for tp in 1 2; do echo "== $size tp$tp"; tail -n 3 "$OUT/engine_${size}_tp$tp.log"; done
done
cat "$OUT/failures.txt" 2> /dev/null
