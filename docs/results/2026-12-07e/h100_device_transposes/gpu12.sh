set -u
unset CC
t0=$(date +%s)
el() { echo "elapsed $(( $(date +%s) - t0 ))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p $OUT/s08 $OUT/s9
OUT=$OUT/s08 TREES="new=." ROUNDS=3 READY_TIMEOUT=90 bash scripts/gpu/start_ab.sh 0.8b 2>&1 | tee $OUT/start_ab_08.txt
el
python3 docs/results/2026-12-07c/ckload.py write 9b /tmp/ck_9b 2>&1 | grep -v Warning | tee $OUT/ckload.log
el | tee -a $OUT/ckload.log
for round in 1 2; do
  for v in new old new_t16 new_t64; do
    case $v in old) pp=/tmp/site:$PWD/OLD_TREE; var=current;; new) pp=/tmp/site:$PWD; var=current;;
      new_t*) pp=/tmp/site:$PWD; var=current_t${v#new_t};; esac
    echo -n "$v " | tee -a $OUT/ckload.log
    PYTHONPATH=$pp python3 docs/results/2026-12-07c/ckload.py time $var /tmp/ck_9b 2>&1 | grep -E "^current|Error" | tee -a $OUT/ckload.log
  done
done
el | tee -a $OUT/ckload.log
[ $(( $(date +%s) - t0 )) -lt 380 ] && OUT=$OUT/s9 TREES="new=. old=OLD_TREE" ROUNDS=2 READY_TIMEOUT=90 bash scripts/gpu/start_ab.sh /tmp/ck_9b 2>&1 | tee $OUT/start_ab_9b.txt
el
