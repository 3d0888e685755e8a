#!/usr/bin/env bash
# c=64 no-hit throughput over HTTP, 9B, prefix caching on vs off: fresh servers alternating, two benches each.
# Env: DEADLINE (seconds from start, default 540), ORDER (default "on off on off on off on off"), NUM (prompts per bench).
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-540}; NUM=${NUM:-256}; MODEL=${MODEL:-9b}
ORDER=${ORDER:-"on off on off on off on off"}
O=$OUT/raw; mkdir -p $O
PORT=8000
FLAGS="--max-batch 64 --max-model-len 36864 --prefill-chunk 1024 --decode-steps 4 --decode-sizes 1 16 64 --no-background-compile"
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
serve() {  # $1 label, $2 extra flags, $3 cache dir
  local t=$(date +%s.%N)
  python3 -m server.cli serve --model-path $MODEL --served-model-name m --port $PORT $FLAGS --compilation-cache-dir $3 $2 > $O/server_$1.log 2>&1 &
  server=$!
  until curl -sf localhost:$PORT/health > /dev/null; do kill -0 $server 2>/dev/null || { echo died; tail $O/server_$1.log; return 1; }; sleep 0.25; done
  echo "$1 ready in $(python3 -c "print(round($(date +%s.%N)-$t,1))") s"
}
bench() {  # $1 label
  local c0=$(cpu $server)
  python3 scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --model m --concurrency 64 --num-prompts $NUM --out $O/c64_$1.json > $O/c64_$1.log 2>&1
  local c1=$(cpu $server)
  python3 -c "import json; r=json.load(open('$O/c64_$1.json')); p=r['rows'][-1]; print('RESULT $1', round(p['output_tok_s'],1), round(p['tpot_p50_ms'],2), round(p['ttft_p50_ms'],1), 'cpu_s', round(($c1-$c0)/100,1))" 2>/dev/null | tee -a $O/results.txt || tail -3 $O/c64_$1.log
}
stop() { kill $server; wait $server 2>/dev/null; }
i=0
for v in $ORDER; do
  i=$((i+1))
  [ $(left) -lt 120 ] && { echo "deadline: stop before $v$i"; break; }
  if [ $v = on ]; then f=""; else f="--no-enable-prefix-caching"; fi
  serve $v$i "$f" /tmp/cc_$v && { bench ${v}${i}a; [ $(left) -gt 60 ] && bench ${v}${i}b; stop; }
done
echo; echo "== summary (label tok/s tpot_p50 ttft_p50 server_cpu_s)"; cat $O/results.txt
