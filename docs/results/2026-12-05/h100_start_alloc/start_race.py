"""Timeline of a warm start in one process (server.backend.default_llm, no gunicorn): the client's start, the
first device_put calls, the tokenizer's parse. python3 start_race.py SIZE CACHE_DIR"""
import sys, threading, time
T0 = time.perf_counter()
marks = []
def mark(what): marks.append((time.perf_counter() - T0, threading.current_thread().name, what))
import numpy as np  # noqa
import jax
from hybrid_jax.engine import llm as L
from server.backend import default_llm
from server.settings import Settings
mark("imports done")
orig_devices, orig_put, orig_tok, orig_start = jax.devices, jax.device_put, L.load_tokenizer, L.start_devices
calls = {"devices": 0, "put": 0}
def devices(*a):
    calls["devices"] += 1
    r = orig_devices(*a)
    if calls["devices"] == 1: mark("jax.devices returned")
    return r
def put(x, *a, **k):
    calls["put"] += 1
    n = calls["put"]
    if n <= 3: mark(f"put {n} called ({getattr(x, 'nbytes', '?')} B)")
    r = orig_put(x, *a, **k)
    if n <= 3: mark(f"put {n} returned")
    return r
def tok(*a):
    mark("parse start"); t = orig_tok(*a); mark("parse end"); return t
def start(*a):
    mark("start_devices"); r = orig_start(*a); mark("start_devices done"); return r
jax.devices, jax.device_put, L.load_tokenizer, L.start_devices = devices, put, tok, start
size, cache = sys.argv[1], sys.argv[2]
mark("default_llm")
llm = default_llm(Settings(model_path=size, max_batch=64, max_model_len=4096, prefill_chunk=1024, decode_steps=4,
                           compilation_cache_dir=cache))
mark("ready")
for t, th, w in sorted(marks):
    print(f"{t:6.3f} {th[:22]:22s} {w}")
llm.close()
