#!/usr/bin/env bash
# #28 on one GPU: 0.8B cold + 2 warm (random weights); a 0.8B checkpoint directory's starts (3); 9B cold HEAD vs
# bb3ffa9 (ready only) + 1 warm HEAD; the pools probe. Everything printed; ready times only (NOWAIT).
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PORT=8000
serve() {  # $1 label, $2 root, $3 size, $4 cache dir; sets $pid
  local label=$1 root=$2 size=$3 cache=$4; shift 4
  local s=$(date +%s%N)
  ( cd $root && PYTHONPATH=/tmp/site:$root exec python3 -m server.cli serve --model-path $size --port $PORT --prefill-chunk 1024 \
    --decode-steps 4 --max-batch 64 --max-model-len 4096 --compilation-cache-dir $cache "$@" ) > /tmp/srv_$label.log 2>&1 &
  pid=$!
  until curl -sf localhost:$PORT/health > /dev/null; do
    kill -0 $pid 2> /dev/null || { echo "$label died"; tail -5 /tmp/srv_$label.log; return 1; }
    [ $(( ($(date +%s%N) - s) / 1000000000 )) -gt 150 ] && { echo "$label: no ready in 150 s"; return 1; }
    sleep 0.05
  done
  echo "$label ready $(( ($(date +%s%N) - s) / 1000000 )) ms (t=$(( $(date +%s) - T0 )) s)"
}
stop() { kill $pid; wait $pid 2> /dev/null; }
phases() { grep -h "start-up" /tmp/srv_$1.log | sed 's/^.*start-up: /    /'; }
H=$PWD
serve cold08 $H 0.8b /tmp/c08 && stop; phases cold08
for k in 1 2; do serve warm08_$k $H 0.8b /tmp/c08 && stop; done; phases warm08_2
export PYTHONPATH=/tmp/site:$H
t=$(date +%s); python3 -c "
import hybrid_jax
hybrid_jax.save_pretrained(hybrid_jax.random_model(hybrid_jax.preset('0.8b'), 'bfloat16'), '/tmp/ck08')" \
  && python3 -m hybrid_jax.cli export-tokenizer /tmp/ck08 > /dev/null && echo "checkpoint written in $(( $(date +%s) - t )) s"; ls /tmp/ck08
for k in 1 2 3 4; do serve ck08_$k $H /tmp/ck08 /tmp/c08 && stop; done
phases ck08_1; phases ck08_4
echo "== pools probe"; timeout 60 python3 .probe/pools_probe.py 0.8b /tmp/c08 2>&1 | tail -12
for code in head old; do
  root=$([ $code = head ] && echo $H || echo $H/.probe/old_bb3ffa9)
  [ $(( $(date +%s) - T0 )) -gt 420 ] && { echo "deadline before cold9_$code"; break; }
  serve cold9_$code $root 9b /tmp/c9_$code && stop
  grep -h -E "start-up|lowered" /tmp/srv_cold9_$code.log | sed 's/^.*start-up: /    /' | tail -8
done
[ $(( $(date +%s) - T0 )) -lt 540 ] && { serve warm9_head $H 9b /tmp/c9_head && stop; phases warm9_head; }
cp /tmp/srv_ck08_1.log /tmp/srv_ck08_4.log /tmp/srv_cold9_head.log $OUT/ 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
