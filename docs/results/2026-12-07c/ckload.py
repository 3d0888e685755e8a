"""Checkpoint load timings. `write SIZE DIR`: a random checkpoint; `time VARIANT DIR`: one load, in a fresh process.
Variants: current (load_pretrained of the tree on PYTHONPATH; current_tN: with DEVICE_TRANSFORM_BYTES = N MiB),
read (get_tensor only), put (device_put of the tensors get_tensor returns), mmap_put (device_put of mapped views),
device_t / device_t8 (get_tensor, transposes on the device, 1 / 8 threads), mmap_t / mmap_t8 (mapped views,
transposes on the device), mmap_h / mmap_h4 / mmap_h8 (mapped views, transposes on the host, 1 / 4 / 8 threads).
CC=DIR turns JAX's compilation cache on."""

import json
import mmap
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from hybrid_jax import weights
from hybrid_jax.config import Qwen35Config
from hybrid_jax.loader import load_pretrained, random_model

DEVICE_T = {
    weights.LINEAR: lambda x: x.T,
    weights.CONV: lambda x: x[:, 0, :].T,
}


def entries(path):
    for file in weights.checkpoint_files(path):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118
                if weights.SKIPPED.match(name):
                    continue
                yield f, name


def mmap_tensors(file):
    """name -> zero-copy numpy view of each tensor of a safetensors file."""
    import ml_dtypes

    dtypes = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16}
    with open(file, "rb") as fh:
        hlen = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(hlen))
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        dt = np.dtype(dtypes[v["dtype"]])
        out[k] = np.frombuffer(mm, dtype=dt, count=(b - a) // dt.itemsize, offset=8 + hlen + a).reshape(v["shape"])
    return out


class Views:
    def __init__(self, file):
        self.t = mmap_tensors(file)

    def keys(self):
        return list(self.t)

    def get_tensor(self, name):
        return self.t[name]


def load_device_t(path, threads, use_mmap=False, host_t=False):
    config = Qwen35Config.from_pretrained(path)
    model = weights.abstract_model(config, jnp.bfloat16)
    params = weights._flat_params(model)
    handles = {}
    for file in weights.checkpoint_files(path):
        handles[file] = Views(file) if use_mmap else safe_open(str(file), framework="numpy")
    jobs = []
    for f in handles.values():
        for name in f.keys():  # noqa: SIM118
            if weights.SKIPPED.match(name):
                continue
            param_path, transform = weights.match_name(name)
            if param_path.startswith("lm_head.") and config.tie_word_embeddings:
                continue
            jobs.append((f, name, params[param_path], transform))

    def place(job):
        f, name, var, transform = job
        if host_t:
            x = jax.device_put(transform.to_param(f.get_tensor(name)))
        else:
            x = jax.device_put(f.get_tensor(name))
            x = DEVICE_T.get(transform, lambda v: v)(x)
        target = jnp.float32 if transform.keep_fp32 else var.dtype
        return var, x.astype(target)

    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            done = list(pool.map(place, jobs))
    else:
        done = [place(j) for j in jobs]
    for var, x in done:
        var.set_value(x)
    jax.block_until_ready([x for _, x in done])
    return model


def main():
    mode = sys.argv[1]
    if mode == "write":
        size, path = sys.argv[2], sys.argv[3]
        t = time.perf_counter()
        weights.save_pretrained(random_model(size, "bfloat16"), path)
        print(f"wrote {path} in {time.perf_counter() - t:.1f} s")
        return
    variant, path = sys.argv[2], __import__("pathlib").Path(sys.argv[3])
    import os
    if os.environ.get("CC"):
        from hybrid_jax.compilation_cache import enable_compilation_cache
        enable_compilation_cache(os.environ["CC"])
    jax.device_put(np.zeros(1, np.uint8)).block_until_ready()  # the client and the arena, outside the timing
    t = time.perf_counter()
    if variant.startswith("current_t"):  # current, with DEVICE_TRANSFORM_BYTES = N MiB
        weights.DEVICE_TRANSFORM_BYTES = int(variant[len("current_t"):]) << 20
        variant = "current"
    if variant == "current":
        model = load_pretrained(path)
        jax.block_until_ready(jax.tree.leaves(jax.tree.map(lambda v: v, __import__("flax").nnx.state(model))))
    elif variant == "read":
        n = sum(f.get_tensor(name).nbytes for f, name in entries(path))
        print(f"  {n / 1e9:.2f} GB")
    elif variant == "put":
        xs = [jax.device_put(f.get_tensor(name)) for f, name in entries(path)]
        jax.block_until_ready(xs)
    elif variant == "device_t":
        load_device_t(path, 1)
    elif variant == "device_t8":
        load_device_t(path, 8)
    elif variant == "mmap_t":
        load_device_t(path, 1, True)
    elif variant == "mmap_t8":
        load_device_t(path, 8, True)
    elif variant == "mmap_h":
        load_device_t(path, 1, True, True)
    elif variant == "mmap_h8":
        load_device_t(path, 8, True, True)
    elif variant == "mmap_h4":
        load_device_t(path, 4, True, True)
    elif variant == "mmap_put":
        xs = [jax.device_put(x) for file in weights.checkpoint_files(path) for x in mmap_tensors(file).values()]
        jax.block_until_ready(xs)
    print(f"{variant:10s} {time.perf_counter() - t:7.2f} s")


if __name__ == "__main__":
    main()
