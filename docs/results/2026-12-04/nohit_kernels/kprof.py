"""Per-kernel device time of the prefill 1024 and decode (4 steps, B=64) programs over step_times.py's padding
calls, prefix caching on and off (run from the repository root: ``python3 kprof.py 9b out.json``)."""

import json
import sys
import tempfile

import jax

import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.profiling import busy_spans, device_events, device_kernels

sys.path.insert(0, "scripts/gpu")
from step_times import Calls  # noqa: E402

size, out = sys.argv[1], sys.argv[2]
model = hybrid_jax.random_model(size, "bfloat16")
res = {}
for on in (True, False):
    e = Engine(model, EngineConfig(max_batch=64, max_model_len=4096, prefill_chunk=1024, decode_steps=4,
                                   decode_sizes=(64,), prefill_sizes=(256, 1024), memory_utilization=0.85,
                                   enable_prefix_caching=on), valid_vocab=248_077)
    calls = Calls(e)
    for name, fn in (("prefill", calls.prefill), ("decode", calls.decode)):
        for _ in range(5):
            fn()
        calls.sync()
        d = tempfile.mkdtemp()
        jax.profiler.start_trace(d)
        for _ in range(10):
            fn()
            calls.sync()
        jax.profiler.stop_trace()
        spans = busy_spans(device_events(d), 200.0)
        k = device_kernels(d, 10)
        label = f"{name}_{'on' if on else 'off'}"
        res[label] = {"kernels": k, "spans": [(s, b, len(n)) for s, b, n in spans]}
        sp = sorted(s for s, _, _ in spans)
        print(label, "spans", len(spans), "median span us", round(sp[len(sp) // 2], 1) if sp else 0, "busy/call us",
              round(sum(r["us"] for r in k), 1), "kernels/call", sum(r["count"] for r in k), flush=True)
    e.release()
with open(out, "w") as f:
    json.dump(res, f)
