#!/usr/bin/env bash
# GPU plan (one command, ~4-6 min): the prefix cache's cost inside the GDN kernels on real tokens, the state pass's
# branched snapshot store (main) against a masked store (.probe/masked_store.patch), then the GPU kernel tests
# of the masked version. Run: carry [".whl", ".probe"], command "bash .probe/snap_ab.sh".
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 scripts/bench_kernels.py --snapshots --out $OUT/snap_branch.json > $OUT/snap_branch.log 2>&1
(patch -p1 < .probe/masked_store.patch || git apply .probe/masked_store.patch) || { echo "patch failed"; exit 1; }
python3 scripts/bench_kernels.py --snapshots --out $OUT/snap_masked.json > $OUT/snap_masked.log 2>&1
python3 -m pytest -q tests/kernels/test_gdn_chunk.py > $OUT/tests_masked.log 2>&1; tail -2 $OUT/tests_masked.log
for f in branch masked; do echo "== $f"; grep -E "^(gdn|9b)" $OUT/snap_$f.log; done
