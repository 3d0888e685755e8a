set -u
python3 .probe/kprof.py 9b $OUT/kprof_new.json 2>&1 | grep -E "spans|Error" | sed 's/^/new /'
cp hybrid_jax/engine/steps.py /tmp/steps_new.py; cp hybrid_jax/caches/paged.py /tmp/paged_new.py
cp .probe/steps_old.py hybrid_jax/engine/steps.py; cp .probe/paged_old.py hybrid_jax/caches/paged.py
python3 .probe/kprof.py 9b $OUT/kprof_old.json 2>&1 | grep -E "spans|Error" | sed 's/^/old /'
cp /tmp/steps_new.py hybrid_jax/engine/steps.py; cp /tmp/paged_new.py hybrid_jax/caches/paged.py
