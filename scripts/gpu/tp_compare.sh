#!/usr/bin/env bash
# On a 2-GPU machine: 9B logits at tp=1 vs tp=2, and the engine's c=1 TTFT/TPOT at tp=1 and tp=2.
# Logs and JSON under $OUT (default ./gpu_out); a short table at the end.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
timeout 150 python3 scripts/gpu/tp_logits.py --size 9b --tp 2 > "$OUT/tp_logits.log" 2>&1
for tp in 1 2; do
  timeout 140 python3 scripts/bench_engine.py --size 9b --decode-steps 4 --output-len 64 \
    --tensor-parallel-size $tp --out "$OUT/engine_9b_tp$tp.json" > "$OUT/engine_9b_tp$tp.log" 2>&1
done
cat "$OUT/gpu.txt"
for f in tp_logits engine_9b_tp1 engine_9b_tp2; do echo "== $f"; tail -n 6 "$OUT/$f.log"; done
