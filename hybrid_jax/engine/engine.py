"""The engine: one thread owns the device and runs FCFS continuous batching over the hybrid cache.

Requests are admitted when their whole lifetime fits (a state slot plus KV pages for prompt + max_tokens),
prefilled in chunks under a per-step token budget, then decoded together in fixed-shape batch buckets.
Every program (a step at one shape bucket) is loaded from the executable store or compiled during a logged
warm-up at start, so nothing compiles while serving; with ``background_compile`` only the programs that can
serve any request are built before ``start`` returns and the rest follow in a background thread, the engine
running a larger bucket or a plainer variant until each is built.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hybrid_jax.engine.cache import (
    BlockAllocator,
    allocate_pools,
    page_table_row,
    pages_for,
    plan_layout,
    pool_shapes,
)
from hybrid_jax.engine.programs import ExecutableStore, Programs, ProgramSpec
from hybrid_jax.engine.sampler import Sampled, SamplingRows
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.engine.steps import (
    DecodeBatch,
    Kernels,
    PrefillBatch,
    decode_step,
    multi_decode_step,
    prefill_step,
)
from hybrid_jax.layers.linear import few_row_kernel
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.sharding import make_mesh, pool_specs, shard_model, stored_kv_heads

log = logging.getLogger("hybrid_jax.engine")


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit; try again later (HTTP 503)."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # concurrent requests (state slots)
    max_model_len: int = 4096  # prompt + output tokens per request
    page_size: int = 16
    prefill_chunk: int = 256  # token budget of one prefill step
    max_prefill_seqs: int = 4  # sequences packed into one prefill step
    memory_utilization: float = 0.9  # share of free device memory for slots + KV pages
    num_pages: int | None = None  # KV pages (incl. the null page); None: sized from memory
    max_waiting: int = 4096  # waiting requests before submit raises QueueFullError
    tensor_parallel_size: int = 1  # shards of the model over the first devices
    prefill_sizes: tuple[int, ...] | None = None  # token buckets of the prefill step (default: powers of two)
    decode_steps: int = 1  # decode steps per greedy call when nothing waits for prefill (hides the host round
    # trip); a request's last tokens, fewer than that, take a step per call
    decode_sizes: tuple[int, ...] | None = None  # batch buckets of the decode step (default: powers of two)
    compile_threads: int = 8  # warm-up programs compiled at once (tracing holds the GIL; XLA's compile does
    # not): fewer bounds the autotuner's scratch memory and the warm-up's CPU load
    background_compile: bool = False  # build only the programs that serve any request before start returns (the
    # largest decode and prefill buckets), the rest in a background thread after it

    def __post_init__(self):
        if self.decode_sizes and not all(1 <= s <= self.max_batch for s in self.decode_sizes):
            raise ValueError(f"decode_sizes: each must be in [1, max_batch={self.max_batch}], got {self.decode_sizes}")
        if self.compile_threads < 1:
            raise ValueError(f"compile_threads: must be at least 1, got {self.compile_threads}")

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Batch sizes a decode program is compiled for; a batch runs in the smallest that holds it."""
        if self.decode_sizes:
            return tuple(sorted({*self.decode_sizes, self.max_batch}))
        sizes = [1 << i for i in range(self.max_batch.bit_length()) if 1 << i < self.max_batch]
        return (*sizes, self.max_batch)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        if self.prefill_sizes:
            return tuple(sorted(self.prefill_sizes))
        sizes = [s for s in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if s < self.prefill_chunk]
        return (*sizes, self.prefill_chunk)


class TokenEvent(NamedTuple):
    """One generated token (or the end of a request) as the engine reports it."""

    token_id: int | None  # None on a final event without a new token (cancelled, error)
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None  # (id, logprob) alternatives when requested
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the last event
    time: float


class DecodeCall(NamedTuple):
    """A decode call queued on the device whose samples the host has not read yet."""

    requests: list[Request]  # rows 0.. of the batch
    variant: tuple[bool, int]  # (greedy_only, steps per call)
    sampled: Sampled  # device arrays with a leading [steps] axis
    next_batch: DecodeBatch  # on the device: the inputs of a call chained after this one (same requests)

    @property
    def steps(self) -> int:
        return self.variant[1]


class FirstTokens(NamedTuple):
    """Prefill's samples for the requests whose prompts it finished, still on the device: the first decode call
    over them is queued before the host reads them."""

    requests: list[Request]
    rows: list[int]  # each request's row of ``sampled``
    sampled: Sampled  # device arrays [max_prefill_seqs]


def _is_abstract(model: nnx.Module) -> bool:
    return any(isinstance(w, jax.ShapeDtypeStruct) for w in jax.tree.leaves(nnx.state(model)))


def take_first_tokens(tokens: jax.Array, first_tokens: jax.Array, source: jax.Array) -> jax.Array:
    """``tokens`` [B] with each row whose ``source`` [B] is >= 0 replaced by ``first_tokens`` [S] at that index."""
    return jnp.where(source >= 0, first_tokens[jnp.maximum(source, 0)].astype(tokens.dtype), tokens)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    output_ids: list[int] = field(default_factory=list)
    slot: int = 0
    pages: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    cancelled: bool = False
    finished: bool = False

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


class RequestHandle:
    """What ``submit`` returns: iterate to receive TokenEvents; ``cancel`` to stop early and free the cache."""

    def __init__(self, request: Request, engine: Engine):
        self._request, self._engine = request, engine
        self.request_id = request.request_id

    def __iter__(self):
        while True:
            event = self._request.events.get()
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self) -> None:
        self._engine.cancel(self._request)


class Engine:
    """Owns the model, the cache pools and the engine thread."""

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig = EngineConfig(), *,
                 eos_token_ids: tuple[int, ...] = (), valid_vocab: int | None = None,
                 executable_dir: str | os.PathLike | None = None):
        """``executable_dir``: keep the compiled programs there (see `programs.ExecutableStore`). ``model``
        may be abstract (shape-only parameters, as `weights.abstract_model` makes): its programs can be built
        (`prepare_programs`) while the weights load, and `attach` gives it the loaded model before `start`."""
        self.model, self.config = model, config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.valid_vocab = valid_vocab or model.config.vocab_size
        vocab = model.config.vocab_size
        tp = config.tensor_parallel_size
        self.mesh = make_mesh(tp) if tp > 1 else None
        self.weights_loaded = not _is_abstract(model)
        if self.mesh is not None:
            if not self.weights_loaded:
                raise ValueError("tensor_parallel_size: an engine over a mesh needs its weights loaded first")
            shard_model(model, self.mesh)
        # The steps take the weights as one flat tuple of arrays: jit flattens a tuple in C++, an nnx.State
        # in Python node by node (~10 us a weight a call: DESIGN).
        self._graphdef, weights = nnx.split(model)
        leaves, self._weights_def = jax.tree.flatten(weights)
        self._weights = tuple(leaves)
        unloaded = 0 if self.weights_loaded else sum(w.size * w.dtype.itemsize for w in leaves)
        self.layout = plan_layout(model.config, model.dtype, vocab, max_batch=config.max_batch,
                                  max_model_len=config.max_model_len, page_size=config.page_size,
                                  memory_utilization=config.memory_utilization, num_pages=config.num_pages, tp=tp,
                                  reserved_bytes=unloaded)
        shapes = pool_shapes(model.config, self.layout, model.dtype, vocab, stored_kv_heads(model.config, tp))
        self._pool_shardings = self._batch_sharding = None
        if self.mesh is not None:
            self._batch_sharding = NamedSharding(self.mesh, PartitionSpec())
            self._pool_shardings = jax.tree.map(lambda p: NamedSharding(self.mesh, p), pool_specs(model.config),
                                                is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.pools = allocate_pools(shapes, self._pool_shardings)
        self.pages = BlockAllocator(self.layout.num_pages)
        self.slots = BlockAllocator(self.layout.num_slots)
        step_kw = dict(kernels=Kernels(model, self.mesh), page_size=self.layout.page_size,
                       valid_vocab=self.valid_vocab)
        jit_kw = dict(donate_argnums=1)
        # A decode call's batch is donated too: the next call's batch, returned in its buffers, costs no copies.
        decode_kw = dict(donate_argnums=(1, 2))
        if self.mesh is not None:
            # Every program's inputs and outputs pinned: the batch and the samples replicated, the pools as planned,
            # so a chained decode call's batch (the previous call's output) has the sharding the warm-up compiled
            # for (and decode_batch places the host's batch the same way: the same input type).
            replicated = self._batch_sharding
            weight_shardings = tuple(w.sharding for w in self._weights)
            jit_kw = dict(jit_kw, in_shardings=(weight_shardings, self._pool_shardings, replicated),
                          out_shardings=(replicated, self._pool_shardings))
            decode_kw = dict(jit_kw, donate_argnums=(1, 2),
                             out_shardings=(replicated, replicated, self._pool_shardings))
        self._prefill = jax.jit(partial(self._run, prefill_step, **step_kw), **jit_kw)
        # Decode variants by (greedy_only, steps per call); several steps per call only for greedy batches.
        self._decode = {(greedy, 1): jax.jit(partial(self._run_decode_step, decode_step, greedy_only=greedy,
                                                     **step_kw), **decode_kw) for greedy in (False, True)}
        # Under a mesh, one step per call (DESIGN's alternatives: the multi-step loop measured slow there).
        self.decode_steps = config.decode_steps if self.mesh is None else 1
        if self.decode_steps > 1:
            self._decode[True, self.decode_steps] = jax.jit(
                partial(self._run_decode_step, multi_decode_step, num_steps=self.decode_steps, greedy_only=True,
                        **step_kw), **decode_kw)
        self._inflight: DecodeCall | None = None
        self._first: FirstTokens | None = None
        self._take_first_tokens = jax.jit(take_first_tokens)
        self.devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        store = ExecutableStore(executable_dir, self.devices) if executable_dir is not None else None
        self.programs = Programs(self._program_specs(), store, self._program_context())
        self._prepared = False  # the programs start needs are built
        self._load_seconds = 0.0  # spent loading them from the store
        self._warm = False  # after warmup(): a missing program is never compiled on the engine thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._ids = itertools.count()
        self._seeds = np.random.default_rng()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}

    def _run_decode_step(self, step, weights: tuple[jax.Array, ...], pools, batch: DecodeBatch, **kw):
        """A decode step whose samples carry a leading [steps] axis, plus the inputs of the next call over the
        same requests (its tokens the last samples, positions and sampling steps advanced), made on the device:
        a chained call needs no host-side array op and no host-to-device copy."""
        sampled, pools = self._run(step, weights, pools, batch, **kw)
        if sampled.tokens.ndim == 1:
            sampled = jax.tree.map(lambda x: x[None], sampled)
        real = batch.slot_ids > 0  # [B] padding rows stay as the host pads them
        advance = lambda x: jnp.where(real, x + sampled.tokens.shape[0], x)
        next_batch = batch._replace(tokens=jnp.where(real, sampled.tokens[-1], 0), positions=advance(batch.positions),
                                    rows=batch.rows._replace(step=advance(batch.rows.step)))
        return sampled, next_batch, pools

    def _run(self, step, weights: tuple[jax.Array, ...], pools, batch, **kw):
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._weights_def, weights))
        with few_row_kernel(True, self.mesh):
            return step(model, pools, batch, **kw)

    # -- public API ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        """Queue a request; raises ValueError if it can never fit, QueueFullError when the queue is full."""
        params.validate()
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.model.config.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the model's context of {self.config.max_model_len} tokens")
        if pages_for(total, self.layout.page_size) > self.pages.capacity:
            raise ValueError(f"max_tokens: the request needs more KV pages than the cache has ({self.pages.capacity})")
        if len(self._waiting) + self._inbox.qsize() >= self.config.max_waiting:
            raise QueueFullError(f"{self.config.max_waiting} requests are already waiting")
        # The step reads seeds as uint32: any integer seed maps into that range (negative or > 2**32 too).
        seed = params.seed % 2**32 if params.seed is not None else int(self._seeds.integers(0, 2**31))
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, seed)
        self._inbox.put(request)
        return RequestHandle(request, self)

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        self._inbox.put(None)  # wake the loop

    def start(self, warmup: bool = True) -> Engine:
        if not self.weights_loaded:
            raise RuntimeError("start: the engine's model is abstract; attach the loaded model first")
        if warmup:
            self.warmup()
        self._thread = threading.Thread(target=self._loop, name="hybrid-jax-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread:
            self._thread.join(timeout=30)

    def stats(self) -> dict:
        return {"running": len(self._prefilling) + len(self._decoding), "waiting": len(self._waiting),
                "pages_used": self.pages.num_used, "pages_total": self.pages.capacity,
                "slots_used": self.slots.num_used, "slots_total": self.slots.capacity,
                "programs_pending": self.programs.pending, **self.counters}

    def _program_specs(self) -> dict[tuple, ProgramSpec]:
        """Every program the engine can run, keyed ("decode", greedy_only, steps, B) | ("prefill", T) |
        ("first_tokens", B), essential ones first: the general decode at the largest batch and the largest
        prefill serve any request; the rest, smallest buckets first, only make some faster."""
        # Without a mesh the pools are uncommitted arrays: a sharding here would make each call's signature differ
        # from the compiled one's.
        placed = lambda a: a.sharding if self.mesh is not None else None
        shape_of = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed(a))
        pools = jax.tree.map(shape_of, self.pools)
        weights = tuple(map(shape_of, self._weights))
        largest_decode, largest_prefill = self.config.decode_buckets[-1], self.config.prefill_buckets[-1]
        rows = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self._batch_sharding)  # placed as a batch
        specs = {}
        for size in reversed(self.config.decode_buckets):
            for (greedy, steps), fn in sorted(self._decode.items()):
                specs["decode", greedy, steps, size] = ProgramSpec(
                    f"decode B={size} (greedy only: {greedy}, {steps} steps per call)", fn,
                    (weights, pools, self.decode_batch([], size)),
                    essential=size == largest_decode and not greedy)
            specs["first_tokens", size] = ProgramSpec(
                f"first tokens B={size}", self._take_first_tokens,
                (rows(size), rows(self.config.max_prefill_seqs), rows(size)),
                essential=size == largest_decode)
        for size in reversed(self.config.prefill_buckets):
            specs["prefill", size] = ProgramSpec(f"prefill T={size}", self._prefill,
                                                 (weights, pools, self.prefill_batch([], size)),
                                                 essential=size == largest_prefill)
        # Essential first; then the smallest buckets (what a lone request runs), multi-step decode first.
        order = lambda key: (not specs[key].essential, key[-1], key[0] != "decode", -key[2] if key[0] == "decode"
                             else 0)
        return {key: specs[key] for key in sorted(specs, key=order)}

    def _program_context(self) -> dict:
        """What decides the programs besides their arguments' shapes (the executable store's key)."""
        settings = {k: v for k, v in asdict(self.config).items()
                    if k not in ("max_waiting", "compile_threads", "background_compile", "memory_utilization")}
        return {"model": repr(self.model.config), "dtype": str(self.model.dtype), "valid_vocab": self.valid_vocab,
                "engine": settings, "decode_steps": self.decode_steps, "layout": repr(self.layout)}

    def warmup(self) -> None:
        """Build the programs start needs (every one, or only the essential ones with ``background_compile``):
        each loaded from the executable store or compiled; then run each once on a padding batch (null slot and
        page), so nothing compiles while serving. On the CPU the runs are skipped; on a GPU a program's first
        run records its CUDA graphs. With ``background_compile`` the rest are loaded or compiled after.

        The (still empty) pools are released while compiling: XLA's GEMM autotuner allocates operand-sized
        scratch per program compiled (2.5 GB for the 27B lm_head), which the pools' share of memory leaves no
        room for when several programs compile at once."""
        self.prepare_programs()
        if not self.weights_loaded:
            raise RuntimeError("warmup: the engine's model is abstract; attach the loaded model first")
        programs, threads, wanted = self.programs, self._compile_threads, self._start_programs
        if self.devices[0].platform != "cpu":  # the CPU records nothing on a first run
            start = time.perf_counter()
            for key in wanted:
                compiled, args = programs.get(key), programs.specs[key].args
                if key[0] == "first_tokens":
                    compiled(np.zeros(key[1], np.int32), np.zeros(self.config.max_prefill_seqs, np.int32),
                             np.full(key[1], -1, np.int32))
                else:
                    _, *_, self.pools = compiled(self._weights, self.pools, args[2])
            jax.block_until_ready(self.pools)
            log.info("start-up: %d programs run once in %.1f s", len(wanted), time.perf_counter() - start)
        self._warm = True
        # In the background a quarter of the warm-up's threads: each compile holds XLA's autotuner scratch beside
        # the pools.
        if self.config.background_compile and programs.compile_rest(max(1, threads // 4)) is not None:
            log.info("start-up: %d programs left to load or compile in the background (a larger bucket serves "
                     "meanwhile)", programs.pending)

    @property
    def _compile_threads(self) -> int:
        return max(1, min(os.cpu_count() or 1, self.config.compile_threads))

    @property
    def _start_programs(self) -> list[tuple]:
        """The programs built before start returns: every one, or the essential ones with background_compile."""
        return [k for k, spec in self.programs.specs.items() if spec.essential or not self.config.background_compile]

    def attach(self, model: Qwen35ForCausalLM) -> None:
        """Give an engine built over an abstract model the loaded one (same config, shapes and dtypes)."""
        _, weights = nnx.split(model)
        leaves, tree = jax.tree.flatten(weights)
        if tree != self._weights_def or any(a.shape != b.shape or a.dtype != b.dtype
                                            for a, b in zip(leaves, self._weights, strict=True)):
            raise ValueError("model: its parameters differ from the engine's (another config or dtype)")
        self.model, self._weights, self.weights_loaded = model, tuple(leaves), True

    def load_stored_programs(self) -> bool:
        """Load the programs start needs that the executable store holds; True when none is missing."""
        wanted, start = self._start_programs, time.perf_counter()
        self.programs.load_stored(self._compile_threads, wanted)
        self._load_seconds += time.perf_counter() - start
        return all(self.programs.get(k) is not None for k in wanted)

    def release(self) -> None:
        """Free the pools of an engine that will not start (its device memory goes back at once)."""
        self.pools = None

    def prepare_programs(self) -> None:
        """Load or compile the programs start needs; only their shapes are read, so this may run while the
        weights load (an abstract model)."""
        if self._prepared:
            return
        programs, threads, wanted = self.programs, self._compile_threads, self._start_programs
        self.load_stored_programs()
        log.info("start-up: %d of %d programs loaded from the executable cache in %.1f s", programs.counts["loaded"],
                 len(wanted), self._load_seconds)
        missing = [k for k in wanted if programs.get(k) is None]
        if missing:
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.pools)
            self.pools = None
            seconds = programs.compile_missing(missing, threads, "compiling programs")
            log.info("start-up: %d programs compiled in %.1f s, %d at a time", len(missing), seconds, threads)
            self.pools = allocate_pools(shapes, self._pool_shardings)
        self._prepared = True

    def _program(self, key: tuple):
        """The compiled program for ``key``, or None while it is not built (after the warm-up); before a warm-up
        (``start(warmup=False)``) a missing program is built on first use."""
        compiled = self.programs.get(key)
        if compiled is None and not self._warm:
            compiled = self.programs.build(key)
        return compiled

    def _decode_program(self, variant: tuple[bool, int], n: int, size: int | None = None):
        """(variant, bucket, program) for a decode call over ``n`` rows (at bucket ``size`` if given): the
        smallest built bucket, with ``variant`` or, while it is not built, a plainer one that gives the same
        tokens (one step per call; the general sampler); None if none is built at ``size``."""
        greedy, steps = variant
        variants = list(dict.fromkeys([variant, (greedy, 1), (False, 1)]))
        buckets = [size] if size is not None else [b for b in self.config.decode_buckets if b >= n]
        for bucket in buckets:
            for v in variants:
                compiled = self._program(("decode", *v, bucket))
                if compiled is not None:
                    return v, bucket, compiled
        return None

    # -- the engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not (self._waiting or self._prefilling or self._decoding)
            self._drain_inbox(block=idle)
            self._reap_cancelled()
            self._admit()
            try:
                if self._prefilling:
                    self._run_prefill()
                if self._decoding or self._inflight:
                    self._run_decode()
            except Exception as e:  # a failed step ends its requests, never the server
                log.exception("engine step failed")
                self._inflight = self._first = None
                for r in self._prefilling + self._decoding:
                    self._finish(r, None, "error", error=e)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _reap_cancelled(self) -> None:
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            self._finish(r, None, "abort")
        for r in [r for r in self._prefilling + self._decoding if r.cancelled]:
            self._finish(r, None, "abort")

    def _admit(self) -> None:
        """FCFS: admit waiting requests while a slot and pages for their whole lifetime are free."""
        while self._waiting:
            r = self._waiting[0]
            need = pages_for(r.total_len, self.layout.page_size)
            if self.slots.num_free == 0 or self.pages.num_free < need:
                return
            self._waiting.popleft()
            r.slot = self.slots.allocate(1)[0]
            r.pages = self.pages.allocate(need)
            self._prefilling.append(r)

    def _finish(self, r: Request, token: int | None, reason: str, error: Exception | None = None) -> None:
        if r.finished:
            return
        r.finished = True
        for group in (self._prefilling, self._decoding):
            if r in group:
                group.remove(r)
        if r.slot:
            self.slots.free([r.slot])
        self.pages.free(r.pages)
        r.slot, r.pages = 0, []
        self.counters["requests_finished"] += 1
        if error is not None:
            log.error("request %s failed: %s", r.request_id, error)
        if token is None:
            r.events.put(TokenEvent(None, None, None, reason, time.monotonic()))

    def _emit(self, r: Request, token: int, logprob: float, tops) -> None:
        """Record a sampled token and decide whether the request is done."""
        r.output_ids.append(token)
        self.counters["generation_tokens"] += 1
        p = r.params
        reason = None
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif len(r.output_ids) >= p.max_tokens:
            reason = "length"
        top = None
        if p.logprobs:
            top = [(int(i), float(v)) for i, v in zip(tops[0][: p.logprobs], tops[1][: p.logprobs], strict=True)]
        r.events.put(TokenEvent(token, float(logprob), top, reason, time.monotonic()))
        if reason is not None:
            self._finish(r, token, reason)

    # -- steps ---------------------------------------------------------------------------------------
    def _sampling_rows(self, requests: list[Request], size: int,
                       ahead: np.ndarray | None = None) -> tuple[SamplingRows, jax.Array]:
        """The rows' sampling settings; ``ahead`` [len(requests)]: tokens each has sampled that the host has not
        read yet."""
        cols = {name: np.zeros(size, np.float32) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                                               "frequency_penalty", "repetition_penalty")}
        cols["top_p"][:] = 1.0
        cols["repetition_penalty"][:] = 1.0
        top_k = np.zeros(size, np.int32)
        seed = np.zeros(size, np.uint32)
        step = np.zeros(size, np.int32)
        for i, r in enumerate(requests):
            p = r.params
            for name in cols:
                cols[name][i] = getattr(p, name)
            top_k[i] = min(max(p.top_k, 0), self.valid_vocab)  # any k >= the vocabulary means no top-k
            seed[i] = r.seed
            step[i] = len(r.output_ids) + (0 if ahead is None else ahead[i])
        want_top = any(r.params.logprobs for r in requests)
        return SamplingRows(top_k=top_k, seed=seed, step=step, **cols), np.bool_(want_top)

    def decode_batch(self, requests: list[Request], size: int, first: FirstTokens | None = None) -> DecodeBatch:
        """The decode step's inputs for ``requests`` padded to ``size`` rows, built on the host; the tokens of
        the requests in ``first`` are prefill's samples, taken on the device."""
        width = self.layout.max_pages_per_seq
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        slot_ids = np.zeros(size, np.int32)
        page_tables = np.zeros((size, width), np.int32)
        source = np.full(size, -1, np.int32)  # row of first.sampled holding the row's token, else -1
        if first is not None:
            index = {id(r): i for i, r in enumerate(requests)}
            for r, row in zip(first.requests, first.rows, strict=True):
                if id(r) in index:
                    source[index[id(r)]] = row
        ahead = (source[: len(requests)] >= 0).astype(np.int32)
        for i, r in enumerate(requests):
            tokens[i] = r.output_ids[-1] if not ahead[i] else 0
            positions[i] = len(r.prompt_ids) + len(r.output_ids) + ahead[i] - 1
            slot_ids[i] = r.slot
            page_tables[i] = page_table_row(r.pages, width)
        rows, want_top = self._sampling_rows(requests, size, ahead)
        if ahead.any():
            take = self._program(("first_tokens", size))
            if take is not None:
                tokens = take(tokens, first.sampled.tokens, source)
            else:  # not built yet: read prefill's tokens on the host
                tokens = np.where(source >= 0, np.asarray(first.sampled.tokens)[np.maximum(source, 0)], tokens)
        batch = DecodeBatch(tokens, positions, slot_ids, page_tables, rows, want_top)
        if self.mesh is not None:  # placed as a chained call's inputs are (arrays on the mesh): host arrays
            batch = jax.device_put(batch, self._batch_sharding)  # would be another input type, another compile
        return batch

    def _launch_decode(self, requests: list[Request], variant: tuple[bool, int],
                       after: DecodeCall | None = None, first: FirstTokens | None = None) -> DecodeCall | None:
        """Queue one decode call over ``requests`` (padded to their batch bucket); ``after``: the call in flight
        for the same requests, whose outputs on the device are this call's inputs (the host neither waits for
        them nor copies anything to the device); ``first``: prefill's unread samples, the last tokens of the
        requests it names. None (nothing queued) when ``after``'s bucket has no built program for ``variant``."""
        size = after.next_batch.tokens.shape[0] if after is not None else None
        choice = self._decode_program(variant, len(requests), size)
        if choice is None:
            return None
        variant, size, program = choice
        batch = after.next_batch if after is not None else self.decode_batch(requests, size, first)
        sampled, next_batch, self.pools = program(self._weights, self.pools, batch)
        return DecodeCall(requests, variant, sampled, next_batch)

    def _run_decode(self) -> None:
        """Queue the next decode call, then hand out the samples of the call before it.

        While the decoding requests stay the same, each call takes its inputs from the previous call's outputs
        on the device and is queued before the host reads that output: the device runs call after call while
        the host delivers tokens. Likewise the first call after a prefill takes the prompts' first tokens from
        prefill's output on the device, and is queued before the host reads them. A call that runs past a
        request's end (eos, max_tokens, cancel) computes rows the host discards; positions past a request's
        pages write to the null page.
        """
        previous, self._inflight = self._inflight, None
        first, self._first = self._first, None
        requests = list(self._decoding)
        greedy = all(r.params.temperature == 0 and not r.params.logprobs for r in requests)
        same = first is None and previous is not None and len(previous.requests) == len(requests) > 0 and all(
            a is b for a, b in zip(previous.requests, requests, strict=True))
        # A request that reaches max_tokens in the previous call leaves the batch: chaining would queue a call
        # of discarded rows ahead of whatever comes next (a new request's prefill would wait for it).
        if same and all(len(r.output_ids) + previous.steps < r.params.max_tokens for r in requests):
            left = max(r.params.max_tokens - len(r.output_ids) - previous.steps for r in requests)
            self._inflight = self._launch_decode(requests, (greedy, self._steps_per_call(greedy, left)),
                                                 after=previous)
            if self._inflight is not None:
                self._deliver_call(previous)
                return
        if previous is not None:
            self._deliver_call(previous)
        unread = {id(r) for r in first.requests} if first is not None else set()  # first token still on device
        left = {id(r): r.params.max_tokens - len(r.output_ids) - (id(r) in unread) for r in self._decoding}
        requests = [r for r in self._decoding if not r.finished and left[id(r)] > 0]
        if requests:
            steps = self._steps_per_call(greedy, max(left[id(r)] for r in requests))
            self._inflight = self._launch_decode(requests, (greedy, steps), first=first)
        if first is not None:
            self._deliver(first.requests, first.sampled, first.rows)

    def _steps_per_call(self, greedy: bool, most_left: int) -> int:
        """Decode steps for the next call over requests of which the one with the most left still wants
        ``most_left`` tokens beyond those in flight.

        Several only for a greedy batch with no prompt waiting for its prefill (it would wait that much
        longer), and only while some request still wants that many tokens: a request's last few tokens
        take a step each rather than a call whose steps past every end are computed, waited for and
        discarded."""
        if not greedy or self.decode_steps == 1 or self._waiting or self._prefilling or self._inbox.qsize():
            return 1
        return self.decode_steps if most_left >= self.decode_steps else 1

    def _deliver_call(self, call: DecodeCall) -> None:
        want_top = any(r.params.logprobs for r in call.requests)
        host = Sampled(np.asarray(call.sampled.tokens), np.asarray(call.sampled.logprob),
                       np.asarray(call.sampled.top_ids) if want_top else None,
                       np.asarray(call.sampled.top_logprobs) if want_top else None)
        for k in range(call.steps):
            self._deliver(call.requests, jax.tree.map(lambda x, k=k: x[k], host))

    def _deliver(self, requests: list[Request], sampled, rows: list[int] | None = None) -> None:
        want_top = any(r.params.logprobs for r in requests)
        tokens = np.asarray(sampled.tokens)
        logprob = np.asarray(sampled.logprob)
        top_ids = np.asarray(sampled.top_ids) if want_top else None
        top_lp = np.asarray(sampled.top_logprobs) if want_top else None
        for i, r in zip(range(len(requests)) if rows is None else rows, requests, strict=True):
            if r.finished:  # a call ran past its end: discard
                continue
            tops = (top_ids[i], top_lp[i]) if want_top else None
            self._emit(r, int(tokens[i]), logprob[i], tops)

    def prefill_batch(self, chunks: list[tuple[Request, int]], size: int) -> PrefillBatch:
        """The prefill step's inputs: ``n`` more prompt tokens of each (request, n), packed and padded to ``size``."""
        num_seqs = self.config.max_prefill_seqs
        width = self.layout.max_pages_per_seq
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        seq_index = np.zeros(size, np.int32)
        valid = np.zeros(size, np.bool_)
        cu = np.zeros(num_seqs + 1, np.int32)
        slot_ids = np.zeros(num_seqs, np.int32)
        page_tables = np.zeros((num_seqs, width), np.int32)
        context_lens = np.zeros(num_seqs, np.int32)
        is_first = np.zeros(num_seqs, np.bool_)
        is_last = np.zeros(num_seqs, np.bool_)
        offset = 0
        for s, (r, n) in enumerate(chunks):
            start = r.num_prefilled
            tokens[offset: offset + n] = r.prompt_ids[start: start + n]
            positions[offset: offset + n] = np.arange(start, start + n)
            seq_index[offset: offset + n] = s
            valid[offset: offset + n] = True
            offset += n
            cu[s + 1] = offset
            slot_ids[s] = r.slot
            page_tables[s] = page_table_row(r.pages, width)
            context_lens[s] = start + n
            is_first[s] = start == 0
            is_last[s] = start + n == len(r.prompt_ids)
        cu[len(chunks) + 1:] = offset
        rows, want_top = self._sampling_rows([r for r, _ in chunks], num_seqs)
        return PrefillBatch(tokens, positions, seq_index, valid, cu, slot_ids, page_tables, context_lens,
                            is_first, is_last, rows, want_top)

    def _run_prefill(self) -> None:
        budget = self.config.prefill_chunk
        chunks: list[tuple[Request, int]] = []
        for r in self._prefilling[: self.config.max_prefill_seqs]:
            n = min(len(r.prompt_ids) - r.num_prefilled, budget)
            if n <= 0:
                break
            chunks.append((r, n))
            budget -= n
        total = sum(n for _, n in chunks)
        buckets = self.config.prefill_buckets
        size, program = next((b, p) for b in buckets[bisect.bisect_left(buckets, total):]
                             if (p := self._program(("prefill", b))) is not None)
        sampled, self.pools = program(self._weights, self.pools, self.prefill_batch(chunks, size))
        done, rows = [], []
        for s, (r, n) in enumerate(chunks):
            r.num_prefilled += n
            self.counters["prompt_tokens"] += n
            if r.num_prefilled == len(r.prompt_ids):
                self._prefilling.remove(r)
                self._decoding.append(r)
                done.append(r)
                rows.append(s)
        if done:  # read by `_run_decode`, after it queues the first decode call over them
            self._first = FirstTokens(done, rows, sampled)

