#!/usr/bin/env bash
# Server start-up of source trees, alternating: this one ("new") and OLD_ROOT ("old": another revision's
# hybrid_jax, pallas_kernels and server, e.g. `mkdir -p .probe/old && git archive REV hybrid_jax pallas_kernels
# server | tar -x -C .probe/old`), or the trees TREES names ("name=dir name=dir ..."). Each tree first starts once
# cold into its own cache directory, then ROUNDS (default 3) warm starts each, in turn; every start is timed from
# launch to /health OK, with its start-up log lines. Ends with a table and $OUT/start_ab.jsonl. MODEL is a size
# (random weights at its real shapes), a checkpoint directory, or "default" (the embedded tiny model: a CPU
# check); SERVER_FLAGS adds server flags.
#   OLD_ROOT=.probe/old OUT=out bash scripts/gpu/start_ab.sh 0.8b
set -u
MODEL=${1:?a size (0.8b 2b 4b 9b 27b), a checkpoint directory or default}
TREES=${TREES:-new=. old=${OLD_ROOT:?the other tree (or TREES)}}
OUT=$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)
PORT=${PORT:-8000}
ROUNDS=${ROUNDS:-3}
[ -d "$MODEL" ] && MODEL=$(cd "$MODEL" && pwd)
MODEL_ARGS=()
[ "$MODEL" = default ] || MODEL_ARGS=(--model-path "$MODEL")
declare -A ROOT
NAMES=()
for tree in $TREES; do
  NAMES+=("${tree%%=*}")
  ROOT[${tree%%=*}]=$(cd "${tree#*=}" && pwd) || exit 1
done
: > "$OUT/start_ab.jsonl"

start() {  # $1 tree name, $2 run name; appends {"tree", "run", "ready_ms"} to start_ab.jsonl
  local tree=$1 run=$2 root=${ROOT[$1]} log begin pid
  log=$OUT/server_${tree}_$run.log
  begin=$(date +%s%N)
  (cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m server.cli serve "${MODEL_ARGS[@]}" \
    --port "$PORT" --max-batch 64 --max-model-len 4096 --prefill-chunk 1024 --decode-steps 4 \
    --compilation-cache-dir "$OUT/cache_$tree" ${SERVER_FLAGS:-}) > "$log" 2>&1 &
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

for tree in "${NAMES[@]}"; do
  rm -rf "$OUT/cache_$tree"
  start "$tree" cold || exit 1
done
for round in $(seq "$ROUNDS"); do
  for tree in "${NAMES[@]}"; do start "$tree" "warm$round"; done
done
python3 - "$OUT/start_ab.jsonl" "${NAMES[@]}" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"\n{'tree':8s}  cold (s)  {'warm (s)':30s} warm mean (s)")
for tree in sys.argv[2:]:
    cold = [r["ready_ms"] / 1e3 for r in rows if r["tree"] == tree and r["run"] == "cold"]
    warm = [r["ready_ms"] / 1e3 for r in rows if r["tree"] == tree and r["run"] != "cold"]
    print(f"{tree:8s}  {cold[0]:8.1f}  {', '.join(f'{w:.2f}' for w in warm):30s} {statistics.mean(warm):.2f}")
PY
