"""Device time from jax.profiler traces: what the benchmark and profiling scripts report."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import tempfile

import jax


def device_kernels(trace_dir: str, calls: int = 1) -> list[dict]:
    """The device-stream events of the one trace under ``trace_dir``, summed per kernel name and divided by
    ``calls``: [{"name", "count", "us"}], longest first."""
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") != "X" or "GPU" not in processes.get(e["pid"], ""):
            continue
        if "Stream" not in threads.get((e["pid"], e["tid"]), ""):
            continue
        totals[e["name"]][0] += 1
        totals[e["name"]][1] += e["dur"]
    rows = [{"name": k, "count": c / calls, "us": t / calls} for k, (c, t) in totals.items()]
    return sorted(rows, key=lambda r: -r["us"])


def trace_kernels(fn, *args, calls: int = 5) -> list[dict]:
    """Run ``fn(*args)`` once to warm up, then trace ``calls`` synchronous calls: `device_kernels` per call."""
    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="hybrid_jax_trace_")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    jax.profiler.stop_trace()
    return device_kernels(trace_dir, calls)
