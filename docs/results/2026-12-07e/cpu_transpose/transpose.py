"""The host's transpose of a bf16 [12288, 4096] matrix (a 9B MLP projection): best of 3 on one thread, then 8 of
them on 2 threads, as bf16 and as its uint16 view."""

import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

x = np.random.rand(12288, 4096).astype(ml_dtypes.bfloat16)


def best(f, rounds=3):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


print("bf16 .T copy", best(lambda: np.ascontiguousarray(x.T)))
print("u16 .T copy", best(lambda: np.ascontiguousarray(x.view(np.uint16).T)))
with ThreadPoolExecutor(2) as pool:
    print("bf16 x8 2 threads", best(lambda: list(pool.map(lambda a: np.ascontiguousarray(a.T), [x] * 8)), 1))
    print("u16 x8 2 threads", best(lambda: list(pool.map(lambda a: np.ascontiguousarray(a.view(np.uint16).T),
                                                         [x] * 8)), 1))
