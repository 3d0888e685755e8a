#!/usr/bin/env bash
# On a 2-GPU machine, for each size given (default 9b): the engine's c=1 TTFT/TPOT and c=32 output tok/s at
# tp=1 (on GPU 0, every size first: GPU 1 stays free meanwhile) and at tp=2, 1024-token prompts and 64 output
# tokens; and logits at tp=1 vs tp=2 from the same random weights (LOGITS=0 skips them).
#     bash scripts/gpu/tp_compare.sh 9b 27b
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end. Random weights at real shapes, bf16.
set -u
source "$(dirname "$0")/common.sh"
sizes=("${@:-9b}")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
bench=(python3 scripts/bench_engine.py --decode-steps 4 --output-len 64 --concurrency 1 32)
for size in "${sizes[@]}"; do
  run "engine_${size}_tp1" 240 env CUDA_VISIBLE_DEVICES=0 "${bench[@]}" --size "$size" --tensor-parallel-size 1 \
    --out "$OUT/engine_${size}_tp1.json"
done
for size in "${sizes[@]}"; do
  if [ "${LOGITS:-1}" != 0 ]; then run "tp_logits_$size" 200 python3 scripts/gpu/tp_logits.py --size "$size" --tp 2; fi
  run "engine_${size}_tp2" 240 "${bench[@]}" --size "$size" --tensor-parallel-size 2 --out "$OUT/engine_${size}_tp2.json"
done
cat "$OUT/gpu.txt"
for size in "${sizes[@]}"; do
  if [ "${LOGITS:-1}" != 0 ]; then echo "== $size logits"; tail -n 1 "$OUT/tp_logits_$size.log"; fi
  for tp in 1 2; do echo "== $size tp$tp"; tail -n 3 "$OUT/engine_${size}_tp$tp.log"; done
done
if [ -f "$OUT/failures.txt" ]; then cat "$OUT/failures.txt"; fi
