#!/usr/bin/env bash
# (1) 0.8B: cold start, a profiled warm start (in process), three warm server starts.
# (2) 9B chat shapes with the cache on and off (one server each, every program built before the chats).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
PORT=8000
serve() {  # $1 label, $2 size, $3 cache dir, rest: flags; sets $pid, prints ready seconds
  local label=$1 size=$2 cache=$3; shift 3
  local s=$(date +%s%N)
  python3 -m server.cli serve --model-path $size --port $PORT --prefill-chunk 1024 --decode-steps 4 \
    --compilation-cache-dir $cache "$@" > $OUT/srv_$label.log 2>&1 &
  pid=$!
  until curl -sf localhost:$PORT/health > /dev/null; do
    kill -0 $pid 2> /dev/null || { echo "$label died"; tail -5 $OUT/srv_$label.log; return 1; }
    sleep 0.1
  done
  local ready=$(( ($(date +%s%N) - s) / 1000000 ))
  echo "$label ready ${ready} ms" | tee -a $OUT/ready.txt
  [ -n "${NOWAIT:-}" ] && return 0
  until curl -s localhost:$PORT/metrics | grep -Eq '^hybrid_jax:programs_pending\{.*\} 0\.0$'; do sleep 0.5; done
  echo "$label ready ${ready} ms, all programs $(( ($(date +%s%N) - s) / 1000000 )) ms"
}
stop() { kill $pid; wait $pid 2> /dev/null; }
C08=/tmp/c08
for k in 4 5 6; do NOWAIT=1 serve warm08_$k 0.8b $C08 --max-batch 64 --max-model-len 4096 && stop; done
grep -h "start-up" $OUT/srv_warm08_3.log | sed 's/^.*start-up: /  /'
for v in on off; do
  flag=$([ $v = on ] && echo --enable-prefix-caching || echo --no-enable-prefix-caching)
  serve chat9_$v 9b /tmp/c9_$v --max-batch 4 --decode-sizes 1 --max-model-len 20480 $flag || continue
  for shape in "500 100 128 warmup" "500 100 128 a" "1500 140 100 b" "4000 300 400 c"; do
    set -- $shape
    timeout 120 python3 scripts/bench_prefix.py --base-url http://127.0.0.1:$PORT --scenarios chat --chat-ids \
      --seed $([ $4 = warmup ] && echo 9 || echo 1) --chat-system-words $1 --chat-user-words $2 --chat-max-tokens $3 \
      --out $OUT/chat_${v}_$1_$2_$3_$4.json > $OUT/chat_${v}_$1_$2_$3_$4.log 2>&1
    python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['scenarios']['chat']['summary']; print(sys.argv[2], s)" \
      $OUT/chat_${v}_$1_$2_$3_$4.json "$v $shape"
  done
  stop
done
