"""In-process engine benchmark at a size's real shapes with random weights (no HTTP): print a table, write JSON.

    python scripts/bench_engine.py --size 9b [--concurrency 1 64] [--prompt-len 1024] [--output-len 128]

Measures time to ready (weights + cache + warm-up compiles), device memory (weights, cache pools, peak), TTFT
of one prompt, TPOT at concurrency 1 (inter-token time of a single stream) and output tokens/s at the other
concurrency levels, with greedy decoding and ignore_eos. Each row also counts the JAX compiles during its
run: anything but 0 means the warm-up missed a program and the row's times include compiling. Weights are
random at the real shapes (bf16): speed does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import jax
import numpy as np
from flax import nnx

import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams


def run(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.monotonic()
    handles = [engine.submit(p, params) for p in prompts]
    ttft, tpot, total, errors = [], [], 0, 0
    for h in handles:
        events = list(h)
        errors += events[-1].finish_reason not in ("length", "stop")
        times = [e.time for e in events if e.token_id is not None]
        ttft.append(times[0] - start)
        if len(times) > 1:  # as vllm bench serve: (latency - ttft) / (output tokens - 1)
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
        total += len(times)
    wall = time.monotonic() - start
    return {"ttft_ms": 1e3 * statistics.median(ttft), "tpot_ms": 1e3 * statistics.median(tpot) if tpot else None,
            "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)) if tpot else None, "output_tok_s": total / wall,
            "requests": len(handles), "errors": errors}


class CompileCounter(logging.Handler):
    """Counts JAX's "Compiling ..." log records (with jax_log_compiles on), from any thread."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Compiling")


def device_memory(model, engine: Engine) -> dict:
    """GiB of the weights and the cache pools (over all devices), and the first device's peak use and limit
    where its runtime reports them (GPUs do; the CPU does not)."""
    gib = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree)) / 2**30
    memory = {"weights_gib": gib(nnx.state(model)), "cache_pools_gib": gib(engine.pools)}
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        memory["device_peak_gib"] = stats["peak_bytes_in_use"] / 2**30
    if "bytes_limit" in stats:
        memory["device_limit_gib"] = stats["bytes_limit"] / 2**30
    return memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=1, help="decode steps per engine call")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--memory-utilization", type=float, default=0.85,
                        help="share of free device memory for state slots + KV pages")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's (default: prompt + output + 16); the server's default is 4096")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="the engine's, with every decode bucket up to it (default: the largest concurrency, "
                             "one decode program per level measured)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's prefix cache (every prompt here is new: its cost without hits)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ready_start = time.monotonic()
    model = hybrid_jax.random_model(args.size, "bfloat16")
    max_batch = args.max_batch or max(args.concurrency)
    buckets = {} if args.max_batch else {"decode_sizes": tuple(args.concurrency)}
    max_len = args.max_model_len or args.prompt_len + args.output_len + 16
    config = EngineConfig(max_batch=max_batch, max_model_len=max_len, page_size=16,
                          prefill_chunk=args.prompt_len, max_prefill_seqs=1, prefill_sizes=(args.prompt_len,),
                          memory_utilization=args.memory_utilization, decode_steps=args.decode_steps,
                          tensor_parallel_size=args.tensor_parallel_size,
                          enable_prefix_caching=args.enable_prefix_caching, **buckets)
    engine = Engine(model, config, valid_vocab=248_077).start()
    ready = time.monotonic() - ready_start
    compiles = CompileCounter()
    logging.getLogger("jax").addHandler(compiles)
    jax.config.update("jax_log_compiles", True)
    rng = np.random.default_rng(0)
    rows = []
    for c in args.concurrency:
        prompts = [rng.integers(0, 248_000, args.prompt_len).tolist() for _ in range(c + 1)]
        run(engine, prompts[-1:], 4)  # settle (a prompt of its own: no prefix cache hit for the measured ones)
        prompts = prompts[:-1]
        before = compiles.count
        rows.append({"size": args.size, "tp": args.tensor_parallel_size, "prefix_caching": args.enable_prefix_caching,
                     "concurrency": c,
                     **run(engine, prompts, args.output_len), "compiles": compiles.count - before})
        print(json.dumps(rows[-1]), flush=True)
    memory = device_memory(model, engine)
    engine.shutdown()
    meta = {"device": str(jax.devices()[0]), "time_to_ready_s": ready, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "weights": "random at real shapes, bf16", "date": time.strftime("%Y-%m-%d"),
            **memory}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(meta)
    print(f"{'size':6} {'tp':>3} {'c':>4} {'TTFT ms':>9} {'TPOT ms':>9} {'p99 ms':>9} {'out tok/s':>10} {'errors':>7} "
          f"{'compiles':>9}")
    for r in rows:
        tpot = f"{r['tpot_ms']:.2f}" if r["tpot_ms"] else "-"
        p99 = f"{r['tpot_p99_ms']:.2f}" if r["tpot_p99_ms"] else "-"
        print(f"{r['size']:6} {r['tp']:3d} {r['concurrency']:4d} {r['ttft_ms']:9.1f} {tpot:>9} {p99:>9} "
              f"{r['output_tok_s']:10.1f} {r['errors']:7d} {r['compiles']:9d}")


if __name__ == "__main__":
    main()
