"""Where a decode step's time goes: host dispatch vs device time, and the device kernels ranked by time.

    python scripts/gpu/profile_decode.py --size 0.8b [--batch 1] [--context 1024] [--decode-steps 1]
        [--max-batch 64 --max-model-len 4096 --memory-utilization 0.85] [--chained]

Builds the engine's decode step at a size's real shapes (random bf16 weights) over `batch` requests, each
with its own state slot and `context` tokens of KV pages (so state and KV reads are real traffic, not one
cached null slot), then measures one call three ways (synchronous, back to back, the time for the call
to return with the device idle) and traces a few calls with jax.profiler. The trace's device events are
summed per kernel name and printed as a table; JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

import hybrid_jax
from hybrid_jax.engine.cache import pages_for
from hybrid_jax.engine.engine import Engine, EngineConfig, Request
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.profiling import trace_kernels


def timed(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024, help="tokens already in each request's cache")
    parser.add_argument("--decode-steps", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="kernel times summed over the devices")
    parser.add_argument("--sampling", action="store_true", help="the general variant (random draws, logprobs)")
    parser.add_argument("--max-batch", type=int, default=None, help="the engine's (default: --batch)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: --context + 1024")
    parser.add_argument("--memory-utilization", type=float, default=None,
                        help="size the KV pages from free memory as the server does (default: the batch's pages)")
    parser.add_argument("--chained", action="store_true",
                        help="each call reads its input tokens from the previous call's output, as the engine does")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default=None)
    parser.add_argument("--hlo-out", default=None, help="write the step's optimised HLO here")
    args = parser.parse_args()
    model = hybrid_jax.random_model(args.size, "bfloat16")
    max_len = args.max_model_len or args.context + 1024
    if max_len <= args.context:
        parser.error(f"--max-model-len {max_len} must exceed --context {args.context}")
    pool_kw = (dict(memory_utilization=args.memory_utilization) if args.memory_utilization
               else dict(num_pages=args.batch * pages_for(max_len, 16) + 1))
    config = EngineConfig(max_batch=args.max_batch or args.batch, max_model_len=max_len, page_size=16,
                          decode_steps=args.decode_steps, tensor_parallel_size=args.tensor_parallel_size, **pool_kw)
    engine = Engine(model, config, valid_vocab=248_077)
    params = SamplingParams(max_tokens=1024, temperature=0 if not args.sampling else 1.0, ignore_eos=True)
    requests = []
    for i in range(args.batch):  # decoding requests as the engine holds them: a slot and their pages each
        r = Request(f"profile-{i}", [1] * args.context, params, seed=i, output_ids=[2])
        r.slot = engine.slots.allocate(1)[0]
        r.pages = engine.pages.allocate(pages_for(max_len, 16))
        requests.append(r)
    variant = (not args.sampling, args.decode_steps)
    leaves = len(jax.tree.leaves(engine.runner.weights)), len(jax.tree.leaves(engine.pools))

    previous = None

    def call():
        nonlocal previous
        previous = engine.launch_decode(requests, variant, after=previous if args.chained else None)
        return previous.sampled

    jax.block_until_ready(call())  # compile
    if args.hlo_out:  # the program that call ran
        with open(args.hlo_out, "w") as f:
            f.write(engine.programs.get(("decode", *previous.variant, previous.size)).as_text())
    sync = timed(lambda: jax.block_until_ready(call()), 30)
    start = time.perf_counter()
    for _ in range(30):
        call()
    jax.block_until_ready(engine.pools)
    pipelined = (time.perf_counter() - start) / 30

    def dispatch_alone() -> float:  # time for a call to return with the device idle
        jax.block_until_ready(engine.pools)
        start = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - start
        jax.block_until_ready(out)
        return seconds

    dispatch = sorted(dispatch_alone() for _ in range(15))[7]
    kernels = trace_kernels(lambda: jax.block_until_ready(call()))
    busy = sum(k["us"] for k in kernels)
    summary = {"size": args.size, "tp": args.tensor_parallel_size, "batch": args.batch, "context": args.context,
               "decode_steps": args.decode_steps, "max_batch": config.max_batch, "max_model_len": max_len,
               "kv_pages": engine.layout.num_pages, "chained": args.chained,
               "sampling": args.sampling,
               "weight_leaves": leaves[0], "pool_leaves": leaves[1], "sync_ms": 1e3 * sync,
               "pipelined_ms": 1e3 * pipelined, "dispatch_ms": 1e3 * dispatch, "device_busy_ms": busy / 1e3,
               "kernels_per_call": sum(k["count"] for k in kernels), "device": str(jax.devices()[0])}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "kernels": kernels}, f, indent=1)
    print(f"{'us/call':>9} {'n/call':>7}  kernel")
    for k in kernels[: args.top]:
        print(f"{k['us']:9.1f} {k['count']:7.1f}  {k['name'][:110]}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
