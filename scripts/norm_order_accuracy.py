"""How far the engine's decode strays from fp32 with the RMS norm's division deferred past the projections.

    python scripts/norm_order_accuracy.py [--seeds 1 2 3] [--out accuracy.json]

On the CPU, a tiny random bf16 model (the engine kernel test's) generates 5 greedy tokens for two prompts with
top-5 log-probabilities three ways: the same weights in fp32 (the yardstick), the XLA path in bf16 (HF's
rounding order: the norm's output rounded after its division), and `gemv_add`'s kernel in Pallas interpret
mode with the deferred norm (rounded before it). Prints, per seed, the mean and max |difference| of the k-th
best log-probability against fp32 for each bf16 path; writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hybrid_jax
import pallas_kernels.gemv as gemv_dispatch
import pallas_kernels.gemv.kernel as gemv_kernel
from hybrid_jax.config import preset
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 300, 41], list(range(100, 121))]


def top_logprobs(model) -> tuple[list, np.ndarray]:
    """Greedy tokens [2][5] and their top-5 log-probabilities [2, 5, 5] for `PROMPTS`."""
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=5)
    engine = Engine(model, EngineConfig(max_batch=2, max_model_len=64, page_size=16, prefill_chunk=32,
                                        prefill_sizes=(32,), decode_sizes=(2,), max_prefill_seqs=2,
                                        num_pages=16)).start()
    try:
        events = [[e for e in engine.submit(p, params) if e.token_id is not None] for p in PROMPTS]
    finally:
        engine.shutdown()
    return ([[e.token_id for e in es] for es in events],
            np.asarray([[[lp for _, lp in e.top_logprobs] for e in es] for es in events]))


def compare(seed: int) -> dict:
    config = dataclasses.replace(preset("tiny"), linear_num_value_heads=16, vocab_size=512)
    model = hybrid_jax.random_model(config, "bfloat16", seed=seed)
    graph, state = nnx.split(model)
    fp32 = nnx.merge(graph, jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, state))
    exact_tokens, exact = top_logprobs(fp32)
    xla_tokens, xla = top_logprobs(model)
    kernel_mode, kernel_add = gemv_dispatch.kernel_mode, gemv_dispatch.kernel.gemv_add
    gemv_dispatch.kernel_mode = lambda op, impl, reason: True if op == "gemv_add" and reason is None else None
    gemv_dispatch.kernel.gemv_add = functools.partial(gemv_kernel.gemv_add, block_k=16, block_n=16,
                                                      target_programs=64)
    try:
        deferred_tokens, deferred = top_logprobs(model)
    finally:
        gemv_dispatch.kernel_mode, gemv_dispatch.kernel.gemv_add = kernel_mode, kernel_add
    off = lambda lp: (float(np.mean(np.abs(lp - exact))), float(np.max(np.abs(lp - exact))))
    return {"seed": seed, "same_tokens": exact_tokens == xla_tokens == deferred_tokens,
            "xla_mean_max": off(xla), "deferred_mean_max": off(deferred)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default="norm_order_accuracy.json")
    args = parser.parse_args()
    rows = [compare(seed) for seed in args.seeds]
    pair = lambda mean_max: f"{mean_max[0]:.3f} / {mean_max[1]:.2f}"
    print(f"{'seed':>4} {'same tokens':>11} {'XLA (HF order) mean / max':>26} {'deferred mean / max':>20}")
    for r in rows:
        print(f"{r['seed']:>4} {str(r['same_tokens']):>11} {pair(r['xla_mean_max']):>26} "
              f"{pair(r['deferred_mean_max']):>20}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
