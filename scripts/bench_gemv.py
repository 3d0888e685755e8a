"""Decode-shaped projections (few rows x weights): XLA's dot against the Pallas gemv kernel, in device time.

    python scripts/bench_gemv.py [--batch 1 8 64] [--sweep] [--swiglu | --add]

Per shape, 16 distinct weight sets (together larger than the L2 cache) run in one jit; the figure is the
traced device time of all its kernels divided by 16, and the TB/s of weight bytes that implies.
``xla``: XLA's dots (weight [in, out]). ``xla_t``: XLA's dots on the transposed weight [out, in], the
checkpoint's own layout. ``pallas``: pallas_kernels.gemv at its default tuning, one launch per set (the
weights of a set share the input); with --sweep also every tuning of a grid at batch 1, the best per shape
and the tunings best over all the shapes run. ``--swiglu``: for the gate/up pairs instead, `gemv` plus the
SwiGLU product against the fused `gemv_swiglu` at its tiles for the shape (`tiles.SWIGLU`, else the
default), and with --sweep every tuning of its grid: what `tiles.SWIGLU` is read from. ``--add``: the down
and output projections as the decode step runs them at batch 1 (`gemv_add`, one real row of 16, the next norm's
outputs written), at the shape's tiles and with --sweep over `gemv`'s grid: what `tiles.ADD` is read from.
Writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import jax
import jax.numpy as jnp

from hybrid_jax.profiling import trace_kernels
from pallas_kernels.gemv import gemv, gemv_add, gemv_swiglu
from pallas_kernels.gemv.reference import swiglu_product
from pallas_kernels.gemv.tiles import SWIGLU_MAX_ROWS
from pallas_kernels.tiles import programs

SHAPES = {  # name: (in, (out, ...)) of the decode step's projections at real sizes; a set shares its input
    "0.8b gate+up": (1024, (3584, 3584)), "0.8b down": (3584, (1024,)),
    "0.8b gdn qkv+z+b+a": (1024, (6144, 2048, 16, 16)), "0.8b gdn out": (2048, (1024,)),
    "2b gate+up": (2048, (6144, 6144)), "2b down": (6144, (2048,)),
    "2b gdn qkv+z+b+a": (2048, (4096, 2048, 16, 16)), "2b gdn out": (2048, (2048,)),
    "4b gate+up": (2560, (9216, 9216)), "4b down": (9216, (2560,)),
    "4b gdn qkv+z+b+a": (2560, (8192, 4096, 32, 32)), "4b gdn out": (4096, (2560,)),
    "4b attn q+k+v": (2560, (8192, 1024, 1024)),
    "9b gate+up": (4096, (12288, 12288)), "9b down": (12288, (4096,)),
    "9b gdn qkv+z+b+a": (4096, (8192, 4096, 32, 32)), "9b gdn out": (4096, (4096,)),
    "9b attn q+k+v": (4096, (8192, 1024, 1024)),
    "27b gate+up": (5120, (17408, 17408)), "27b down": (17408, (5120,)),
    "27b gdn qkv+z+b+a": (5120, (10240, 6144, 48, 48)), "27b gdn out": (6144, (5120,)),
}
COPIES = 16
SWEEP = [dict(block_n=bn, block_k=bk, num_stages=st, waves=w)  # waves: K-split target, programs per SM
         for bn, bk, st, w in itertools.product((32, 64, 128), (64, 128), (3, 4), (2, 4, 8))]

ADD_SHAPES = ("down", "out")  # the projections added to the residual stream (`gemv_add`)

SWIGLU_SWEEP = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=st)
                for bn, bk, nw, st in itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3, 4))]


def kernel_keywords(tuning: dict) -> dict:
    """A `SWEEP` entry as the kernels' keywords: its waves as target_programs on this device's SMs."""
    tuning = dict(tuning)
    waves = tuning.pop("waves", None)
    return tuning if waves is None else {**tuning, "target_programs": programs(waves)}


def run(variant: str, **tuning):
    def fn(x, sets):
        outs = []
        for ws in sets:
            if variant == "pallas":
                outs.extend(gemv(x, ws, jnp.float32, impl="kernel", **kernel_keywords(tuning)))
            elif variant == "xla":
                outs.extend(jnp.dot(x, w, preferred_element_type=jnp.float32) for w in ws)
            else:
                outs.extend(jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                            for w in ws)
        return outs
    return jax.jit(fn)


def run_swiglu(fused: bool, **tuning):
    def fn(x, sets):
        if fused:
            return [gemv_swiglu(x, *ws, impl="kernel", **tuning) for ws in sets]
        return [swiglu_product(*gemv(x, ws, impl="kernel")) for ws in sets]
    return jax.jit(fn)


def run_add(**tuning):
    def fn(x, residual, norm_weight, arrivals, ws):
        outs = []
        for w in ws:  # as the decode step runs it: rows padded to the tile's, one real, the next norm's outputs
            out, normed, arrivals = gemv_add(x, w, residual, arrivals, norm=(norm_weight, 1e-6), real_rows=1,
                                             impl="kernel", **kernel_keywords(tuning))
            outs += [out, normed.scaled, normed.sums]
        return outs, arrivals
    return jax.jit(fn)


def add_row(name: str, x, weights, sweep: bool) -> dict:
    """`gemv_add` (batch 1 in 16 rows, the next norm written) at its tuning for the shape, and its sweep."""
    k, n = weights[0].shape
    args = (x, jnp.zeros((x.shape[0], n), jnp.float32), jnp.ones((n,), x.dtype), jnp.zeros((n // 16,), jnp.int32),
            weights)
    row = {"shape": name, "batch": 1, "add_us": device_us(run_add(), *args)}
    if sweep:
        timed = []
        for tuning in SWEEP:
            try:
                timed.append((device_us(run_add(**tuning), *args), tuning))
            except Exception as e:  # noqa: BLE001 - a tuning the compiler rejects is skipped, with the reason shown
                print(f"  {tuning}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        row["sweep"] = [{"us": us, **t} for us, t in timed]
        if timed:
            row["best_us"], row["best"] = min(timed, key=lambda r: r[0])
    row["tbs"] = 2 * k * n / row.get("best_us", row["add_us"]) / 1e6
    return row


def swiglu_row(name: str, batch: int, x, sets, sweep: bool) -> dict:
    """gemv + product against the fused kernel (and its sweep) for one gate/up shape."""
    row = {"shape": name, "batch": batch, "unfused_us": device_us(run_swiglu(False), x, sets),
           "fused_us": device_us(run_swiglu(True), x, sets)}
    if sweep and batch == 1:
        timed = []
        for tuning in SWIGLU_SWEEP:
            try:
                timed.append((device_us(run_swiglu(True, **tuning), x, sets), tuning))
            except Exception as e:  # noqa: BLE001 - a tuning the compiler rejects is skipped, with the reason shown
                print(f"  {tuning}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        row["sweep"] = [{"us": us, **t} for us, t in timed]
        if timed:
            row["best_us"], row["best"] = min(timed, key=lambda r: r[0])
    return row


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


def shape_rows(name: str, d_in: int, widths: tuple[int, ...], args) -> list[dict]:
    """The rows of one projection set: 16 weight copies, each batch (printed as they come)."""
    key = jax.random.key(0)
    sets = [tuple(jax.random.normal(jax.random.fold_in(key, 100 * i + j), (d_in, n), jnp.bfloat16)
                  for j, n in enumerate(widths)) for i in range(COPIES)]
    if args.add:
        x = jnp.pad(jax.random.normal(key, (1, d_in), jnp.bfloat16), ((0, 15), (0, 0)))  # [16, K]: one real row
        rows = [add_row(name, x, [ws[0] for ws in sets], args.sweep)]
    elif args.swiglu:  # the dispatch never fuses beyond SWIGLU_MAX_ROWS
        rows = [swiglu_row(name, batch, jax.random.normal(key, (batch, d_in), jnp.bfloat16), sets, args.sweep)
                for batch in args.batch if batch <= SWIGLU_MAX_ROWS]
    else:
        transposed = [tuple(w.T.copy() for w in ws) for ws in sets]
        nbytes = 2 * d_in * sum(widths)
        rows = []
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
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sweep", action="store_true", help="also search the kernel's tuning at batch 1")
    parser.add_argument("--shapes", nargs="+", default=None, help="only the shapes whose name contains one of these")
    parser.add_argument("--swiglu", action="store_true", help="the gate/up pairs: fused SwiGLU kernel vs unfused")
    parser.add_argument("--add", action="store_true", help="the down / out projections as `gemv_add` runs them")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name, (d_in, widths) in SHAPES.items():
        if args.shapes and not any(part in name for part in args.shapes):
            continue
        if args.swiglu and "gate+up" not in name or args.add and not any(p in name for p in ADD_SHAPES):
            continue
        rows += shape_rows(name, d_in, widths, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "sweep": SWIGLU_SWEEP if args.swiglu else SWEEP,
                       "rows": rows}, f, indent=1)
    if args.add:
        print(f"{'shape':20} {'gemv_add us':>11} {'best us':>8} {'TB/s':>5}  best tuning")
        for r in rows:
            print(f"{r['shape']:20} {r['add_us']:11.1f} {r.get('best_us', r['add_us']):8.1f} {r['tbs']:5.2f}  "
                  f"{r.get('best', '')}")
        return
    if args.swiglu:
        print(f"{'shape':20} {'B':>3} {'gemv+product us':>15} {'fused us':>9} {'best us':>8}  best tuning")
        for r in rows:
            best = f"{r['best_us']:8.1f}  {r['best']}" if "best" in r else ""
            print(f"{r['shape']:20} {r['batch']:3d} {r['unfused_us']:15.1f} {r['fused_us']:9.1f} {best}")
        return
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
