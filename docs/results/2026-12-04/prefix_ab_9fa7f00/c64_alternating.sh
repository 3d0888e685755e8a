#!/usr/bin/env bash
# c=64 throughput without hits, prefix caching on against off, 9B: fresh servers alternating, and on after its
# cache was filled by long prompts.
set -u
O=$OUT/raw; mkdir -p $O
PORT=8000
FLAGS="--max-batch 64 --max-model-len 36864 --prefill-chunk 1024 --decode-steps 4 --decode-sizes 1 16 64 --no-background-compile"
serve() {  # $1 label, $2 extra flags, $3 cache dir
  python3 -m server.cli serve --model-path 9b --served-model-name m --port $PORT $FLAGS --compilation-cache-dir $3 $2 > $O/server_$1.log 2>&1 &
  server=$!
  until curl -sf localhost:$PORT/health > /dev/null; do kill -0 $server 2>/dev/null || { echo died; tail $O/server_$1.log; return 1; }; sleep 0.5; done
}
bench() {  # $1 label
  python3 scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --model m --concurrency 64 --out $O/c64_$1.json > $O/c64_$1.log 2>&1
  python3 -c "import json,sys; r=json.load(open('$O/c64_$1.json')); p=r['rows'][-1]; print('$1', round(p['output_tok_s'],1), round(p['tpot_p50_ms'],2), round(p['ttft_p50_ms'],1))" 2>/dev/null || tail -3 $O/c64_$1.log
}
stop() { kill $server; wait $server 2>/dev/null; }
serve on "" /tmp/cc_on && { bench on1; bench on2; python3 scripts/bench_prefix.py --base-url http://127.0.0.1:$PORT --scenarios cold-warm chat --lengths 16384 32768 --chat-ids --seed 2 --out $O/fill.json > $O/fill.log 2>&1; bench onfull1; bench onfull2; curl -s localhost:$PORT/metrics | grep -E "prefix_cache|snapshots|blocks" > $O/metrics_on.txt; stop; }
serve off "--no-enable-prefix-caching" /tmp/cc_off && { bench off1; bench off2; stop; }
serve on_b "" /tmp/cc_on && { bench on3; bench on4; stop; }
serve off_b "--no-enable-prefix-caching" /tmp/cc_off && { bench off3; stop; }
tar czf $OUT/c.tgz -C $O .
