"""Time the Pallas kernels against their peers on one GPU; print a table and write JSON.

    python scripts/bench_kernels.py [--out bench_kernels.json] [--quick | --chunk-sweep | --decode-sweep |
                                    --attention-sweep | --prefill-sweep | --snapshots] [--ops gdn_chunk ...]
                                    [--sizes 9b 27b]

Peers in the same run: fla's chunk_gated_delta_rule and fused_recurrent_gated_delta_rule (torch, timed
with triton.testing.do_bench) for the GDN kernels, XLA's own attention over dense K/V for paged
attention. Shapes are Qwen3.5-9B and -27B's (dk = dv = 128, Hk = 16, Hv = 32 / 48; attention Hq 16 / 24,
Hkv 4, hd 256). Inputs are random (bf16 q/k/v, fp32 state); speed does not depend on the values.
gdn_chunk and the decode kernels are timed as the engine runs them: calls queued back to back on donated
pools, so the time is the device's. fla's chunk_gated_delta_rule launches several kernels from Python, so
do_bench can time its host; it is also timed replayed as a CUDA graph (its device time). Paged attention
and its XLA peer are timed by their kernels' device time in a trace (a synchronous call's wall time, which
adds dispatch and sync, ~0.24 ms at B=64 on the H200, is kept as wall_ms). Medians of many runs.
"""

from __future__ import annotations

import argparse
import functools
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
from pallas_kernels.paged_attention import paged_decode_attention, paged_prefill_attention

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


def torch_graph_ms(fn) -> float | None:
    """Milliseconds of ``fn()`` replayed as a captured CUDA graph: its kernels' time without the host's
    launches (the counterpart of our calls queued back to back). None when fn cannot be captured."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (autotuning) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:  # thread-local capture: JAX's runtime threads keep using CUDA meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except RuntimeError:
        traceback.print_exc()
        return None
    seconds = time_torch(graph.replay)
    return None if seconds is None else seconds * 1e3


@functools.cache
def fla_chunk(size: str, t: int) -> tuple[float | None, float | None]:
    """fla's chunk_gated_delta_rule on the inputs of `bench_gdn_chunk` (keys repeated per value head), ms: with
    do_bench (launches back to back: device time unless the host is slower) and replayed as a CUDA graph."""
    s = SIZES[size]
    q, k, v, g, beta = gdn_inputs(t, s["hk"], s["hv"])
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        tq, tk = (torch.from_dlpack(jnp.repeat(x, s["hv"] // s["hk"], axis=1)[None]) for x in (q, k))
        tv, tg, tb = (torch.from_dlpack(x[None]) for x in (v, g, beta))
        state = torch.zeros(1, s["hv"], D, D, device="cuda", dtype=torch.float32)

        def call():
            return chunk_gated_delta_rule(tq, tk, tv, tg, tb, scale=1.0, initial_state=state, output_final_state=True)

        seconds = time_torch(call)
    except Exception:
        traceback.print_exc()
        return None, None
    try:
        graph_ms = torch_graph_ms(call)
    except Exception:  # keep the do_bench figure
        traceback.print_exc()
        graph_ms = None
    return None if seconds is None else seconds * 1e3, graph_ms


SNAPSHOT_MODES = ("off", "unnamed", "named")  # no snapshot pool; a pool, no id named; the prefix cache's ids


def snapshot_ids(mode: str, shape: tuple[int, ...], every: int) -> jax.Array:
    """The snapshot ids of a ``--snapshots`` case (not "off"): all 0 when unnamed; when named, a distinct id
    (from 1) at every ``every``-th position of the last axis. The pool they index needs ids.max() + 1 rows."""
    ids = np.zeros(shape, np.int32)
    if mode == "named":
        named = (np.arange(shape[-1]) + 1) % every == 0
        ids[..., named] = 1 + np.arange(named.sum() * int(np.prod(shape[:-1]))).reshape(*shape[:-1], -1)
    return jnp.asarray(ids)


def bench_gdn_chunk(size: str, t: int, snapshots: str = "off", **tuning) -> dict:
    """gdn_chunk on one sequence of t tokens, timed as fla's do_bench times its peer: calls back to back (the
    state pool donated from one to the next), so the figure is device time, not dispatch. ``snapshots``: one
    of `SNAPSHOT_MODES` (named: every 4th chunk's state, the prefix cache's default stride)."""
    s = SIZES[size]
    q, k, v, g, beta = gdn_inputs(t, s["hk"], s["hv"])
    pool = jnp.zeros((2, s["hv"], D, D), jnp.float32)
    cu = jnp.asarray([0, t], jnp.int32)
    slots = jnp.asarray([1], jnp.int32)
    ids, snapshot_pool = None, ()
    if snapshots != "off":
        ids = snapshot_ids(snapshots, (1, -(-t // 64)), 4)
        snapshot_pool = (jnp.zeros((int(ids.max()) + 1, s["hv"], D, D), jnp.float32),)
    step = jax.jit(functools.partial(gdn_chunk, **tuning), donate_argnums=(7, 9) if snapshot_pool else 7)
    ours = time_chained(lambda *pools: step(q, k, v, g, beta, cu, slots, pools[0], ids, *pools[1:]),
                        (jnp.zeros_like(pool), *map(jnp.zeros_like, snapshot_pool)))
    run = jax.jit(functools.partial(gdn_chunk, **tuning))
    traced = trace_kernels(run, q, k, v, g, beta, cu, slots, pool, ids, *snapshot_pool)
    kernels = {r["name"]: round(r["us"], 1) for r in traced[:4]}
    peer, peer_graph_ms = fla_chunk(size, t) if snapshots == "off" else (None, None)
    flops = 4 * t * s["hv"] * D * D * 2  # order of the state and intra-chunk matmuls
    shape = f"T={t}" + "".join(f" {k}={v}" for k, v in tuning.items())
    shape += f" snap={snapshots}" if snapshots != "off" else ""
    return {"op": "gdn_chunk", "size": size, "shape": shape, "ours_ms": ours * 1e3,
            "peer": "fla chunk_gated_delta_rule", "peer_ms": peer, "tflops": flops / ours / 1e12, "device_us": kernels,
            "peer_graph_ms": peer_graph_ms}


def sweep_gdn_chunk(size: str, t: int, state_block_v: int, output_block_v: int, output_block_k: int,
                    num_warps: tuple[int, int, int], num_stages: tuple[int, int, int]) -> dict:
    """One tile configuration of gdn_chunk: its error against the XLA reference (bf16 inputs) and its times."""
    s = SIZES[size]
    q, k, v, g, beta = gdn_inputs(t, s["hk"], s["hv"], seed=1)
    pool = jax.random.normal(jax.random.PRNGKey(2), (2, s["hv"], D, D), jnp.float32)
    cu, slots = jnp.asarray([0, t], jnp.int32), jnp.asarray([1], jnp.int32)
    tuning = dict(state_block_v=state_block_v, output_block_v=output_block_v, output_block_k=output_block_k,
                  num_warps=num_warps, num_stages=num_stages)
    o, new_pool = gdn_chunk(q, k, v, g, beta, cu, slots, pool, impl="kernel", **tuning)
    o_ref, pool_ref = jax.jit(functools.partial(gdn_chunk, impl="reference"))(q, k, v, g, beta, cu, slots, pool)
    errors = {"o_max_abs_error": float(jnp.max(jnp.abs(o - o_ref))), "o_max_abs": float(jnp.max(jnp.abs(o_ref))),
              "state_max_abs_error": float(jnp.max(jnp.abs(new_pool - pool_ref))),
              "state_max_abs": float(jnp.max(jnp.abs(pool_ref)))}
    return {**bench_gdn_chunk(size, t, **tuning), **errors}


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


def bench_gdn_decode_fused(size: str, batch: int, block_v: int | None = None, num_warps: int = 4,
                           snapshots: str = "off") -> dict:
    """The engine's decode kernel (conv ring, norms, gates, state update) from the raw projections.
    ``snapshots``: one of `SNAPSHOT_MODES` (named: 4 rows store a snapshot, the most one decode step writes;
    every row below B=4)."""
    s = SIZES[size]
    hk, hv, width = s["hk"], s["hv"], 4
    channels = 2 * hk * D + hv * D
    ks = jax.random.split(jax.random.PRNGKey(3), 8)
    mixed = jax.random.normal(ks[0], (batch, channels), jnp.bfloat16)
    a, b = (jax.random.normal(key, (batch, hv), jnp.bfloat16) for key in ks[1:3])
    conv_w = jax.random.normal(ks[3], (width, channels), jnp.bfloat16) * 0.3
    a_log = jax.random.normal(ks[4], (hv,), jnp.float32)
    dt_bias = jax.random.normal(ks[5], (hv,), jnp.bfloat16)
    conv_pool = jax.random.normal(ks[6], (batch + 1, width, channels), jnp.bfloat16)
    state_pool = jax.random.normal(jax.random.PRNGKey(1), (batch + 1, hv, D, D), jnp.float32)
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    positions = jax.random.randint(ks[7], (batch,), 0, 4096, jnp.int32)

    pools = (conv_pool, state_pool)
    ids = None
    if snapshots != "off":
        ids = snapshot_ids(snapshots, (batch,), max(1, batch // 4))
        rows = int(ids.max()) + 1
        pools += (jnp.zeros((rows, width, channels), jnp.bfloat16), jnp.zeros((rows, hv, D, D), jnp.float32))

    def step(conv, state, *snapshot_pools):
        return gdn_decode_fused(mixed, a, b, conv_w, a_log, dt_bias, slots, positions, conv, state, ids,
                                *snapshot_pools, num_k_heads=hk, head_k_dim=D, head_v_dim=D, block_v=block_v,
                                num_warps=num_warps)

    ours = time_chained(jax.jit(step, donate_argnums=tuple(range(len(pools)))), pools)
    state_bytes = 2 * batch * hv * D * D * 4
    shape = f"B={batch} bv={block_v or 'auto'} w={num_warps}" + (f" snap={snapshots}" if snapshots != "off" else "")
    return {"op": "gdn_decode_fused", "size": size, "shape": shape,
            "ours_ms": ours * 1e3, "tbps": state_bytes / ours / 1e12, "hbm_share": state_bytes / ours / 1e12 / HBM_TBPS}


def bench_paged_decode(size: str, batch: int, context: int, page_size: int = 16, peer: bool = True,
                       **tuning) -> dict:
    """Paged decode attention over random pages; ours_ms is device time (the kernel and its split combine, from a
    trace), wall_ms a synchronous call's."""
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
    args = (q, k_pages, v_pages, tables, lens)
    ours = jax.jit(lambda *a: paged_decode_attention(*a, scale=hd**-0.5, **tuning))
    wall = time_jax(ours, *args)
    device = sum(r["us"] for r in trace_kernels(ours, *args, calls=10)) * 1e-6
    kv_bytes = 2 * batch * context * hkv * hd * 2
    shape = f"B={batch} ctx={context}" + "".join(f" {k}={v}" for k, v in tuning.items())
    row = {"op": "paged_decode_attention", "size": size, "shape": shape, "ours_ms": device * 1e3,
           "wall_ms": wall * 1e3, "tbps": kv_bytes / device / 1e12, "hbm_share": kv_bytes / device / 1e12 / HBM_TBPS}
    if peer:
        dense_k = k_pages[tables].reshape(batch, context, hkv, hd)
        dense_v = v_pages[tables].reshape(batch, context, hkv, hd)

        def xla_attention(q, k, v):
            return jax.nn.dot_product_attention(q[:, None], k, v, scale=hd**-0.5)[:, 0]

        peer_fn = jax.jit(xla_attention)
        peer_device = sum(r["us"] for r in trace_kernels(peer_fn, q, dense_k, dense_v, calls=10)) * 1e-6
        row.update(peer="XLA dot_product_attention (dense KV)", peer_ms=peer_device * 1e3)
    return row


def bench_paged_prefill(size: str, new_tokens: int, context: int, page_size: int = 16, **tuning) -> dict:
    """Paged prefill attention of one sequence's ``new_tokens`` at the end of a ``context``-token paged context
    (a prefix cache hit: the rest cached); ours_ms is device time (the kernel and its split combine)."""
    s = SIZES[size]
    hq, hkv, hd = s["hq"], s["hkv"], 256
    pages = -(-context // page_size)
    key = jax.random.PRNGKey(3)
    k_pages = jax.random.normal(key, (pages + 1, page_size, hkv, hd), jnp.bfloat16)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (pages + 1, page_size, hkv, hd), jnp.bfloat16)
    tables = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, pages + 1))[None], jnp.int32)
    q = jax.random.normal(jax.random.fold_in(key, 2), (new_tokens, hq, hd), jnp.bfloat16)
    args = (q, k_pages, v_pages, tables, jnp.asarray([0, new_tokens], jnp.int32), jnp.asarray([context], jnp.int32))
    ours = jax.jit(lambda *a: paged_prefill_attention(*a, scale=hd**-0.5, **tuning))
    wall = time_jax(ours, *args)
    device = sum(r["us"] for r in trace_kernels(ours, *args, calls=10)) * 1e-6
    kv_bytes = 2 * context * hkv * hd * 2
    shape = f"T={new_tokens} ctx={context}" + "".join(f" {k}={v}" for k, v in tuning.items())
    return {"op": "paged_prefill_attention", "size": size, "shape": shape, "ours_ms": device * 1e3,
            "wall_ms": wall * 1e3, "tbps": kv_bytes / device / 1e12, "hbm_share": kv_bytes / device / 1e12 / HBM_TBPS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="only the fused GDN decode kernel, over its tile width and warp count")
    parser.add_argument("--attention-sweep", action="store_true",
                        help="only paged decode attention at B=64 x 4K context, over its tiles, stages, warps, splits")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="only paged prefill attention of 64 and 1024 new tokens over 1K-32K contexts, over its "
                             "KV splits (none: its own choice)")
    parser.add_argument("--chunk-sweep", action="store_true",
                        help="only gdn_chunk at 9B shapes, T=8192, over its tiles, dk slices, warps and stages, "
                             "with its error")
    parser.add_argument("--snapshots", action="store_true",
                        help="only gdn_chunk (T=1024, 8192) and gdn_decode_fused (B=1, 64) at 9B shapes, each "
                             "without a snapshot pool, with one and no id named, and with ids named: the prefix "
                             "cache's cost in the GDN kernels")
    parser.add_argument("--ops", nargs="+", default=None,
                        choices=["gdn_chunk", "gdn_decode", "gdn_decode_fused", "paged_decode"],
                        help="only these of the default run's kernels")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES),
                        help="model sizes of the default run's GDN shapes (paged attention runs at 9B's)")
    args = parser.parse_args()
    lengths = (1024, 8192) if args.quick else (1024, 8192, 32768)
    batches = (1, 64) if args.quick else (1, 8, 64, 256)
    if args.chunk_sweep:
        # The passes time separately (device_us): each case varies the state and output passes together; the
        # prepare pass keeps its defaults (2 warps, 1 stage).
        cases = [(sweep_gdn_chunk, "9b", 8192, sbv, obv, obk, (2, w_state, w_out), (1, st, st))
                 for sbv, obv, obk in ((16, 128, 32), (32, 128, 32), (32, 64, 64), (64, 128, 64))
                 for w_state, w_out in ((4, 2), (4, 4)) for st in (3, 4)]
    elif args.snapshots:
        cases = [(bench_gdn_chunk, "9b", t, mode) for t in (1024, 8192) for mode in SNAPSHOT_MODES]
        cases += [(functools.partial(bench_gdn_decode_fused, snapshots=mode), "9b", b) for b in (1, 64)
                  for mode in SNAPSHOT_MODES]
    elif args.decode_sweep:
        cases = [(bench_gdn_decode_fused, size, b, bv, w) for size in SIZES for b in (1, 8, 64)
                 for bv, w in ((16, 4), (32, 4), (64, 4), (128, 4), (128, 8))]
    elif args.prefill_sweep:
        cases = [functools.partial(bench_paged_prefill, **({} if n is None else {"num_splits": n}))
                 for n in (None, 1, 4, 8, 16, 32)]
        cases = [(case, "9b", t, ctx) for t in (64, 1024) for ctx in (1024, 16384, 32768) for case in cases]
    elif args.attention_sweep:
        tunings = [dict(block_kv=n, num_stages=st, num_warps=w) for n in (32, 64, 128) for st, w in
                   ((2, 4), (3, 4), (2, 8), (3, 8))]
        tunings += [dict(num_splits=1), dict(num_splits=4)]
        cases = [functools.partial(bench_paged_decode, peer=False, **t) for t in tunings]
        cases = [(case, "9b", 64, 4096) for case in cases]
    else:
        cases = [(bench_gdn_chunk, size, t) for size in args.sizes for t in lengths]
        cases += [(bench_gdn_decode, size, b) for size in args.sizes for b in batches]
        cases += [(bench_gdn_decode_fused, size, b) for size in args.sizes for b in batches]
        cases += [(bench_paged_decode, "9b", b, 4096) for b in (1, 64)]
        if args.ops:
            cases = [c for c in cases if c[0].__name__.removeprefix("bench_") in args.ops]
    rows = []
    for fn, *case in cases:
        try:
            rows.append(fn(*case))
        except Exception as e:
            traceback.print_exc()
            name = getattr(fn, "func", fn).__name__
            rows.append({"op": name, "size": case[0], "shape": str(case[1:]), "error": repr(e)[:200]})
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
    for r in rows:  # where the time went, kernel by kernel, and the sweep's errors
        if r.get("device_us"):
            kernels = " ".join(f"{name.removeprefix('gdn_chunk_')}={us}" for name, us in r["device_us"].items())
            error = (f" | o err {r['o_max_abs_error']:.2g}/{r['o_max_abs']:.2g} state err "
                     f"{r['state_max_abs_error']:.2g}/{r['state_max_abs']:.2g}" if "o_max_abs_error" in r else "")
            print(f"{r['size']} {r['shape']}: device us {kernels}{error}")
    for r in rows:  # fla without its host launches (a CUDA graph) against our calls queued back to back
        if r.get("peer_graph_ms"):
            print(f"{r['size']} {r['shape']}: fla as a CUDA graph {r['peer_graph_ms']:.3f} ms, ours "
                  f"{r['ours_ms']:.3f} ms: peer/ours {r['peer_graph_ms'] / r['ours_ms']:.2f}")


if __name__ == "__main__":
    main()
