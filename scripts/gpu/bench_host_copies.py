"""Device <-> pinned host copies at the host tier's shapes: one snapshot (every GDN layer's state and conv rows)
and one block's KV pages (every attention layer's), each way, by the ways JAX offers. Prints a table, writes JSON.
  python3 scripts/gpu/bench_host_copies.py --size 9b --calls 32 --out host_copies.json"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

SIZES = {  # GDN layers, value heads, key heads, head dim, attention layers, KV heads, attention head dim
    "0.8b": (18, 16, 16, 128, 6, 2, 256),
    "9b": (24, 32, 16, 128, 8, 4, 256),
    "27b": (48, 48, 16, 128, 16, 4, 256),
}


def trees(size: str, block_tokens: int, pool_rows: int):
    layers, hv, hk, d, attn, hkv, ahd = SIZES[size]
    conv_dim = 2 * hk * d + hv * d
    snapshot = [{"state": jax.ShapeDtypeStruct((pool_rows, hv, d, d), jnp.float32),
                 "conv": jax.ShapeDtypeStruct((pool_rows, 3, conv_dim), jnp.bfloat16)} for _ in range(layers)]
    pages = [{"k": jax.ShapeDtypeStruct((pool_rows * block_tokens, hkv, ahd), jnp.bfloat16),
              "v": jax.ShapeDtypeStruct((pool_rows * block_tokens, hkv, ahd), jnp.bfloat16)} for _ in range(attn)]
    return {"snapshot": snapshot, "block": pages}


def timed(fn, calls: int) -> float:
    out = fn(0)
    jax.block_until_ready(out)
    start = time.perf_counter()
    outs = [fn(i) for i in range(calls)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) / calls


def measure(name: str, shapes, row_rows: int, pool_rows: int, calls: int, device) -> list[dict]:
    """Each way's time per copy of ``row_rows`` leading rows of every leaf of ``shapes`` (a pool of
    ``pool_rows`` such copies)."""
    mesh = jax.sharding.Mesh(np.array([device]), ("one",))
    on_device = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    pinned = on_device.with_memory_kind("pinned_host")
    pool = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes)
    nbytes = sum(int(np.prod(s.shape[1:])) * s.dtype.itemsize * row_rows for s in jax.tree.leaves(shapes))

    def take(p, i):
        return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i * row_rows, row_rows), p)

    def put(p, i, r):
        return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice_in_dim(
            a, jax.device_put(b, on_device), i * row_rows, 0), p, r)

    read_jit = jax.jit(lambda p, i: jax.device_put(take(p, i), pinned), out_shardings=pinned)
    read_plain = jax.jit(take)
    write_jit = jax.jit(put, donate_argnums=0, out_shardings=on_device)
    host_rows = read_jit(pool, 0)
    state = {"pool": pool}

    def write(i, rows=None):  # returns a fresh array each call (the pool itself is donated by the next)
        state["pool"] = write_jit(state["pool"], i % pool_rows, host_rows if rows is None else rows)
        return jax.tree.leaves(state["pool"])[0][:1]

    ways = {
        "out: jit, output in pinned_host": lambda i: read_jit(state["pool"], i % pool_rows),
        "out: jit slice, then device_put(pinned)": lambda i: jax.device_put(read_plain(state["pool"], i % pool_rows),
                                                                            pinned),
        "out: jit slice on device only (no copy)": lambda i: read_plain(state["pool"], i % pool_rows),
        "in: jit, input in pinned_host": write,
        "in: device_put(device), then jit": lambda i: write(i, jax.device_put(host_rows, on_device)),
    }
    rows = []
    for way, fn in ways.items():
        seconds = timed(fn, calls)
        rows.append({"tree": name, "way": way, "bytes": nbytes, "ms_per_call": seconds * 1e3,
                     "gb_s": nbytes / seconds / 1e9, "leaves": len(jax.tree.leaves(shapes))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="9b", choices=SIZES)
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--pool-rows", type=int, default=64)
    parser.add_argument("--out", default="host_copies.json")
    args = parser.parse_args()
    device = jax.devices()[0]
    rows = []
    for name, shapes in trees(args.size, 64, args.pool_rows).items():
        rows += measure(name, shapes, 64 if name == "block" else 1, args.pool_rows, args.calls, device)
    print(f"\n{'tree':<9} {'way':<44} {'MiB':>7} {'ms/call':>8} {'GB/s':>7}")
    for r in rows:
        print(f"{r['tree']:<9} {r['way']:<44} {r['bytes'] / 2**20:>7.1f} {r['ms_per_call']:>8.3f} {r['gb_s']:>7.1f}")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "device": device.device_kind, "jax": jax.__version__, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
