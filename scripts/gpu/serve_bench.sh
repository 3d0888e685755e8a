#!/usr/bin/env bash
# One size end to end on the GPU machine: start the server with random weights at the size's real shapes
# (bf16), time its start (to /health OK, and to every program built: /metrics' hybrid_jax:programs_pending 0),
# run the serving sweep, stop the server, then the HF transformers baseline.
#   OUT=out bash scripts/gpu/serve_bench.sh 9b [extra bench_serving.py flags]
# SERVER_FLAGS adds server flags (e.g. --no-background-compile). COLD=1 first starts once with an empty cache ($CACHE, default $OUT/cache_SIZE) and stops it once every
# program is built, so the benchmarked start is a warm one; both starts' times go to $OUT/ready_SIZE.json.
# READY_TIMEOUT (s, default 300) bounds the wait for /health; ALL_TIMEOUT (s, default 400) the wait for every program.
# PREFIX_ARGS="..." first runs scripts/bench_prefix.py with those flags against the same server ($OUT/prefix_SIZE.json).
# C120=1 (with MAX_MODEL_LEN >= 4224) adds 120 concurrent 4096-token prompts against the same server; HF=0 skips
# the baseline (a c=1 check: HF=0 OUT=out bash scripts/gpu/serve_bench.sh 9b --concurrency 1 --num-prompts 8).
set -u
SIZE=${1:?size: 0.8b 2b 4b 9b 27b}
shift
OUT=${OUT:-gpu_out}
PORT=${PORT:-8000}
CACHE=${CACHE:-$OUT/cache_$SIZE}
mkdir -p "$OUT"
server=

start_server() {  # $1: label; sets $server, appends {"label", "ready_s", "all_programs_s"} to $OUT/ready_SIZE.jsonl
  local start
  start=$(date +%s%N)
  python3 -m server.cli serve --model-path "$SIZE" --served-model-name "qwen3.5-$SIZE" --port "$PORT" \
    --max-batch "${MAX_BATCH:-64}" --max-model-len "${MAX_MODEL_LEN:-4096}" --prefill-chunk "${PREFILL_CHUNK:-1024}" \
    --decode-steps "${DECODE_STEPS:-4}" --compilation-cache-dir "$CACHE" ${SERVER_FLAGS:-} > "$OUT/server_${SIZE}_$1.log" 2>&1 &
  server=$!
  until curl -sf "localhost:$PORT/health" > /dev/null; do
    kill -0 $server 2> /dev/null || { echo "server died"; tail -20 "$OUT/server_${SIZE}_$1.log"; exit 1; }
    [ $(( ($(date +%s%N) - start) / 1000000000 )) -gt "${READY_TIMEOUT:-300}" ] && {
      echo "server not ready in ${READY_TIMEOUT:-300} s"; stop_server; exit 1; }
    sleep 0.2
  done
  local ready all
  ready=$(( ($(date +%s%N) - start) / 1000000 ))
  until curl -s "localhost:$PORT/metrics" | grep -Eq '^hybrid_jax:programs_pending\{.*\} 0\.0$' || [ $(( ($(date +%s%N) - start) / 1000000000 )) -gt "${ALL_TIMEOUT:-400}" ]; do sleep 0.5; done
  all=$(( ($(date +%s%N) - start) / 1000000 ))
  # and their first runs, which the engine makes while it idles: a measurement should not wait for one
  until curl -s "localhost:$PORT/metrics" | grep -Eq '^hybrid_jax:programs_first_runs_pending\{.*\} 0\.0$' || [ $(( ($(date +%s%N) - start) / 1000000000 )) -gt "${ALL_TIMEOUT:-400}" ]; do sleep 0.2; done
  printf '{"size": "%s", "label": "%s", "ready_ms": %d, "all_programs_ms": %d}\n' "$SIZE" "$1" "$ready" "$all" \
    | tee -a "$OUT/ready_$SIZE.jsonl"
  grep "start-up" "$OUT/server_${SIZE}_$1.log" | sed 's/^.*start-up: /  /'
}

stop_server() { kill "$server"; wait "$server" 2> /dev/null; }

if [ -n "${COLD:-}" ]; then
  rm -rf "$CACHE"
  start_server cold
  stop_server
fi
start_server "$([ -n "${COLD:-}" ] && echo warm || echo start)"
if [ -n "${PREFIX_ARGS:-}" ]; then
  python3 scripts/bench_prefix.py --base-url "http://127.0.0.1:$PORT" $PREFIX_ARGS --out "$OUT/prefix_$SIZE.json" \
    | tee "$OUT/prefix_$SIZE.log"
fi
python3 scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "qwen3.5-$SIZE" \
  --out "$OUT/serving_$SIZE.json" "$@" | tee "$OUT/serving_$SIZE.log"
if [ -n "${C120:-}" ]; then
  python3 scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "qwen3.5-$SIZE" --concurrency 120 \
    --prompt-len 4096 --num-prompts 120 --out "$OUT/c120_$SIZE.json" | tee "$OUT/c120_$SIZE.log"
fi
stop_server
if [ "${HF:-1}" != 0 ]; then
  python3 scripts/gpu/hf_baseline.py --size "$SIZE" --out "$OUT/hf_$SIZE.json" | tee "$OUT/hf_$SIZE.log"
fi
