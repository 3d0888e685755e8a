"""XLA's memory analysis of one engine program, compiled over an abstract model (no weights, nothing run): the
temporaries a step needs beside the weights and the pools it takes in place.

    python3 scripts/program_memory.py --size 27b --prefill 8192 [--no-enable-prefix-caching]
    python3 scripts/program_memory.py --size 9b --decode 64

On a GPU the figure is the step's own; on the CPU the programs use the pure-JAX references of the kernels, whose
temporaries are far larger, so there only differences between two versions of the code mean anything.
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp

from hybrid_jax.config import preset
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.weights import abstract_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8b")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--prefill", type=int, metavar="T", help="the general prefill program at T tokens")
    which.add_argument("--decode", type=int, metavar="B", help="the greedy decode program at B rows")
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    tokens = args.prefill or 1024
    rows = args.decode or 8
    config = EngineConfig(max_batch=rows, max_model_len=2 * tokens, prefill_chunk=tokens,
                          decode_steps=args.decode_steps, decode_sizes=(rows,), prefill_sizes=(tokens,),
                          enable_prefix_caching=args.enable_prefix_caching)
    engine = Engine(abstract_model(preset(args.size), jnp.bfloat16), config)
    key = ("prefill", False, tokens) if args.prefill else ("decode", True, args.decode_steps, rows)
    spec = engine.runner.programs.specs[key]
    start = time.perf_counter()
    analysis = spec.fn.lower(*spec.args).compile().memory_analysis()
    row = {"program": spec.name, "size": args.size, "prefix_caching": args.enable_prefix_caching,
           "compile_s": round(time.perf_counter() - start, 1),
           **{name: getattr(analysis, f"{name}_size_in_bytes") for name in ("temp", "argument", "output", "alias")}}
    print(json.dumps(row))
    print(f"{spec.name}, {args.size}: temporaries {row['temp'] / 2**20:,.1f} MiB, arguments "
          f"{row['argument'] / 2**30:.2f} GiB ({row['alias'] / 2**30:.2f} GiB of them updated in place)")


if __name__ == "__main__":
    main()
