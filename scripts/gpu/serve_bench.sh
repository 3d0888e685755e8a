#!/usr/bin/env bash
# One size end to end on the GPU machine: start the server with random weights at the size's real shapes
# (bf16), wait for the warm-up, run the serving sweep, stop the server, then the HF transformers baseline.
#   OUT=out bash scripts/gpu/serve_bench.sh 9b [extra bench_serving.py flags]
# C120=1 (with MAX_MODEL_LEN >= 4224) adds 120 concurrent 4096-token prompts against the same server; HF=0 skips
# the baseline (a c=1 check: HF=0 OUT=out bash scripts/gpu/serve_bench.sh 9b --concurrency 1 --num-prompts 8).
set -u
SIZE=${1:?size: 0.8b 2b 4b 9b 27b}
shift
OUT=${OUT:-gpu_out}
PORT=${PORT:-8000}
mkdir -p "$OUT"
start=$(date +%s)
python3 -m hybrid_jax.cli serve --model-path "$SIZE" --served-model-name "qwen3.5-$SIZE" --port "$PORT" \
  --max-batch "${MAX_BATCH:-64}" --max-model-len "${MAX_MODEL_LEN:-4096}" --prefill-chunk "${PREFILL_CHUNK:-1024}" \
  --decode-steps "${DECODE_STEPS:-4}" > "$OUT/server_$SIZE.log" 2>&1 &
server=$!
until curl -sf "localhost:$PORT/health" > /dev/null; do
  kill -0 $server 2> /dev/null || { echo "server died"; tail -20 "$OUT/server_$SIZE.log"; exit 1; }
  sleep 2
done
echo "time to ready: $(( $(date +%s) - start )) s" | tee "$OUT/ready_$SIZE.txt"
python3 scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "qwen3.5-$SIZE" \
  --out "$OUT/serving_$SIZE.json" "$@" | tee "$OUT/serving_$SIZE.log"
if [ -n "${C120:-}" ]; then
  python3 scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "qwen3.5-$SIZE" --concurrency 120 \
    --prompt-len 4096 --num-prompts 120 --out "$OUT/c120_$SIZE.json" | tee "$OUT/c120_$SIZE.log"
fi
kill $server; wait $server 2> /dev/null
if [ "${HF:-1}" != 0 ]; then
  python3 scripts/gpu/hf_baseline.py --size "$SIZE" --out "$OUT/hf_$SIZE.json" | tee "$OUT/hf_$SIZE.log"
fi
