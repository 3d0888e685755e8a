"""Timeline of a warm start in one process (server.backend.default_llm, no gunicorn): the client's start, the
first device_put calls and the tokenizer's parse, each thread's marks in seconds from the process start.
python3 start_race.py SIZE CACHE_DIR (from the repository root)."""
# ruff: noqa: E402 (the marks start before the imports)
import sys
import threading
import time

T0 = time.perf_counter()
marks = []


def mark(what):
    marks.append((time.perf_counter() - T0, threading.current_thread().name, what))


import jax

from hybrid_jax.engine import llm as L
from server.backend import default_llm
from server.settings import Settings

mark("imports done")
orig_devices, orig_put, orig_tok, orig_start = jax.devices, jax.device_put, L.load_tokenizer, L.start_devices
calls = {"devices": 0, "put": 0}


def devices(*args):
    calls["devices"] += 1
    result = orig_devices(*args)
    if calls["devices"] == 1:
        mark("jax.devices returned")
    return result


def put(x, *args, **kwargs):
    calls["put"] += 1
    n = calls["put"]
    if n <= 3:
        mark(f"put {n} called ({getattr(x, 'nbytes', '?')} B)")
    result = orig_put(x, *args, **kwargs)
    if n <= 3:
        mark(f"put {n} returned")
    return result


def tokenizer(*args):
    mark("parse start")
    result = orig_tok(*args)
    mark("parse end")
    return result


def start(*args):
    mark("start_devices")
    result = orig_start(*args)
    mark("start_devices done")
    return result


jax.devices, jax.device_put, L.load_tokenizer, L.start_devices = devices, put, tokenizer, start
size, cache = sys.argv[1], sys.argv[2]
mark("default_llm")
llm = default_llm(Settings(model_path=size, max_batch=64, max_model_len=4096, prefill_chunk=1024, decode_steps=4,
                           compilation_cache_dir=cache))
mark("ready")
for t, thread, what in sorted(marks):
    print(f"{t:6.3f} {thread[:22]:22s} {what}")
llm.close()
