"""Where the pools' allocation second goes on a warm GPU start: python3 pools_probe.py SIZE CACHE_DIR [pre]
(from the repository root, after one start has filled CACHE_DIR). Times each stored program's load (deserialize)
and call, and waits for the zeroed pools; 'pre' first runs a tiny matmul (CUDA libraries' start) and waits."""
import sys
import time

import jax
import jax.numpy as jnp

from hybrid_jax.engine import cache, programs

T0 = time.perf_counter()
rows = []
orig_load = programs.ExecutableStore.load


def load(self, name, key):
    t = time.perf_counter()
    out = orig_load(self, name, key)
    rows.append((f"load {name}", t - T0, time.perf_counter() - t))
    return out


programs.ExecutableStore.load = load
orig_alloc = cache.allocate_pools


def allocate(shapes, shardings=None, store=None, name="pools"):
    t = time.perf_counter()
    out = orig_alloc(shapes, shardings, store, name)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    rows.append((f"allocate {name}: call / wait", t - T0, t1 - t, time.perf_counter() - t1))
    return out


cache.allocate_pools = allocate
import hybrid_jax.engine.placement as placement  # noqa: E402

placement.allocate_pools = allocate
jax.devices()
rows.append(("jax.devices", 0, time.perf_counter() - T0))
if len(sys.argv) > 3 and sys.argv[3] == "pre":
    t = time.perf_counter()
    x = jnp.ones((256, 256), jnp.bfloat16)
    (x @ x).block_until_ready()
    rows.append(("pre: a matmul", t - T0, time.perf_counter() - t))
from server.backend import default_llm  # noqa: E402
from server.settings import Settings  # noqa: E402

t = time.perf_counter()
llm = default_llm(Settings(model_path=None if sys.argv[1] == "tiny" else sys.argv[1], max_batch=64, max_model_len=4096, prefill_chunk=1024,
                           decode_steps=4, compilation_cache_dir=sys.argv[2]))
rows.append(("default_llm", t - T0, time.perf_counter() - t))
for row in rows:
    print(f"{row[0]:50s} at {row[1]:6.2f} s: " + " / ".join(f"{x:.3f}" for x in row[2:]))
llm.close()
