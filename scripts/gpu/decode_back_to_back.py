"""The engine's own c=1 decode program back to back, with the engine's other programs loaded and then freed.

    python scripts/gpu/decode_back_to_back.py --size 9b [--max-batch 64] [--decode-steps 4] [--calls 60]
        [--compile-threads 8] [--out b2b.json]

Starts the engine as the server does (random bf16 weights at the size's real shapes, max_model_len 4096,
memory 0.9: every decode and prefill program compiled and run once), then times its greedy multi-step decode
program on a one-row padding batch, call after call with the batch chained on the device, three ways:
with every program loaded; after freeing the prefill programs; after freeing the other decode programs
too. Each figure is ms per decode step, the median of three timed runs; the same executable runs in all
three. Prints a table; JSON beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import jax

import hybrid_jax
from hybrid_jax.engine.engine import Engine, EngineConfig


def back_to_back_ms(engine: Engine, program, steps: int, calls: int) -> float:
    """ms per decode step of ``program`` run ``calls`` times back to back (median of three runs)."""
    batch = engine.decode_batch([], 1)
    sampled, batch, engine.pools = program(engine._weights, engine.pools, batch)
    jax.block_until_ready(engine.pools)
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            sampled, batch, engine.pools = program(engine._weights, engine.pools, batch)
        jax.block_until_ready((sampled, engine.pools))
        runs.append((time.perf_counter() - start) / calls / steps * 1e3)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="9b")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--compile-threads", type=int, default=EngineConfig.compile_threads,
                        help="programs the warm-up compiles at once")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = EngineConfig(max_batch=args.max_batch, max_model_len=4096, page_size=16, prefill_chunk=1024,
                          decode_steps=args.decode_steps, memory_utilization=0.9, max_prefill_seqs=4,
                          compile_threads=args.compile_threads)
    engine = Engine(hybrid_jax.random_model(args.size, "bfloat16"), config, valid_vocab=248_077)
    engine.warmup()
    variant = (True, args.decode_steps)
    program = engine._decode[variant]
    timed = {"all programs loaded": back_to_back_ms(engine, program, args.decode_steps, args.calls)}
    engine._prefill.clear_cache()
    gc.collect()
    timed["prefill programs freed"] = back_to_back_ms(engine, program, args.decode_steps, args.calls)
    for key, other in engine._decode.items():
        if key != variant:
            other.clear_cache()
    gc.collect()
    timed["other decode programs freed too"] = back_to_back_ms(engine, program, args.decode_steps, args.calls)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "ms_per_step": timed}, f, indent=1)
    for name, ms in timed.items():
        print(f"{name:34s} {ms:7.3f} ms a step")


if __name__ == "__main__":
    main()
