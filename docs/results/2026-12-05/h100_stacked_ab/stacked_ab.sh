#!/usr/bin/env bash
# No-hit c=64 at 9B, one engine per process: HEAD (one conv-snapshot scatter a prefill step) against a65479b (one a
# GDN layer), cache on, and HEAD cache off; order new-on old-on new-off, repeated while under DEADLINE.
# Then the GPU kernel tests of the snapshot paths, if time is left.
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-480}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name --format=csv,noheader
git log --oneline -1
run() {  # label root variant
  local s=$(date +%s)
  ( cd $2 && PYTHONPATH=/tmp/site:$2 timeout $(( 595 - ($(date +%s) - T0) )) python3 scripts/gpu/profile_engine.py --size 9b \
    --variants $3 --num-prompts 512 --top 8 --compilation-cache-dir /tmp/pe_$1 --out /tmp/$1.json > /tmp/$1_$i.log 2>&1 )
  echo "$1 $3 ($i): $(grep '^== ' /tmp/$1_$i.log) (process $(( $(date +%s) - s )) s)"
}
i=0
for round in 1 2 3 4; do
  i=$round
  for spec in "new:$PWD:on" "old:$PWD/.probe/old_a65479b:on" "new_off:$PWD:off"; do
    el=$(( $(date +%s) - T0 )); [ $el -gt $DEADLINE ] && { echo "deadline at ${el}s"; break 2; }
    IFS=: read label root variant <<< "$spec"; run $label $root $variant
  done
done
el=$(( $(date +%s) - T0 ))
[ $el -lt 540 ] && echo "kernel tests: $(PYTHONPATH=/tmp/site:$PWD timeout $(( 590 - el )) python3 -m pytest -q -x \
  tests/kernels/test_gdn_chunk.py tests/kernels/test_gdn_decode.py -k snapshot 2>&1 | tail -1)"
