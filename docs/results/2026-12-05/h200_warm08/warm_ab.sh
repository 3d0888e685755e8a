#!/usr/bin/env bash
set -u
export HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
ls /tmp/c08 > /dev/null 2>&1 || { echo "no /tmp/c08: fresh machine"; exit 1; }
serve() {  # label root cache
  local label=$1 root=$2 cache=$3; local s=$(date +%s%N)
  ( cd $root && PYTHONPATH=/tmp/site:$root exec python3 -m server.cli serve --model-path 0.8b --port 8000 --prefill-chunk 1024 \
    --decode-steps 4 --max-batch 64 --max-model-len 4096 --compilation-cache-dir $cache ) > $OUT/srv_$label.log 2>&1 &
  pid=$!
  until curl -sf localhost:8000/health > /dev/null; do kill -0 $pid 2> /dev/null || { echo "$label died"; return 1; }; sleep 0.05; done
  echo "$label ready $(( ($(date +%s%N) - s) / 1000000 )) ms"; grep -h "start-up: devices\|start-up: model shapes\|pools allocated\|weights of" $OUT/srv_$label.log | sed 's/^.*start-up: /   /'
  kill $pid; wait $pid 2> /dev/null
}
for k in 1 2 3; do serve new_$k $PWD /tmp/c08; serve old_$k $PWD/.probe/old_66ebbe8 /tmp/c08_old; done
