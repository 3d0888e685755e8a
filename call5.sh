python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD HOME=/tmp TRITON_CACHE_DIR=/tmp/triton_cache;
R=$OUT; export OUT=$OUT/v; mkdir -p $OUT
timeout 320 bash scripts/gpu/serve_bench.sh 0.8b --qps 4 16 > $OUT/run_0.8b.log 2>&1
pkill -f gunicor[n]; pkill -f "hybrid_jax.cl[i]"
grep -E "ready|c=1 |c=64|hf-transformers" $OUT/run_0.8b.log
cd $R && tar czf v.tgz v && rm -rf v
