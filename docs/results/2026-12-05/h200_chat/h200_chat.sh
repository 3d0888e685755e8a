#!/usr/bin/env bash
# 9B, --max-batch 4 --decode-sizes 1 --max-model-len 20480, each server cold, every program built before the chats.
# HEAD with the prefix cache: its first chat after start (idle first runs), then chat shapes (system prompt seen
# first or not); HEAD without the cache: the same; then fc905ef's first chat (before the idle first runs) if time.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name --format=csv,noheader
H=$PWD
serve() {  # $1 label, $2 root, $3 cache, rest flags
  local label=$1 root=$2 cache=$3; shift 3; local s=$(date +%s)
  ( cd $root && PYTHONPATH=/tmp/site:$root exec python3 -m server.cli serve --model-path 9b --port 8000 \
      --prefill-chunk 1024 --decode-steps 4 --compilation-cache-dir $cache --max-batch 4 --decode-sizes 1 \
      --max-model-len 20480 "$@" ) > $OUT/srv_$label.log 2>&1 &
  pid=$!
  until curl -sf localhost:8000/health > /dev/null && curl -s localhost:8000/metrics | grep -Eq '^hybrid_jax:programs_pending\{.*\} 0\.0$'; do
    kill -0 $pid 2> /dev/null || { echo "$label died"; tail -5 $OUT/srv_$label.log; return 1; }
    sleep 0.5; done
  echo "$label: every program built in $(( $(date +%s) - s )) s"
  sleep 3  # HEAD runs the background programs once meanwhile
}
chat() {  # $1 label, $2 system, $3 user, $4 answer, rest: flags
  local label=$1 sys=$2 user=$3 ans=$4; shift 4
  PYTHONPATH=/tmp/site:$H timeout 120 python3 $H/scripts/bench_prefix.py --base-url http://127.0.0.1:8000 --scenarios chat \
    --chat-ids --chat-system-words $sys --chat-user-words $user --chat-max-tokens $ans "$@" --out $OUT/chat_$label.json > $OUT/chat_$label.log 2>&1
  python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['scenarios']['chat']; print(sys.argv[2], round(c['summary']['ttft_sum_ms'],1), c['summary']['cached_tokens'], [round(r['ttft_ms'],1) for r in c['rows']])" $OUT/chat_$label.json $label
}
shapes() {  # $1 on|off
  chat $1_500_seen 500 100 128 --seed 2 --chat-system-seen
  chat $1_4000 4000 300 400 --seed 3
  chat $1_4000_seen 4000 300 400 --seed 4 --chat-system-seen
  chat $1_8000_seen 8000 300 400 --seed 5 --chat-system-seen
  chat $1_500 500 100 128 --seed 6
}
stop() { kill $pid; wait $pid 2> /dev/null; }
serve head $H /tmp/c9_on && { chat head_first 500 100 128 --seed 1; chat head_second 500 100 128 --seed 7; shapes on; stop; }
echo "at $(( $(date +%s) - T0 )) s"
serve off $H /tmp/c9_off --no-enable-prefix-caching && { chat off_first 500 100 128 --seed 1; shapes off; stop; }
echo "at $(( $(date +%s) - T0 )) s"
if [ $(( $(date +%s) - T0 )) -lt 400 ]; then
  serve old $H/.probe/old_fc905ef /tmp/c9_old && { chat old_first 500 100 128 --seed 1; chat old_second 500 100 128 --seed 7; stop; }
fi
echo "at $(( $(date +%s) - T0 )) s"
