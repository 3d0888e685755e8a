"""The engine's prefill and decode programs timed on their own, prefix caching on against off, one engine after
the other in one process (random weights at the size's real shapes): each program's device time over padding
batches, and the host's time to queue one call behind another in flight; with ``--kernels N``, each program's
device time per kernel from a jax.profiler trace, and the N kernels whose time differs most between on and off.

    python3 scripts/gpu/step_times.py --size 9b [--rounds 2] [--kernels 12] [--out steps.json]

The prefill step is the largest bucket (1024 tokens), the decode call the greedy multi-step one at the largest
batch (4 steps, B = 64). Padding rows point at the null slot, which the GDN decode kernels skip: the decode figure
is the call's fixed cost, not a full batch's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.profiling import by_family, largest_differences, trace_kernels

DECODE_STEPS, BATCH, PREFILL = 4, 64, 1024


class Calls:
    """Queues the prefill and the decode program of ``engine``'s runner, each over its warm-up's padding batch."""

    def __init__(self, engine: Engine):
        runner, specs = engine.runner, engine.runner.programs.specs
        self.runner = runner
        self.prefill_key, self.decode_key = ("prefill", True, PREFILL), ("decode", True, DECODE_STEPS, BATCH)
        self.prefill_batch = specs[self.prefill_key].args[3]
        decode_args = specs[self.decode_key].args
        self.snapshot_ids = None if decode_args[4] is None else np.zeros(decode_args[4].shape, np.int32)
        # A decode call donates its batch and returns the next one: chain them.
        self.decode_batch = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), decode_args[3])

    def prefill(self) -> None:
        r = self.runner
        _, r.pools, r.snapshots = r.program(self.prefill_key)(r.weights, r.pools, r.snapshots, self.prefill_batch)

    def decode(self) -> None:
        r = self.runner
        _, self.decode_batch, r.pools, r.snapshots = r.program(self.decode_key)(
            r.weights, r.pools, r.snapshots, self.decode_batch, self.snapshot_ids)

    def sync(self) -> None:
        jax.block_until_ready(self.runner.pools)


def median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 3)


def measure(calls: Calls, repeats: int = 20) -> dict:
    for call in (calls.prefill, calls.decode) * 3:
        call()
    calls.sync()
    row = {}
    for name, call in (("prefill_device_ms", calls.prefill), ("decode_device_ms", calls.decode)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            calls.sync()
            times.append(time.perf_counter() - start)
        row[name] = median_ms(times)
    behind_decode, behind_prefill = [], []
    for _ in range(repeats):
        calls.decode()
        start = time.perf_counter()
        calls.prefill()
        behind_decode.append(time.perf_counter() - start)
        start = time.perf_counter()
        calls.decode()
        behind_prefill.append(time.perf_counter() - start)
        calls.sync()
    row["prefill_queued_behind_decode_host_ms"] = median_ms(behind_decode)
    row["decode_queued_behind_prefill_host_ms"] = median_ms(behind_prefill)
    return row


def kernel_times(calls: Calls) -> dict:
    """{program: {kernel family: us per call}} from a trace of each program."""
    return {name: by_family(trace_kernels(lambda call=call: (call(), calls.runner.pools)[1], calls=10))
            for name, call in (("prefill", calls.prefill), ("decode", calls.decode))}


def print_kernel_differences(rows: list[dict], top: int) -> None:
    """Each program's device time per call on and off (medians over the rounds) and the ``top`` kernels whose
    time differs most."""
    for program in ("prefill", "decode"):
        median = {}
        for on in (True, False):
            traces = [r["kernels"][program] for r in rows if r["prefix_caching"] is on]
            median[on] = {k: statistics.median(t.get(k, 0.0) for t in traces) for k in set().union(*traces)}
        busy = {on: sum(m.values()) for on, m in median.items()}
        print(f"\n{program}: device busy {busy[True]:.1f} us on, {busy[False]:.1f} us off "
              f"({busy[True] - busy[False]:+.1f} us)")
        print(f"{'on - off us':>12} {'on us':>10} {'off us':>10}  kernel")
        for name, on, off in largest_differences(median[True], median[False], top):
            print(f"{on - off:12.1f} {on:10.1f} {off:10.1f}  {name[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8b")
    parser.add_argument("--rounds", type=int, default=2, help="on, off, on, off, ...")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="trace each program and print the N kernels whose time differs most")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = hybrid_jax.random_model(args.size, "bfloat16")
    rows = []
    for on in (True, False) * args.rounds:
        config = EngineConfig(max_batch=BATCH, max_model_len=4096, prefill_chunk=PREFILL, decode_steps=DECODE_STEPS,
                              decode_sizes=(BATCH,), prefill_sizes=(256, PREFILL), memory_utilization=0.85,
                              enable_prefix_caching=on)
        engine = Engine(model, config, valid_vocab=248_077).start()
        calls = Calls(engine)
        rows.append({"prefix_caching": on, **measure(calls)})
        print(json.dumps(rows[-1]), flush=True)
        if args.kernels:
            rows[-1]["kernels"] = kernel_times(calls)
        engine.shutdown()
        engine.release()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"size": args.size, "rows": rows}, f, indent=1)
    if args.kernels:
        print_kernel_differences(rows, args.kernels)


if __name__ == "__main__":
    main()
