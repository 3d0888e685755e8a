# Alternating warm starts of worker_probe.py (the server worker's start without gunicorn, timeline to stdout):
# this tree ("new") against HEAD_TREE ("head", another revision's hybrid_jax, pallas_kernels and server); ROUNDS.
# Run from the repository root; PYTHON: the interpreter (default python3). Prints "tree seconds-to-ready
# process-cpu-seconds" per start.
PROBE=$(cd "$(dirname "$0")" && pwd)/worker_probe.py
for t in new head; do rm -rf /tmp/pc_$t; done
run() { (cd "$1" && T0=$(date +%s.%N) PYTHONPATH=$1 "${PYTHON:-python3}" "$PROBE" plain /tmp/pc_$2 2>&1 | grep "ready$" | awk -v n=$2 '{print n, $1, $4}'); }
run "$PWD" new > /dev/null; run "$HEAD_TREE" head > /dev/null  # the first starts fill each cache
for r in $(seq "$ROUNDS"); do run "$PWD" new; run "$HEAD_TREE" head; done
