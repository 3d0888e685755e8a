"""Decode-shaped projections (few rows x weights): XLA's dot against the Pallas gemv kernel, in device time.

    python scripts/bench_gemv.py [--batch 1 8 64] [--sweep]

Per shape, 16 distinct weight sets (together larger than the L2 cache) run in one jit; the figure is the
traced device time of all its kernels divided by 16, and the TB/s of weight bytes that implies.
``xla``: XLA's dots (weight [in, out]). ``xla_t``: XLA's dots on the transposed weight [out, in], the
checkpoint's own layout. ``pallas``: pallas_kernels.gemv at its default tuning, one launch per set (the
weights of a set share the input); with --sweep also every tuning of a grid at batch 1, the best per shape
and the tunings best over all the shapes run. Writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import jax
import jax.numpy as jnp

from hybrid_jax.profiling import trace_kernels
from pallas_kernels.gemv import gemv

SHAPES = {  # name: (in, (out, ...)) of the decode step's projections at real sizes; a set shares its input
    "0.8b gate+up": (1024, (3584, 3584)), "0.8b down": (3584, (1024,)),
    "0.8b gdn qkv+z+b+a": (1024, (6144, 2048, 16, 16)), "0.8b gdn out": (2048, (1024,)),
    "9b gate+up": (4096, (12288, 12288)), "9b down": (12288, (4096,)),
    "9b gdn qkv+z+b+a": (4096, (8192, 4096, 32, 32)), "9b gdn out": (4096, (4096,)),
    "9b attn q+k+v": (4096, (8192, 1024, 1024)),
    "27b gate+up": (5120, (17408, 17408)), "27b down": (17408, (5120,)),
    "27b gdn qkv+z+b+a": (5120, (10240, 6144, 48, 48)), "27b gdn out": (6144, (5120,)),
}
COPIES = 16
SWEEP = [dict(block_n=bn, block_k=bk, num_stages=st, num_warps=nw, target_programs=tp)
         for (bn, bk), st, nw, tp in itertools.product([(32, 128), (64, 128)], (3, 4), (4,),
                                                       (264, 396, 528, 1056, 2112))]


def run(variant: str, **tuning):
    def fn(x, sets):
        outs = []
        for ws in sets:
            if variant == "pallas":
                outs.extend(gemv(x, ws, jnp.float32, impl="kernel", **tuning))
            elif variant == "xla":
                outs.extend(jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws)
            else:
                outs.extend(jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                            for w in ws)
        return outs
    return jax.jit(fn)


def device_us(fn, *args) -> float:
    return sum(k["us"] for k in trace_kernels(fn, *args, calls=3)) / COPIES


def sweep_us(tuning: dict, x, sets) -> float | None:
    """Device time of one tuning, None where it does not compile (shared memory, say)."""
    try:
        return device_us(run("pallas", **tuning), x, sets)
    except Exception as e:  # noqa: BLE001 - a tuning the compiler rejects is skipped, with the reason shown
        print(f"  {tuning}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        return None


def overall_best(rows: list[dict]) -> list[tuple[float, dict]]:
    """Tunings ranked by the geometric mean over the swept shapes of (time / that shape's best time)."""
    swept = [r for r in rows if "sweep_us" in r]
    ranked = []
    for i, tuning in enumerate(SWEEP):
        ratios = [r["sweep_us"][i] / r["best_us"] for r in swept if r["sweep_us"][i] is not None]
        if len(ratios) == len(swept):
            ranked.append((math.exp(sum(map(math.log, ratios)) / len(ratios)), tuning))
    return sorted(ranked, key=lambda r: r[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sweep", action="store_true", help="also search the kernel's tuning at batch 1")
    parser.add_argument("--shapes", nargs="+", default=None, help="only the shapes whose name contains one of these")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    key = jax.random.key(0)
    rows = []
    for name, (d_in, widths) in SHAPES.items():
        if args.shapes and not any(part in name for part in args.shapes):
            continue
        sets = [tuple(jax.random.normal(jax.random.fold_in(key, 100 * i + j), (d_in, n), jnp.bfloat16)
                      for j, n in enumerate(widths)) for i in range(COPIES)]
        transposed = [tuple(w.T.copy() for w in ws) for ws in sets]
        nbytes = 2 * d_in * sum(widths)
        for batch in args.batch:
            x = jax.random.normal(key, (batch, d_in), jnp.bfloat16)
            row = {"shape": name, "in": d_in, "out": widths, "batch": batch}
            for variant, ws in (("xla", sets), ("xla_t", transposed), ("pallas", sets)):
                row[f"{variant}_us"] = device_us(run(variant), x, ws)
                row[f"{variant}_tbs"] = nbytes / row[f"{variant}_us"] / 1e6
            if args.sweep and batch == 1:
                row["sweep_us"] = [sweep_us(t, x, sets) for t in SWEEP]
                best_us, best = min(((us, t) for us, t in zip(row["sweep_us"], SWEEP, strict=True)
                                     if us is not None), key=lambda r: r[0])
                row.update(best_us=best_us, best_tbs=nbytes / best_us / 1e6, best=best)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del sets, transposed
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "sweep": SWEEP, "rows": rows}, f, indent=1)
    print(f"{'shape':20} {'B':>3} {'xla us':>8} {'TB/s':>5} {'xla_t us':>8} {'TB/s':>5} {'pallas us':>9} {'TB/s':>5} "
          f"{'best TB/s':>9}  best tuning")
    for r in rows:
        best = f"{r['best_tbs']:9.2f}  {r['best']}" if "best" in r else ""
        print(f"{r['shape']:20} {r['batch']:3d} {r['xla_us']:8.1f} {r['xla_tbs']:5.2f} {r['xla_t_us']:8.1f} "
              f"{r['xla_t_tbs']:5.2f} {r['pallas_us']:9.1f} {r['pallas_tbs']:5.2f} {best}")
    if args.sweep:
        print("tunings over every swept shape (geometric mean of time / the shape's best):")
        for ratio, tuning in overall_best(rows)[:5]:
            print(f"  {ratio:.3f}  {tuning}")


if __name__ == "__main__":
    main()
