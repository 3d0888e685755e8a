#!/usr/bin/env bash
# Server start-up of two source trees, alternating: this one ("new") and OLD_ROOT ("old": another revision's
# hybrid_jax, pallas_kernels and server, e.g. `mkdir -p .probe/old && git archive REV hybrid_jax pallas_kernels
# server | tar -x -C .probe/old`). Each tree first starts once cold into its own cache directory, then ROUNDS
# (default 3) warm starts each, alternating; every start is timed from launch to /health OK, with its start-up
# log lines. Ends with a table and $OUT/start_ab.jsonl. MODEL is a size (random weights at its real shapes), a
# checkpoint directory, or "default" (the embedded tiny model: a CPU check); SERVER_FLAGS adds server flags.
#   OLD_ROOT=.probe/old OUT=out bash scripts/gpu/start_ab.sh 0.8b
set -u
MODEL=${1:?a size (0.8b 2b 4b 9b 27b), a checkpoint directory or default}
OLD_ROOT=$(cd "${OLD_ROOT:?the other tree}" && pwd)
NEW_ROOT=$PWD
OUT=$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)
PORT=${PORT:-8000}
ROUNDS=${ROUNDS:-3}
[ -d "$MODEL" ] && MODEL=$(cd "$MODEL" && pwd)
MODEL_ARGS=()
[ "$MODEL" = default ] || MODEL_ARGS=(--model-path "$MODEL")
: > "$OUT/start_ab.jsonl"

start() {  # $1 label (new|old), $2 run name; appends {"tree", "run", "ready_ms"} to start_ab.jsonl
  local tree=$1 run=$2 root cache log begin pid
  root=$([ "$tree" = new ] && echo "$NEW_ROOT" || echo "$OLD_ROOT")
  cache=$OUT/cache_$tree
  log=$OUT/server_${tree}_$run.log
  begin=$(date +%s%N)
  (cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m server.cli serve "${MODEL_ARGS[@]}" \
    --port "$PORT" --max-batch 64 --max-model-len 4096 --prefill-chunk 1024 --decode-steps 4 \
    --compilation-cache-dir "$cache" ${SERVER_FLAGS:-}) > "$log" 2>&1 &
  pid=$!
  until curl -sf "localhost:$PORT/health" > /dev/null; do
    kill -0 $pid 2> /dev/null || { echo "$tree $run: the server died"; tail -5 "$log"; return 1; }
    [ $(( ($(date +%s%N) - begin) / 1000000000 )) -gt "${READY_TIMEOUT:-300}" ] && {
      echo "$tree $run: not ready in ${READY_TIMEOUT:-300} s"; kill $pid; wait $pid 2> /dev/null; return 1; }
    sleep 0.05
  done
  printf '{"tree": "%s", "run": "%s", "ready_ms": %d}\n' "$tree" "$run" $(( ($(date +%s%N) - begin) / 1000000 )) \
    | tee -a "$OUT/start_ab.jsonl"
  grep "start-up" "$log" | sed 's/^.*start-up: /    /'
  kill $pid
  wait $pid 2> /dev/null
}

rm -rf "$OUT/cache_new" "$OUT/cache_old"
start new cold && start old cold || exit 1
for round in $(seq "$ROUNDS"); do
  start new "warm$round"
  start old "warm$round"
done
python3 - "$OUT/start_ab.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("\ntree  cold (s)  warm (s)                       warm mean (s)")
for tree in ("new", "old"):
    cold = [r["ready_ms"] / 1e3 for r in rows if r["tree"] == tree and r["run"] == "cold"]
    warm = [r["ready_ms"] / 1e3 for r in rows if r["tree"] == tree and r["run"] != "cold"]
    print(f"{tree:4s}  {cold[0]:8.1f}  {', '.join(f'{w:.2f}' for w in warm):30s} {statistics.mean(warm):.2f}")
EOF
