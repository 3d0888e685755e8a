#!/usr/bin/env bash
# On a 2-GPU machine, for each size given (default 9b): the engine's c=1 TTFT/TPOT and c=32 output tok/s at
# tp=1 and tp=2, 1024-token prompts and 64 output tokens; logits at tp=1 vs tp=2 from the same random weights;
# and a device profile of one tp=2 decode step (where its time goes).
#     bash scripts/gpu/tp_compare.sh 9b 27b              # both phases
#     PHASE=tp1 bash scripts/gpu/tp_compare.sh 9b 27b    # tp=1 only, one size after the other on GPU 0
#     PHASE=tp2 bash scripts/gpu/tp_compare.sh 9b 27b    # logits, tp=2 and the tp=2 profile
# LOGITS=0 skips the logits, PROFILE=0 the profile. Logs and JSON under $OUT (default ./gpu_out); a short table at
# the end. Random weights at real shapes, bf16.
set -u
source "$(dirname "$0")/common.sh"
sizes=("${@:-9b}")
phase=${PHASE:-all}
case $phase in all | tp1 | tp2) ;; *) echo "PHASE must be all, tp1 or tp2, got $phase" >&2; exit 2 ;; esac
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
bench=(python3 scripts/bench_engine.py --decode-steps 4 --output-len 64 --concurrency 1 32)
if [ "$phase" != tp2 ]; then  # one at a time: the host's speed is part of TTFT and TPOT
  for size in "${sizes[@]}"; do
    run "engine_${size}_tp1" 280 env CUDA_VISIBLE_DEVICES=0 "${bench[@]}" --size "$size" --tensor-parallel-size 1 \
      --out "$OUT/engine_${size}_tp1.json"
  done
fi
if [ "$phase" != tp1 ]; then
  for size in "${sizes[@]}"; do
    if [ "${LOGITS:-1}" != 0 ]; then run "tp_logits_$size" 150 python3 scripts/gpu/tp_logits.py --size "$size" --tp 2; fi
    # 0.6 of free memory for the caches at tp=2: at 0.85, 27B runs out of memory on the warm-up's first run
    # (a 1.95 GiB temporary).
    run "engine_${size}_tp2" 200 "${bench[@]}" --size "$size" --tensor-parallel-size 2 --memory-utilization 0.6 \
      --out "$OUT/engine_${size}_tp2.json"
  done
  if [ "${PROFILE:-1}" != 0 ]; then
    run "profile_${sizes[0]}_tp2" 120 python3 scripts/gpu/profile_decode.py --size "${sizes[0]}" \
      --tensor-parallel-size 2 --top 15 --out "$OUT/profile_${sizes[0]}_tp2.json"
  fi
fi
cat "$OUT/gpu.txt"
for size in "${sizes[@]}"; do
  for name in "tp_logits_$size" "engine_${size}_tp1" "engine_${size}_tp2"; do
    if [ -f "$OUT/$name.log" ]; then echo "== $name"; tail -n 3 "$OUT/$name.log"; fi
  done
done
if [ -f "$OUT/profile_${sizes[0]}_tp2.log" ]; then tail -n 18 "$OUT/profile_${sizes[0]}_tp2.log"; fi
if [ -f "$OUT/failures.txt" ]; then cat "$OUT/failures.txt"; fi
