"""Where a warm server start's seconds go, in one process: import times, CUDA's start, then default_llm under a
sampler of every thread's stack (2 ms): python3 start_prof.py SIZE CACHE_DIR (run from the repository root)."""
# ruff: noqa: E402, I001 (the imports are timed one by one)
import collections
import sys
import threading
import time
T0 = time.perf_counter()
marks = []
def mark(name): marks.append((name, time.perf_counter() - T0))
import numpy  # noqa
mark("numpy")
import jax
mark("import jax")
import flax.nnx  # noqa
mark("import flax")
import hybrid_jax  # noqa
mark("import hybrid_jax")
from server.settings import Settings
from server.backend import default_llm
import server.app  # noqa
mark("import server")
counts = collections.Counter()
stop = threading.Event()
def sample():
    me = threading.get_ident()
    while not stop.wait(0.002):
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            chain = []
            f = frame
            while f is not None and len(chain) < 4:
                fn = f.f_code.co_filename.rsplit("/", 2)
                chain.append(f"{'/'.join(fn[-2:])}:{f.f_code.co_name}:{f.f_lineno}")
                f = f.f_back
            counts[(names.get(ident, "?"), " < ".join(chain))] += 1
threading.Thread(target=sample, daemon=True).start()
jax.devices()
mark("jax.devices (CUDA start)")
size, cache = (None if sys.argv[1] == "tiny" else sys.argv[1]), sys.argv[2]
settings = Settings(model_path=size, max_batch=64, max_model_len=4096, prefill_chunk=1024, decode_steps=4,
                    compilation_cache_dir=cache)
llm = default_llm(settings)
mark("default_llm")
stop.set()
prev = 0.0
for name, t in marks:
    print(f"{t:7.2f} s  (+{t - prev:5.2f})  {name}")
    prev = t
by_thread = collections.Counter()
for (thread, _), n in counts.items():
    by_thread[thread] += n
for thread, n in by_thread.most_common(6):
    print(f"\n== thread {thread}: {n * 2 / 1e3:.2f} s sampled")
    rows = [(k[1], v) for k, v in counts.items() if k[0] == thread]
    for chain, v in sorted(rows, key=lambda r: -r[1])[:14]:
        print(f"{v * 2 / 1e3:6.2f} s  {chain[:230]}")
llm.close()
