set -u
unset CC
t0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - t0 ))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p $OUT/s4 $OUT/s08
for size in 4b 0.8b; do python3 docs/results/2026-12-07c/ckload.py write $size /tmp/ck_$size 2>&1 | grep -v Warning | tee -a $OUT/ckload.log; done
el | tee -a $OUT/ckload.log
for round in 1 2; do
  for v in new old; do
    case $v in old) pp=/tmp/site:$PWD/OLD_TREE;; new) pp=/tmp/site:$PWD;; esac
    echo -n "4b $v " | tee -a $OUT/ckload.log
    PYTHONPATH=$pp python3 docs/results/2026-12-07c/ckload.py time current /tmp/ck_4b 2>&1 | grep -E "^current|Error" | tee -a $OUT/ckload.log
  done
done
el | tee -a $OUT/ckload.log
OUT=$OUT/s4 TREES="new=. old=OLD_TREE" ROUNDS=2 READY_TIMEOUT=90 bash scripts/gpu/start_ab.sh /tmp/ck_4b 2>&1 | tee $OUT/start_ab_4b.txt
el
[ $(( $(date +%s) - t0 )) -lt 380 ] && OUT=$OUT/s08 TREES="new=." ROUNDS=3 READY_TIMEOUT=90 bash scripts/gpu/start_ab.sh /tmp/ck_0.8b 2>&1 | tee $OUT/start_ab_08ck.txt
el
