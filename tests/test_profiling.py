"""Summing a jax.profiler trace's device kernels (the benchmark scripts' device times)."""

import gzip
import json

from hybrid_jax.profiling import (
    busy_spans,
    by_family,
    device_events,
    device_kernels,
    kernel_family,
    largest_differences,
)


def test_sums_device_stream_events_per_kernel(tmp_path):
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},  # derived line
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    spans = [
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemv", "ts": 0, "dur": 10.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemv", "ts": 20, "dur": 14.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "fusion_3", "ts": 40, "dur": 2.0},
        {"ph": "X", "pid": 1, "tid": 8, "name": "gemv", "ts": 0, "dur": 10.0},
        {"ph": "X", "pid": 2, "tid": 1, "name": "PjitFunction", "ts": 0, "dur": 99.0},
    ]
    path = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + spans}, f)
    rows = device_kernels(str(tmp_path), calls=2)
    assert rows == [{"name": "gemv", "count": 1.0, "us": 12.0}, {"name": "fusion_3", "count": 0.5, "us": 1.0}]
    # Idle gaps of 10 and 6 us between the three kernels: one span when 12 us is allowed, two when 8 us is.
    events = device_events(str(tmp_path))
    assert [name for name, _, _ in events] == ["gemv", "gemv", "fusion_3"]
    assert busy_spans(events, gap_us=12) == [(42.0, 26.0, ["gemv", "gemv", "fusion_3"])]
    assert busy_spans(events, gap_us=8) == [(10.0, 10.0, ["gemv"]), (22.0, 16.0, ["gemv", "fusion_3"])]


def test_kernel_families_and_their_largest_differences():
    assert kernel_family("input_scatter_fusion.12") == "input_scatter_fusion"
    assert kernel_family("loop_gather_fusion_3") == "loop_gather_fusion"
    assert kernel_family("nvjet_sm90_tssx128x6x1_v_bz_NNT") == "nvjet_sm90_tssx128x6x1_v_bz_NNT"
    on = by_family([{"name": "scatter.1", "us": 5.0}, {"name": "scatter.2", "us": 7.0}, {"name": "gemv", "us": 50.0}])
    off = by_family([{"name": "scatter.3", "us": 6.0}, {"name": "gemv", "us": 51.0}, {"name": "copy", "us": 2.0}])
    assert on == {"scatter": 12.0, "gemv": 50.0}
    assert largest_differences(on, off, 2) == [("scatter", 12.0, 6.0), ("copy", 0.0, 2.0)]
