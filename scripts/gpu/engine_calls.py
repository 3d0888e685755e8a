"""The engine's c=1 decode, call by call: how long each call takes on the device as the engine runs it.

    python scripts/gpu/engine_calls.py --size 9b [--max-batch 64] [--decode-sizes 1] [--prefill-sizes 1024]
        [--max-prefill-seqs 4] [--compile-threads 8] [--decode-steps 4] [--memory-utilization 0.9] [--reps 4]
        [--out calls.json]

Starts the engine (random bf16 weights at the size's real shapes, max_model_len 4096, `--decode-steps` a call)
and decodes one 1024-token prompt to 128 greedy tokens `--reps` times. Per run: TPOT as `vllm bench serve`
computes it, the gaps between token deliveries (a chained call's gap is its device time), and the host's time
to launch a call and to read one back. The first run settles and is not summarised. Prints a table; JSON with
every gap beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams


class CallTimer:
    """Wraps an engine's decode launch and delivery to record their host time."""

    def __init__(self, engine: Engine):
        self.launches: list[tuple[float, bool]] = []  # (ms, chained)
        self.delivers: list[float] = []  # ms, including the wait for the call to finish
        launch, deliver = engine._launch_decode, engine._deliver_call

        def timed_launch(requests, variant, after=None, first=None):
            start = time.perf_counter()
            call = launch(requests, variant, after, first)
            self.launches.append(((time.perf_counter() - start) * 1e3, after is not None))
            return call

        def timed_deliver(call):
            start = time.perf_counter()
            deliver(call)
            self.delivers.append((time.perf_counter() - start) * 1e3)

        engine._launch_decode, engine._deliver_call = timed_launch, timed_deliver

    def clear(self) -> None:
        self.launches.clear()
        self.delivers.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="9b")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--decode-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--prefill-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--max-prefill-seqs", type=int, default=4)
    parser.add_argument("--compile-threads", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=4, help="greedy decode steps per device call")
    parser.add_argument("--memory-utilization", type=float, default=0.9)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = EngineConfig(max_batch=args.max_batch, max_model_len=4096, page_size=16, prefill_chunk=1024,
                          decode_steps=args.decode_steps, memory_utilization=args.memory_utilization,
                          max_prefill_seqs=args.max_prefill_seqs, compile_threads=args.compile_threads,
                          decode_sizes=tuple(args.decode_sizes) if args.decode_sizes else None,
                          prefill_sizes=tuple(args.prefill_sizes) if args.prefill_sizes else None)
    engine = Engine(hybrid_jax.random_model(args.size, "bfloat16"), config, valid_vocab=248_077)
    timer = CallTimer(engine)
    engine.start()
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    runs = []
    try:
        for _ in range(args.reps):
            timer.clear()
            handle = engine.submit(rng.integers(0, 248_000, 1024).tolist(), params)
            times = [e.time for e in handle if e.token_id is not None]
            gaps = [round(float(g) * 1e3, 3) for g in np.diff(times)]
            call_gaps = [g for g in gaps if g > 0.5]  # a call's tokens arrive together; its gap is the call
            chained = [ms for ms, after in timer.launches if after]
            runs.append({"tpot_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3, "calls": len(timer.launches),
                         "first_call_gap_ms": call_gaps[0], "chained_call_gap_ms": statistics.median(call_gaps[1:]),
                         "chained_launch_ms": statistics.mean(chained), "deliver_ms": statistics.median(timer.delivers),
                         "gaps_ms": gaps})
    finally:
        engine.shutdown()
    keys = ("tpot_ms", "first_call_gap_ms", "chained_call_gap_ms", "chained_launch_ms", "deliver_ms")
    summary = {k: statistics.median(r[k] for r in runs[1:] or runs) for k in keys}
    result = {"args": vars(args), "summary": summary, "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(" ".join(f"{k:>20s}" for k in keys))
    print(" ".join(f"{summary[k]:20.3f}" for k in keys))


if __name__ == "__main__":
    main()
