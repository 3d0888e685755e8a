# Sourced by the GPU scripts: $OUT (default ./gpu_out) and `run NAME LIMIT COMMAND...`, which runs COMMAND
# under a time limit with its output in $OUT/NAME.log, and notes a failure in $OUT/failures.txt.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
run() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || echo "$name: exit $?" >> "$OUT/failures.txt"
}
