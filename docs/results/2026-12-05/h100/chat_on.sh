#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
ls /tmp/c9_on > /dev/null && echo "cache kept"
s=$(date +%s%N)
python3 -m server.cli serve --model-path 9b --port 8000 --prefill-chunk 1024 --decode-steps 4 --compilation-cache-dir /tmp/c9_on \
  --max-batch 4 --decode-sizes 1 --max-model-len 20480 --enable-prefix-caching > $OUT/srv.log 2>&1 &
pid=$!
until curl -sf localhost:8000/health > /dev/null; do sleep 0.1; done
echo "ready $(( ($(date +%s%N) - s) / 1000000 )) ms"
until curl -s localhost:8000/metrics | grep -Eq '^hybrid_jax:programs_pending\{.*\} 0\.0$'; do sleep 0.5; done
echo "all $(( ($(date +%s%N) - s) / 1000000 )) ms"
for shape in "500 100 128 warmup" "500 100 128 a" "1500 140 100 b" "4000 300 400 c"; do
  set -- $shape
  timeout 100 python3 scripts/bench_prefix.py --base-url http://127.0.0.1:8000 --scenarios chat --chat-ids \
    --seed $([ $4 = warmup ] && echo 9 || echo 1) --chat-system-words $1 --chat-user-words $2 --chat-max-tokens $3 \
    --out $OUT/chat_on_$4.json > /dev/null 2>&1
  python3 -c "import json,sys; c=json.load(open(sys.argv[1]))['scenarios']['chat']; print(sys.argv[2], round(c['summary']['ttft_sum_ms'],1), [(round(r['ttft_ms'],1), r['prompt_tokens'], r['cached_tokens']) for r in c['rows']])" $OUT/chat_on_$4.json "$shape"
done
kill $pid; wait $pid 2> /dev/null
