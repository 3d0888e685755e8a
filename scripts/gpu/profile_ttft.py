"""Where a prefix-cache hit's time to first token goes, in-process (no HTTP): random weights at the size's real
shapes, prefix caching on.

    python3 scripts/gpu/profile_ttft.py --size 9b [--lengths 1024 16384 32768] [--repeats 5] [--out ttft.json]

Each prompt (random token ids) is sent once cold, then ``--repeats`` times again, one at a time, max_tokens 1:
each repeat resumes at the last block boundary before its last token. For each length the table gives the cold
TTFT and the repeats' p50 (submit to the first token's event), the kernel time of one repeat (in a profiler
trace), each traced repeat's busy spans on the device (first kernel to last, without a 1 ms idle gap) and the
repeats' longest kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np

import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.profiling import busy_spans, device_events, device_kernels

PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def ttft(engine: Engine, prompt: list[int]) -> float:
    """Seconds from submit to the first token's event."""
    start = time.monotonic()
    events = list(engine.submit(prompt, PARAMS))
    return events[0].time - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = hybrid_jax.random_model(args.size, "bfloat16")
    config = EngineConfig(max_batch=64, max_model_len=max(args.lengths) + 512, prefill_chunk=1024, decode_steps=4,
                          decode_sizes=(1, 64), background_compile=False)
    engine = Engine(model, config, valid_vocab=248_077).start()
    rng = np.random.default_rng(0)
    rows = []
    ttft(engine, rng.integers(0, 248_000, 256).tolist())  # settle
    for length in args.lengths:
        prompt = rng.integers(0, 248_000, length).tolist()
        cold = ttft(engine, prompt)
        warm = [ttft(engine, prompt) for _ in range(args.repeats)]
        trace_dir = tempfile.mkdtemp(prefix="ttft_trace_")
        jax.profiler.start_trace(trace_dir)
        traced = []
        for _ in range(args.repeats):
            traced.append(ttft(engine, prompt))
            time.sleep(0.1)
        jax.profiler.stop_trace()
        kernels = device_kernels(trace_dir, args.repeats)
        spans = busy_spans(device_events(trace_dir), gap_us=1000)  # the requests run ~100 ms apart
        rows.append({"prompt_len": length, "cold_ms": 1e3 * cold, "warm_p50_ms": 1e3 * statistics.median(warm),
                     "warm_traced_p50_ms": 1e3 * statistics.median(traced),
                     "device_ms": sum(k["us"] for k in kernels) / 1e3, "top": kernels[: args.top],
                     "spans": [{"ms": span / 1e3, "kernels": len(names), "first": names[:8]}
                               for span, _, names in spans]})
    engine.shutdown()
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
            "size": args.size, "weights": "random at real shapes", "stats": engine.stats()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta['device']} {args.size}")
    print(f"{'prompt':>7} {'cold ms':>9} {'warm ms':>9} {'kernels ms':>11} {'busy spans ms':>14}")
    for r in rows:
        print(f"{r['prompt_len']:7d} {r['cold_ms']:9.1f} {r['warm_p50_ms']:9.1f} {r['device_ms']:11.2f} "
              f"{[round(span['ms'], 2) for span in r['spans']]}")
    for r in rows:
        print(f"{r['prompt_len']}, the last traced repeat's spans: " + " | ".join(
            f"{span['ms']:.2f} ms, {span['kernels']} kernels: {' '.join(span['first'])}" for span in r["spans"][-4:]))
    for r in rows:
        print(f"{r['prompt_len']}: " + ", ".join(f"{k['name'][:40]} {k['us']:.0f} us x{k['count']:.0f}"
                                                  for k in r["top"]))


if __name__ == "__main__":
    main()
