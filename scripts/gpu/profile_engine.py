"""Where the engine thread spends its time under a serving-like load, in-process (no HTTP): prefix caching on,
on with a host tier (``host``) and off, one engine after the other in one process, random weights at the size's
real shapes.

    python3 scripts/gpu/profile_engine.py --size 9b [--concurrency 64] [--num-prompts 256] [--out prof.json]
        [--variants on off host] [--kv-offloading-size 32] [--trace-prompts 64] [--compilation-cache-dir DIR]

Clients keep ``--concurrency`` requests of random 1024/128 token ids in flight (greedy, ignore_eos), as
scripts/bench_serving.py does over HTTP. A sampler reads the engine thread's stack every millisecond; the
table gives output tokens/s, TPOT p50 and the functions the engine thread was in most (its innermost frame in
hybrid_jax, with the caller). ``--trace-prompts N`` then runs N more prompts under jax.profiler: the device's
busy share of that loop's wall time, and the kernels whose total time differs most between the first two
variants (is a variant's cost device work, or time the device waits on the host?). ``--compilation-cache-dir``
keeps the programs across runs, so that one process per variant starts in seconds (a variant's figure can
depend on the engines run before it in the same process).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import statistics
import sys
import tempfile
import threading
import time

import jax
import numpy as np

import hybrid_jax
from hybrid_jax.compilation_cache import enable_compilation_cache, executable_dir
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.profiling import by_family, device_kernels, kernel_family, largest_differences


class StackSampler(threading.Thread):
    """Counts the engine thread's (innermost hybrid_jax frame, its caller, innermost frame) every ``interval`` s."""

    def __init__(self, interval: float = 1e-3):
        super().__init__(daemon=True)
        self.interval, self.counts, self.stop = interval, collections.Counter(), threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            engine = next((t for t in threading.enumerate() if t.name == "hybrid-jax-engine"), None)
            frame = sys._current_frames().get(engine.ident) if engine is not None else None
            if frame is None:
                continue
            inner = f"{frame.f_code.co_name}"
            ours = []
            while frame is not None and len(ours) < 2:
                if "hybrid_jax" in frame.f_code.co_filename:
                    ours.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
                frame = frame.f_back
            self.counts[(" <- ".join(ours), inner)] += 1


def copy_bytes(line: str) -> int:
    """Bytes of the array an HLO copy instruction writes."""
    m = re.search(r"= (\w+)\[([\d,]*)\]", line)
    if m is None:
        return 0
    size = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}.get(m.group(1), 4)
    return size * math.prod(int(d) for d in m.group(2).split(",") if d)


def closed_loop(engine: Engine, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    queue = list(prompts)
    lock = threading.Lock()
    tpot, tokens = [], [0]

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            times = [e.time for e in engine.submit(prompt, params) if e.token_id is not None]
            with lock:
                tokens[0] += len(times)
                tpot.append((times[-1] - times[0]) / (len(times) - 1))

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    return {"output_tok_s": tokens[0] / wall, "tpot_p50_ms": 1e3 * statistics.median(tpot), "wall_s": wall}


def settle(engine: Engine, timeout_s: float = 30.0) -> None:
    """Wait until the engine idles with no fill pending (fills start once it idles), so that a traced loop holds
    only its own requests' work."""
    scheduler, deadline = engine.scheduler, time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (scheduler.idle and not (scheduler.fills and scheduler.fills.pending)):
        time.sleep(0.05)
    time.sleep(0.2)


def traced_loop(engine: Engine, prompts: list[list[int]], concurrency: int) -> dict:
    """``closed_loop`` under jax.profiler, after `settle`: its wall time, the device's busy time, {kernel family:
    ms} and {kernel family: calls}."""
    settle(engine)
    trace_dir = tempfile.mkdtemp(prefix="hybrid_jax_trace_")
    jax.profiler.start_trace(trace_dir)
    wall = closed_loop(engine, prompts, concurrency, 128)["wall_s"]
    jax.profiler.stop_trace()
    kernels = device_kernels(trace_dir)
    calls = collections.Counter()
    for k in kernels:
        calls[kernel_family(k["name"])] += k["count"]
    return {"wall_s": wall, "device_busy_s": sum(k["us"] for k in kernels) / 1e6,
            "kernels_ms": {k: us / 1e3 for k, us in by_family(kernels).items()},
            "kernel_calls": dict(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8b")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", nargs="+", choices=("on", "off", "host"), default=["on", "off"])
    parser.add_argument("--kv-offloading-size", type=float, default=32.0, help="GiB, for the host variant")
    parser.add_argument("--trace-prompts", type=int, default=0, metavar="N",
                        help="trace a further loop of N prompts: device busy time and kernel differences")
    parser.add_argument("--compilation-cache-dir", default=None, help="keep the compiled programs there across runs")
    args = parser.parse_args()
    executables = None
    if args.compilation_cache_dir:
        enable_compilation_cache(args.compilation_cache_dir)
        executables = executable_dir(args.compilation_cache_dir)
    model = hybrid_jax.random_model(args.size, "bfloat16")
    rng = np.random.default_rng(0)
    results = {}
    for variant in args.variants:
        config = EngineConfig(max_batch=args.concurrency, max_model_len=4096, prefill_chunk=1024,
                              decode_steps=args.decode_steps, memory_utilization=0.85,
                              decode_sizes=(args.concurrency,), prefill_sizes=(256, 1024),
                              enable_prefix_caching=variant != "off",
                              kv_offloading_size=args.kv_offloading_size if variant == "host" else 0.0)
        engine = Engine(model, config, valid_vocab=248_077, executable_dir=executables).start()
        decode = engine.runner.program(("decode", True, args.decode_steps, args.concurrency))
        copies = [line.strip()[:200] for line in decode.as_text().splitlines()
                  if " copy(" in line and copy_bytes(line) >= 2**20]
        closed_loop(engine, [rng.integers(0, 248_000, 1024).tolist() for _ in range(8)], 8, 16)  # settle
        sampler = StackSampler()
        sampler.start()
        row = closed_loop(engine, [rng.integers(0, 248_000, 1024).tolist() for _ in range(args.num_prompts)],
                          args.concurrency, 128)
        sampler.stop.set()
        total = sum(sampler.counts.values())
        row["top"] = [(where, inner, round(100 * n / total, 1)) for (where, inner), n in
                      sampler.counts.most_common(args.top)]
        row["stats"], row["decode_copies"] = engine.stats(), copies
        if args.trace_prompts:
            row["trace"] = traced_loop(engine, [rng.integers(0, 248_000, 1024).tolist()
                                                for _ in range(args.trace_prompts)], args.concurrency)
        results[variant] = row
        engine.shutdown()
        engine.release()
        del engine
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    for label, row in results.items():
        print(f"\n== prefix caching {label}: {row['output_tok_s']:.1f} tok/s, TPOT p50 {row['tpot_p50_ms']:.2f} ms, "
              f"{row['wall_s']:.1f} s")
        for where, inner, share in row["top"]:
            print(f"{share:5.1f}%  {where}  [{inner}]")
        print("decode program copies >= 1 MiB:", len(row["decode_copies"]))
        for line in row["decode_copies"][:20]:
            print("   ", line)
        if "trace" in row:
            trace = row["trace"]
            print(f"traced loop of {args.trace_prompts} prompts: {trace['wall_s']:.2f} s, device busy "
                  f"{trace['device_busy_s']:.2f} s ({100 * trace['device_busy_s'] / trace['wall_s']:.1f}%)")
    traced = [(label, row["trace"]) for label, row in results.items() if "trace" in row]
    if len(traced) >= 2:
        (a, ta), (b, tb) = traced[:2]
        print(f"\n{a} - {b} ms  {a} ms  {b} ms  {a} calls  {b} calls  kernel (traced loops)")
        for name, ms_a, ms_b in largest_differences(ta["kernels_ms"], tb["kernels_ms"], args.top):
            calls_a, calls_b = ta["kernel_calls"].get(name, 0), tb["kernel_calls"].get(name, 0)
            print(f"{ms_a - ms_b:9.1f} {ms_a:9.1f} {ms_b:9.1f} {calls_a:8.0f} {calls_b:8.0f}  {name[:80]}")


if __name__ == "__main__":
    main()
