# warm starts of `hybrid-jax serve` (default flags) per tree: TREES="name=dir ..." ROUNDS
set -u
for t in $TREES; do rm -rf /tmp/cc_${t%%=*}; done
start() {
  local name=$1 root=$2 b=$(date +%s%N)
  (cd $root && PYTHONPATH=$root exec /work/main/.venv/bin/python -m server.cli serve --port 8011 --compilation-cache-dir /tmp/cc_$name) > /tmp/cpu_$name.log 2>&1 &
  local pid=$!
  until curl -sf localhost:8011/health >/dev/null; do sleep 0.05; done
  echo "$name $3 $(( ($(date +%s%N)-b)/1000000 ))"
  kill $pid; wait $pid 2>/dev/null
}
for t in $TREES; do start ${t%%=*} $(cd ${t#*=} && pwd) cold; done
for r in $(seq $ROUNDS); do for t in $TREES; do start ${t%%=*} $(cd ${t#*=} && pwd) warm$r; done; done
