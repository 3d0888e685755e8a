"""Time the Pallas kernels against their peers on one GPU; print a table and write JSON.

    python scripts/bench_kernels.py [--out bench_kernels.json] [--quick]

Peers in the same run: fla's chunk_gated_delta_rule and fused_recurrent_gated_delta_rule (torch, timed
with triton.testing.do_bench) for the GDN kernels, XLA's own attention over dense K/V for paged
attention. Shapes are Qwen3.5-9B and -27B's (dk = dv = 128, Hk = 16, Hv = 32 / 48; attention Hq 16 / 24,
Hkv 4, hd 256). Inputs are random (bf16 q/k/v, fp32 state); speed does not depend on the values.
JAX code is timed with block_until_ready after warm-up; medians of many runs. The decode kernels are timed
as the engine runs them: calls queued back to back on donated pools, so the time is the device's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.profiling import trace_kernels
from pallas_kernels.gdn_chunk import gdn_chunk
from pallas_kernels.gdn_decode import gdn_decode, gdn_decode_fused
from pallas_kernels.paged_attention import paged_decode_attention

HBM_TBPS = 4.3  # measured HBM copy bandwidth of the H200 (shared/gpu/README.md)
SIZES = {"9b": dict(hk=16, hv=32, hq=16, hkv=4), "27b": dict(hk=16, hv=48, hq=24, hkv=4)}
D = 128


def time_jax(fn, *args, reps: int = 30) -> float:
    """Median seconds of fn(*args), compiled and warmed up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_torch(fn) -> float | None:
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def gdn_inputs(t: int, hk: int, hv: int, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = (l2(jax.random.normal(ks[0], (t, hk, D))) * D**-0.5).astype(jnp.bfloat16)
    k = l2(jax.random.normal(ks[1], (t, hk, D))).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (t, hv, D), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (t, hv)))
    return q, k, v, g, beta


def bench_gdn_chunk(size: str, t: int) -> dict:
    s = SIZES[size]
    q, k, v, g, beta = gdn_inputs(t, s["hk"], s["hv"])
    pool = jnp.zeros((2, s["hv"], D, D), jnp.float32)
    cu = jnp.asarray([0, t], jnp.int32)
    slots = jnp.asarray([1], jnp.int32)
    step = jax.jit(gdn_chunk)
    ours = time_jax(step, q, k, v, g, beta, cu, slots, pool)
    kernels = {r["name"]: round(r["us"], 1) for r in trace_kernels(step, q, k, v, g, beta, cu, slots, pool)[:4]}
    peer = None
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        tq, tk, tv = (torch.from_dlpack(jnp.repeat(x, s["hv"] // s["hk"], axis=1)[None]) if x is not v
                      else torch.from_dlpack(x[None]) for x in (q, k, v))
        tg, tb = torch.from_dlpack(g[None]), torch.from_dlpack(beta[None])
        state = torch.zeros(1, s["hv"], D, D, device="cuda", dtype=torch.float32)
        peer = time_torch(lambda: chunk_gated_delta_rule(tq, tk, tv, tg, tb, scale=1.0, initial_state=state,
                                                         output_final_state=True))
    except Exception:
        traceback.print_exc()
    flops = 4 * t * s["hv"] * D * D * 2  # order of the state and intra-chunk matmuls
    return {"op": "gdn_chunk", "size": size, "shape": f"T={t}", "ours_ms": ours * 1e3,
            "peer": "fla chunk_gated_delta_rule", "peer_ms": None if peer is None else peer * 1e3,
            "tflops": flops / ours / 1e12, "device_us": kernels}


def time_chained(step, pools: tuple, reps: int = 50) -> float:
    """Seconds per call of ``step(*pools) -> (out, *pools)`` (pools donated), calls queued back to back so
    that dispatch hides behind the device; median of 5 rounds."""
    pools = step(*pools)[1:]
    jax.block_until_ready(pools)
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            pools = step(*pools)[1:]
        jax.block_until_ready(pools)
        rounds.append((time.perf_counter() - start) / reps)
    return statistics.median(rounds)


def bench_gdn_decode(size: str, batch: int) -> dict:
    s = SIZES[size]
    q, k, v, g, beta = gdn_inputs(batch, s["hk"], s["hv"])
    pool = jax.random.normal(jax.random.PRNGKey(1), (batch + 1, s["hv"], D, D), jnp.float32)
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    ours = time_chained(jax.jit(lambda p: gdn_decode(q, k, v, g, beta, slots, p), donate_argnums=0), (pool,))
    state_bytes = 2 * batch * s["hv"] * D * D * 4
    peer = None
    try:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        rep = s["hv"] // s["hk"]
        tq = torch.from_dlpack(jnp.repeat(q, rep, axis=1)[:, None])
        tk = torch.from_dlpack(jnp.repeat(k, rep, axis=1)[:, None])
        tv, tg, tb = (torch.from_dlpack(x[:, None]) for x in (v, g, beta))
        state = torch.randn(batch, s["hv"], D, D, device="cuda", dtype=torch.float32)
        peer = time_torch(lambda: fused_recurrent_gated_delta_rule(tq, tk, tv, tg, tb, scale=1.0,
                                                                   initial_state=state, output_final_state=True))
    except Exception:
        traceback.print_exc()
    return {"op": "gdn_decode", "size": size, "shape": f"B={batch}", "ours_ms": ours * 1e3,
            "peer": "fla fused_recurrent", "peer_ms": None if peer is None else peer * 1e3,
            "tbps": state_bytes / ours / 1e12, "hbm_share": state_bytes / ours / 1e12 / HBM_TBPS}


def bench_gdn_decode_fused(size: str, batch: int, block_v: int = 128, num_warps: int = 4) -> dict:
    """The engine's decode kernel (conv shift, norms, gates, state update) from the raw projections."""
    s = SIZES[size]
    hk, hv, width = s["hk"], s["hv"], 4
    channels = 2 * hk * D + hv * D
    ks = jax.random.split(jax.random.PRNGKey(3), 7)
    mixed = jax.random.normal(ks[0], (batch, channels), jnp.bfloat16)
    a, b = (jax.random.normal(key, (batch, hv), jnp.bfloat16) for key in ks[1:3])
    conv_w = jax.random.normal(ks[3], (width, channels), jnp.bfloat16) * 0.3
    a_log = jax.random.normal(ks[4], (hv,), jnp.float32)
    dt_bias = jax.random.normal(ks[5], (hv,), jnp.bfloat16)
    conv_pool = jax.random.normal(ks[6], (batch + 1, width - 1, channels), jnp.bfloat16)
    state_pool = jax.random.normal(jax.random.PRNGKey(1), (batch + 1, hv, D, D), jnp.float32)
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)

    def step(conv, state):
        return gdn_decode_fused(mixed, a, b, conv_w, a_log, dt_bias, slots, conv, state, num_k_heads=hk,
                                head_k_dim=D, head_v_dim=D, block_v=block_v, num_warps=num_warps)

    ours = time_chained(jax.jit(step, donate_argnums=(0, 1)), (conv_pool, state_pool))
    state_bytes = 2 * batch * hv * D * D * 4
    return {"op": "gdn_decode_fused", "size": size, "shape": f"B={batch} bv={block_v} w={num_warps}",
            "ours_ms": ours * 1e3, "tbps": state_bytes / ours / 1e12, "hbm_share": state_bytes / ours / 1e12 / HBM_TBPS}


def bench_paged_decode(size: str, batch: int, context: int, page_size: int = 16) -> dict:
    s = SIZES[size]
    hq, hkv, hd = s["hq"], s["hkv"], 256
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq + 1
    key = jax.random.PRNGKey(2)
    k_pages = jax.random.normal(key, (num_pages, page_size, hkv, hd), jnp.bfloat16)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (num_pages, page_size, hkv, hd), jnp.bfloat16)
    perm = np.random.default_rng(0).permutation(np.arange(1, num_pages))
    tables = jnp.asarray(perm.reshape(batch, pages_per_seq), jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    q = jax.random.normal(jax.random.fold_in(key, 2), (batch, hq, hd), jnp.bfloat16)
    ours = time_jax(jax.jit(lambda *a: paged_decode_attention(*a, scale=hd**-0.5)), q, k_pages, v_pages, tables, lens)
    dense_k = k_pages[tables].reshape(batch, context, hkv, hd)
    dense_v = v_pages[tables].reshape(batch, context, hkv, hd)

    def xla_attention(q, k, v):
        return jax.nn.dot_product_attention(q[:, None], k, v, scale=hd**-0.5)[:, 0]

    peer = time_jax(jax.jit(xla_attention), q, dense_k, dense_v)
    kv_bytes = 2 * batch * context * hkv * hd * 2
    return {"op": "paged_decode_attention", "size": size, "shape": f"B={batch} ctx={context}",
            "ours_ms": ours * 1e3, "peer": "XLA dot_product_attention (dense KV)", "peer_ms": peer * 1e3,
            "tbps": kv_bytes / ours / 1e12, "hbm_share": kv_bytes / ours / 1e12 / HBM_TBPS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="only the fused GDN decode kernel, over its tile width and warp count")
    args = parser.parse_args()
    lengths = (1024, 8192) if args.quick else (1024, 8192, 32768)
    batches = (1, 64) if args.quick else (1, 8, 64, 256)
    if args.decode_sweep:
        cases = [(bench_gdn_decode_fused, size, b, bv, w) for size in SIZES for b in (1, 64)
                 for bv in (32, 64, 128) for w in (4, 8)]
    else:
        cases = [(bench_gdn_chunk, size, t) for size in SIZES for t in lengths]
        cases += [(bench_gdn_decode, size, b) for size in SIZES for b in batches]
        cases += [(bench_gdn_decode_fused, size, b) for size in SIZES for b in batches]
        cases += [(bench_paged_decode, "9b", b, 4096) for b in (1, 64)]
    rows = []
    for fn, *case in cases:
        try:
            rows.append(fn(*case))
        except Exception as e:
            traceback.print_exc()
            rows.append({"op": fn.__name__, "size": case[0], "shape": str(case[1:]), "error": repr(e)[:200]})
        print(json.dumps(rows[-1]), flush=True)
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}\n")
    header = ("op", "size", "shape", "ours ms", "peer ms", "peer/ours", "TB/s|TF/s", "HBM%")
    print("{:24} {:5} {:18} {:>9} {:>9} {:>9} {:>9} {:>6}".format(*header))
    for r in rows:
        if "error" in r:
            print(f"{r['op']:24} {r['size']:5} {r['shape']:18} error: {r['error'][:60]}")
            continue
        ratio = f"{r['peer_ms'] / r['ours_ms']:.2f}" if r.get("peer_ms") else "-"
        rate = r.get("tbps", r.get("tflops"))
        share = f"{100 * r['hbm_share']:.0f}" if "hbm_share" in r else "-"
        peer = f"{r['peer_ms']:.3f}" if r.get("peer_ms") else "-"
        print(f"{r['op']:24} {r['size']:5} {r['shape']:18} {r['ours_ms']:9.3f} {peer:>9} {ratio:>9} {rate:9.2f} "
              f"{share:>6}")


if __name__ == "__main__":
    main()
