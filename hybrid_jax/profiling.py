"""Device time from jax.profiler traces: what the benchmark and profiling scripts report."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile

import jax


def device_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """The device-stream events of the one trace under ``trace_dir``: (kernel name, start us, duration us), in
    start order."""
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
               if e.get("ph") == "X" and "GPU" in processes.get(e["pid"], "")
               and "Stream" in threads.get((e["pid"], e["tid"]), "")]
    return sorted(kernels, key=lambda k: k[1])


def device_kernels(trace_dir: str, calls: int = 1) -> list[dict]:
    """The device-stream events of the one trace under ``trace_dir``, summed per kernel name and divided by
    ``calls``: [{"name", "count", "us"}], longest first."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for name, _, duration in device_events(trace_dir):
        totals[name][0] += 1
        totals[name][1] += duration
    rows = [{"name": k, "count": c / calls, "us": t / calls} for k, (c, t) in totals.items()]
    return sorted(rows, key=lambda r: -r["us"])


def busy_spans(events: list[tuple[str, float, float]], gap_us: float) -> list[tuple[float, float, list[str]]]:
    """(span us, kernel us, kernel names) of each run of ``events`` (`device_events`) without an idle gap over
    ``gap_us``: the device's wall time on one piece of work, how much of it kernels filled, and which ran."""
    spans: list[list] = []
    end = None
    for name, start, duration in events:
        if end is None or start - end > gap_us:
            spans.append([start, start, 0.0, []])
        spans[-1][1] = max(spans[-1][1], start + duration)
        spans[-1][2] += duration
        spans[-1][3].append(name)
        end = spans[-1][1]
    return [(stop - start, busy, names) for start, stop, busy, names in spans]


def trace_kernels(fn, *args, calls: int = 5) -> list[dict]:
    """Run ``fn(*args)`` once to warm up, then trace ``calls`` synchronous calls: `device_kernels` per call."""
    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="hybrid_jax_trace_")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    jax.profiler.stop_trace()
    return device_kernels(trace_dir, calls)


def kernel_family(name: str) -> str:
    """A kernel's name without XLA's numbering (``input_scatter_fusion.12`` -> ``input_scatter_fusion``), so that
    the fusions one piece of code compiles to are summed together."""
    return re.sub(r"[._]\d+", "", name)


def by_family(rows: list[dict]) -> dict[str, float]:
    """`device_kernels` rows -> {kernel family: us}."""
    totals: dict[str, float] = collections.defaultdict(float)
    for row in rows:
        totals[kernel_family(row["name"])] += row["us"]
    return dict(totals)


def largest_differences(a: dict[str, float], b: dict[str, float], top: int) -> list[tuple[str, float, float]]:
    """The ``top`` kernels whose times in ``a`` and ``b`` ({kernel: us}) differ most: [(kernel, a us, b us)]."""
    names = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0.0) - b.get(k, 0.0)))
    return [(k, a.get(k, 0.0), b.get(k, 0.0)) for k in names[:top]]
