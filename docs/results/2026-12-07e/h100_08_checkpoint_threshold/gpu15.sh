set -u
unset CC
t0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - t0 ))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p $OUT/s08
python3 docs/results/2026-12-07c/ckload.py write 0.8b /tmp/ck_0.8b 2>&1 | grep -v Warning | tee -a $OUT/ckload.log
OUT=$OUT/s08 TREES="t32=. t1=T1_TREE" ROUNDS=2 READY_TIMEOUT=60 bash scripts/gpu/start_ab.sh /tmp/ck_0.8b 2>&1 | tee $OUT/start_ab_08ck.txt
el
