#!/usr/bin/env bash
# c=64 no-hit throughput over HTTP, 9B: this tree (new) against .probe/old (91e3ce7), prefix caching on / off;
# fresh servers in ORDER (labels TREE_MODE), two benches each. Env: DEADLINE, ORDER, NUM.
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-570}; NUM=${NUM:-256}; MODEL=${MODEL:-9b}
ORDER=${ORDER:-"new_on new_off old_off new_on new_off old_off new_on new_off"}
ROOT=$PWD; O=$OUT/raw; mkdir -p $O; BASE=$PYTHONPATH
PORT=8000
FLAGS="--max-batch 64 --max-model-len 36864 --prefill-chunk 1024 --decode-steps 4 --decode-sizes 1 16 64 --no-background-compile"
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
declare -A seen
serve() {  # $1 label, $2 tree dir, $3 extra flags, $4 cache dir
  local t=$(date +%s.%N)
  (cd $2 && PYTHONPATH=${BASE/$ROOT/$2} python3 -c "import hybrid_jax.engine.scheduler as s; print('$1 code:', s.__file__, hasattr(s.Scheduler, 'holding_events'))")
  (cd $2 && PYTHONPATH=${BASE/$ROOT/$2} exec python3 -m server.cli serve --model-path $MODEL --served-model-name m --port $PORT $FLAGS --compilation-cache-dir $4 $3) > $O/server_$1.log 2>&1 &
  server=$!
  until curl -sf localhost:$PORT/health > /dev/null; do kill -0 $server 2>/dev/null || { echo died; tail $O/server_$1.log; return 1; }; sleep 0.25; done
  echo "$1 ready in $(python3 -c "print(round($(date +%s.%N)-$t,1))") s"
}
bench() {  # $1 label
  python3 scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --model m --concurrency ${CONC:-64} --num-prompts $NUM --out $O/c64_$1.json > $O/c64_$1.log 2>&1
  python3 -c "import json; r=json.load(open('$O/c64_$1.json')); p=r['rows'][-1]; print('RESULT $1', round(p['output_tok_s'],1), round(p['tpot_p50_ms'],2), round(p['ttft_p50_ms'],1))" 2>/dev/null | tee -a $O/results.txt || tail -3 $O/c64_$1.log
}
stop() { kill $server; wait $server 2>/dev/null; }
i=0
for label in $ORDER; do
  i=$((i+1)); tree=${label%_*}; mode=${label#*_}
  need=50; [ -z "${seen[$label]:-}" ] && need=200
  [ $(left) -lt $need ] && { echo "deadline: stop before $label$i"; break; }
  seen[$label]=1
  dir=$ROOT; [ $tree = old ] && dir=$ROOT/.probe/old
  if [ $mode = on ]; then f=""; else f="--no-enable-prefix-caching"; fi
  serve $label$i $dir "$f" /tmp/cc_$mode && { bench ${label}${i}a; [ $(left) -gt 25 ] && bench ${label}${i}b; stop; }
done
echo; echo "== summary (label tok/s tpot_p50 ttft_p50)"; cat $O/results.txt
