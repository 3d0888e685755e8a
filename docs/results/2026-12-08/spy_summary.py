"""Milliseconds each thread held the GIL, and its top frames, from a py-spy raw profile.
`py-spy record --gil --threads --idle -r 500 -f raw -o FILE -- python ...`, then `python spy_summary.py FILE 2`
(the second argument: milliseconds per sample, 1000 / the rate)."""

import sys
from collections import Counter, defaultdict


def short(frame: str) -> str:
    """'name (path/file.py:line)' as 'name @ file.py:line)'."""
    return frame.split(" (")[0] + " @ " + frame.split("/")[-1]


per_thread: Counter[str] = Counter()
frames: defaultdict[str, Counter[str]] = defaultdict(Counter)
with open(sys.argv[1]) as profile:
    for line in profile:
        stack, count = line.rstrip().rsplit(" ", 1)
        thread, *parts = stack.split(";")
        own = [p for p in parts if "hybrid_jax" in p or "engine_beside_load" in p]
        per_thread[thread] += int(count)
        frames[thread][(short(own[-1]) if own else "-") + "  >  " + short(parts[-1] if parts else thread)] += int(count)
ms = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
for thread, n in per_thread.most_common(12):
    print(f"{n * ms:8.0f} ms  {thread}")
    for where, m in frames[thread].most_common(6):
        print(f"      {m * ms:6.0f} ms  {where}")
