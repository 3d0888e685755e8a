"""The engine's construction over a model's shapes, alone or beside the weights' load (as `LLM` overlaps them),
with the GIL's stalls on a 1 ms sleeper and the main thread's stacks on a 2 ms sampler.
`python engine_beside_load.py alone|beside CHECKPOINT_DIR|SIZE`; the tree on PYTHONPATH is measured."""

import sys
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import jax

from hybrid_jax.engine.cache import device_memory_limit
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.engine import Engine
from hybrid_jax.engine.llm import model_source

mode, model = sys.argv[1], sys.argv[2]
source = model_source(model, "bfloat16", 0, None)
tokenizer = source.load_tokenizer()
config = EngineConfig(max_batch=64, max_model_len=4096, prefill_chunk=1024, decode_steps=4)
samples, stalls = [], []


def sample(stop: threading.Event, thread_id: int) -> None:
    while not stop.is_set():
        frame = sys._current_frames().get(thread_id)
        if frame is not None:
            samples.append(traceback.extract_stack(frame)[-6:])
        time.sleep(0.002)


def sleeper(stop: threading.Event) -> None:
    while not stop.is_set():
        begin = time.perf_counter()
        time.sleep(0.001)
        if (late := time.perf_counter() - begin - 0.001) > 0.003:
            stalls.append(late)


jax.devices()
begin = time.perf_counter()
device_memory_limit()
print(f"memory_stats alone {time.perf_counter() - begin:.4f} s")
with ThreadPoolExecutor(1) as pool:
    load_begin = time.perf_counter()
    loading = pool.submit(source.load) if mode == "beside" else None
    stop = threading.Event()
    threads = [threading.Thread(target=sample, args=(stop, threading.get_ident())),
               threading.Thread(target=sleeper, args=(stop,))]
    for t in threads:
        t.start()
    begin = time.perf_counter()
    Engine(source.abstract, config, valid_vocab=source.abstract.config.vocab_size, tokenizer=tokenizer)
    built = time.perf_counter() - begin
    stop.set()
    for t in threads:
        t.join()
    print(f"GIL stalls > 3 ms during Engine(): {len(stalls)}, {sum(stalls):.3f} s, max {max(stalls, default=0):.3f} s")
    if loading is not None:
        loading.result()
        print(f"load {time.perf_counter() - load_begin:.2f} s")
print(f"{mode} {model}: Engine() {built:.3f} s")
where = Counter()
for stack in samples:
    own = [f for f in stack if "hybrid_jax" in f.filename] or stack[-1:]
    where[f"{own[-1].filename.split('/')[-1]}:{own[-1].lineno} {own[-1].name}"] += 1
for place, n in where.most_common(8):
    print(f"{n * 2:6d} ms  {place}")
