"""The engine's device side: the weights, the cache pools, the compiled programs, their warm-up, the host-built
batches and the calls that queue the steps on the device.

Every program (a step at one shape bucket) is loaded from the executable store or compiled during a logged
warm-up at start, so nothing compiles while serving; with ``background_compile`` only the programs that can
serve any request are built before ``start`` returns and the rest follow in a background thread, the engine
running a larger bucket or a plainer variant until each is built.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import asdict
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax.caches.paged import PagedKernels
from hybrid_jax.caches.pools import is_pool_spec, pool_specs, snapshot_specs
from hybrid_jax.engine.batches import decode_batch, prefill_batch
from hybrid_jax.engine.cache import allocate_pools, plan_layout, weight_device_bytes
from hybrid_jax.engine.calls import DecodeCall, FirstTokens, host_samples, take_first_tokens
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.grammar import fill_masks, mask_words
from hybrid_jax.engine.programs import ExecutableStore, Programs, ProgramSpec
from hybrid_jax.engine.prompt_logprobs import PromptScorer
from hybrid_jax.engine.requests import PromptLogprob, Request
from hybrid_jax.engine.sampler import Sampled
from hybrid_jax.engine.scheduler import Variant
from hybrid_jax.engine.steps import (
    DecodeBatch,
    PrefillBatch,
    decode_step,
    multi_decode_step,
    prefill_step,
    restore_snapshots,
    write_grammar_masks,
)
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.sharding import make_mesh, shard_model, stored_kv_heads

log = logging.getLogger("hybrid_jax.engine")


def _is_abstract(model: nnx.Module) -> bool:
    return any(isinstance(w, jax.ShapeDtypeStruct) for w in jax.tree.leaves(nnx.state(model)))


class Runner:
    """Owns the weights, the cache pools and the programs; runs the steps the engine loop asks for."""

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig, *, valid_vocab: int | None = None,
                 executable_dir: str | os.PathLike | None = None):
        """``model`` may be abstract (shape-only parameters): its programs can be built (`prepare_programs`)
        while the weights load, and `attach` gives it the loaded model before `warmup`."""
        self.model, self.config = model, config
        self.valid_vocab = valid_vocab or model.config.vocab_size
        self.weights_loaded = not _is_abstract(model)
        self.mesh = self._place_model(model)
        # The steps take the weights as one flat tuple of arrays: jit flattens a tuple in C++, an nnx.State
        # in Python node by node (~10 us a weight a call: DESIGN).
        self._graphdef, weights = nnx.split(model)
        leaves, self._weights_def = jax.tree.flatten(weights)
        self.weights = tuple(leaves)
        self.layout = plan_layout(model.config, model.dtype, model.config.vocab_size, max_batch=config.max_batch,
                                  max_model_len=config.max_model_len, page_size=config.page_size,
                                  memory_utilization=config.memory_utilization, num_pages=config.num_pages,
                                  tp=config.tensor_parallel_size, weight_bytes=weight_device_bytes(leaves),
                                  snapshot_share=config.snapshot_share if config.enable_prefix_caching else 0.0,
                                  num_snapshots=config.num_snapshots)
        shapes, self._pool_shardings, self._batch_sharding = self._pool_layout()
        self._snapshot_shapes, self._snapshot_shardings = self._snapshot_layout()
        self.pools = allocate_pools(shapes, self._pool_shardings)
        self.snapshots = self._allocate_snapshots()
        # Under a mesh, one step per call (DESIGN's alternatives: the multi-step loop measured slow there).
        self.decode_steps = config.decode_steps if self.mesh is None else 1
        self._prefill, self._decode = self._jit_steps()
        self._restore = self._jit_restore()
        self._take_first_tokens = jax.jit(take_first_tokens)
        self._write_masks = self._jit_mask_writes()
        self.devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        store = ExecutableStore(executable_dir, self.devices) if executable_dir is not None else None
        self.programs = Programs(self._program_specs(), store, self._program_context())
        self.scorer = PromptScorer(self._graphdef, self._weights_def, self.weights, self.valid_vocab,
                                   config.max_model_len, store, self._program_context(), self._batch_sharding)
        self.runs: Counter[tuple] = Counter()  # programs run while serving (not the warm-up's), by key
        self._prepared = False  # the programs start needs are built
        self._load_seconds = 0.0  # spent loading them from the store
        self._warm = False  # after warmup(): a missing program is never compiled on the engine thread

    # -- the steps: every use of `steps`, the model's sharding and the pools' layout ----------------------
    def _place_model(self, model: Qwen35ForCausalLM) -> Mesh | None:
        """The mesh of ``tensor_parallel_size`` devices (None for one) with ``model`` sharded over it."""
        tp = self.config.tensor_parallel_size
        mesh = make_mesh(tp) if tp > 1 else None
        if mesh is not None:
            if not self.weights_loaded:
                raise ValueError("tensor_parallel_size: an engine over a mesh needs its weights loaded first")
            shard_model(model, mesh)
        return mesh

    def _pool_layout(self) -> tuple[dict, dict | None, NamedSharding | None]:
        """The pools' shapes, their shardings and the batches' (None without a mesh)."""
        config, layout = self.model.config, self.layout
        specs = pool_specs(config, num_pages=layout.num_pages, page_size=layout.page_size,
                           num_slots=layout.num_slots, dtype=self.model.dtype, vocab=config.vocab_size,
                           kv_heads=stored_kv_heads(config, self.config.tensor_parallel_size))
        shapes = jax.tree.map(lambda p: p.struct(), specs, is_leaf=is_pool_spec)
        if self.mesh is None:
            return shapes, None, None
        pools = jax.tree.map(lambda p: NamedSharding(self.mesh, p.partition), specs, is_leaf=is_pool_spec)
        return shapes, pools, NamedSharding(self.mesh, PartitionSpec())

    def _snapshot_layout(self) -> tuple[dict | None, dict | None]:
        """The snapshot pool's shapes and shardings (None without a snapshot pool; shardings None without a mesh)."""
        if not self.layout.num_snapshots:
            return None, None
        config = self.model.config
        specs = snapshot_specs(config, num_snapshots=self.layout.num_snapshots, dtype=self.model.dtype,
                               vocab=config.vocab_size)
        shapes = jax.tree.map(lambda p: p.struct(), specs, is_leaf=is_pool_spec)
        if self.mesh is None:
            return shapes, None
        return shapes, jax.tree.map(lambda p: NamedSharding(self.mesh, p.partition), specs, is_leaf=is_pool_spec)

    def _allocate_snapshots(self) -> dict | None:
        if self._snapshot_shapes is None:
            return None
        return allocate_pools(self._snapshot_shapes, self._snapshot_shardings)

    def _jit_restore(self):
        """The jitted snapshot restore (snapshots -> slots), donating the pools."""
        kw = dict(donate_argnums=0)
        if self.mesh is not None:
            kw = dict(kw, in_shardings=(self._pool_shardings, self._snapshot_shardings, self._batch_sharding,
                                        self._batch_sharding), out_shardings=self._pool_shardings)
        return jax.jit(restore_snapshots, **kw)

    def _jit_mask_writes(self):
        """The jitted grammar-bitmask write into the pools (donated)."""
        kw = dict(donate_argnums=0)
        if self.mesh is not None:
            kw = dict(kw, in_shardings=(self._pool_shardings, self._batch_sharding, self._batch_sharding),
                      out_shardings=self._pool_shardings)
        return jax.jit(write_grammar_masks, **kw)

    def _jit_steps(self) -> tuple:
        """The jitted prefill step, and the decode steps by variant (greedy_only, steps per call); several
        steps per call only for greedy batches."""
        step_kw = dict(kernels=PagedKernels(self.model.config, self.mesh), page_size=self.layout.page_size,
                       valid_vocab=self.valid_vocab)
        prefill_kw = dict(donate_argnums=(1, 2))  # the pools and the snapshots
        # A decode call's batch is donated too: the next call's batch, returned in its buffers, costs no copies.
        decode_kw = dict(donate_argnums=(1, 2))
        if self.mesh is not None:
            # Every program's inputs and outputs pinned: the batch and the samples replicated, the pools as planned,
            # so a chained decode call's batch (the previous call's output) has the sharding the warm-up compiled
            # for (and decode_batch places the host's batch the same way: the same input type).
            replicated = self._batch_sharding
            weight_shardings = tuple(w.sharding for w in self.weights)
            prefill_kw = dict(prefill_kw, in_shardings=(weight_shardings, self._pool_shardings,
                                                        self._snapshot_shardings, replicated),
                              out_shardings=(replicated, self._pool_shardings, self._snapshot_shardings))
            decode_kw = dict(decode_kw, in_shardings=(weight_shardings, self._pool_shardings, replicated),
                             out_shardings=(replicated, replicated, self._pool_shardings))
        prefill = jax.jit(partial(self._run, prefill_step, **step_kw), **prefill_kw)
        decode = {(greedy, 1): jax.jit(partial(self._run_decode_step, decode_step, greedy_only=greedy, **step_kw),
                                       **decode_kw) for greedy in (False, True)}
        if self.decode_steps > 1:
            decode[True, self.decode_steps] = jax.jit(
                partial(self._run_decode_step, multi_decode_step, num_steps=self.decode_steps, greedy_only=True,
                        **step_kw), **decode_kw)
        return prefill, decode

    def _run_decode_step(self, step, weights: tuple[jax.Array, ...], pools, batch: DecodeBatch, **kw):
        """A decode step whose samples carry a leading [steps] axis, plus the inputs of the next call over the
        same requests (its tokens the last samples, positions and sampling steps advanced), made on the device:
        a chained call needs no host-side array op and no host-to-device copy. The rows' output history (what
        bad words are matched against) takes the input tokens here, on the device: the host may not have them
        (only constrained rows keep one)."""
        constraints = batch.rows.constraints
        shifted = jnp.concatenate([constraints.recent[:, 1:], batch.tokens[:, None]], axis=1)  # [B, HISTORY]
        recent = jnp.where(constraints.constrained[:, None], shifted, constraints.recent)
        batch = batch._replace(rows=batch.rows._replace(constraints=constraints._replace(recent=recent)))
        sampled, pools = self._run(step, weights, pools, batch, **kw)
        if sampled.tokens.ndim == 1:
            sampled = jax.tree.map(lambda x: x[None], sampled)
        real = batch.slot_ids > 0  # [B] padding rows stay as the host pads them
        advance = lambda x: jnp.where(real, x + sampled.tokens.shape[0], x)
        next_batch = batch._replace(tokens=jnp.where(real, sampled.tokens[-1], 0), positions=advance(batch.positions),
                                    rows=batch.rows._replace(step=advance(batch.rows.step)))
        return sampled, next_batch, pools

    def _run(self, step, weights: tuple[jax.Array, ...], *args, **kw):
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._weights_def, weights))
        return step(model, *args, **kw)

    # -- programs and warm-up ------------------------------------------------------------------------
    def _program_specs(self) -> dict[tuple, ProgramSpec]:
        """Every program the engine can run, keyed ("decode", greedy_only, steps, B) | ("prefill", T) |
        ("first_tokens", B) | ("grammar_masks", B) | ("snapshot_restore", S) (with a snapshot pool), essential
        ones first: the general decode at the largest batch and the largest
        prefill serve any request; the rest, smallest buckets first, only make some faster."""
        # Without a mesh the pools are uncommitted arrays: a sharding here would make each call's signature differ
        # from the compiled one's.
        placed = lambda a: a.sharding if self.mesh is not None else None
        shape_of = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed(a))
        pools = jax.tree.map(shape_of, self.pools)
        snapshots = jax.tree.map(shape_of, self.snapshots) if self.snapshots is not None else None
        weights = tuple(map(shape_of, self.weights))
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
            masks = jax.ShapeDtypeStruct((size, mask_words(self.model.config.vocab_size)), jnp.int32,
                                         sharding=self._batch_sharding)
            specs["grammar_masks", size] = ProgramSpec(f"grammar masks G={size}", self._write_masks,
                                                       (pools, rows(size), masks), essential=size == largest_decode)
        for size in reversed(self.config.prefill_buckets):
            specs["prefill", size] = ProgramSpec(f"prefill T={size}", self._prefill,
                                                 (weights, pools, snapshots, self.prefill_batch([], size)),
                                                 essential=size == largest_prefill)
        if self.snapshots is not None:
            pairs = (rows(self.config.max_prefill_seqs),) * 2
            specs["snapshot_restore", self.config.max_prefill_seqs] = ProgramSpec(
                "snapshot restore", self._restore, (pools, snapshots, *pairs), essential=True)
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

    def load_stored_programs(self) -> bool:
        """Load the programs start needs that the executable store holds; True when none is missing."""
        wanted, start = self._start_programs, time.perf_counter()
        self.programs.load_stored(self._compile_threads, wanted)
        self._load_seconds += time.perf_counter() - start
        return all(self.programs.get(k) is not None for k in wanted)

    def release(self) -> None:
        """Free the pools of a runner that will not start (their device memory goes back at once)."""
        self.pools = self.snapshots = None

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
            self.pools = self.snapshots = None
            seconds = programs.compile_missing(missing, threads, "compiling programs")
            log.info("start-up: %d programs compiled in %.1f s, %d at a time", len(missing), seconds, threads)
            self.pools = allocate_pools(shapes, self._pool_shardings)
            self.snapshots = self._allocate_snapshots()
        self._prepared = True

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
                elif key[0] == "snapshot_restore":
                    self.restore_snapshots([], padding=True)
                elif key[0] == "prefill":
                    _, self.pools, self.snapshots = compiled(self.weights, self.pools, self.snapshots, args[3])
                elif key[0] == "grammar_masks":
                    self.pools = compiled(self.pools, np.zeros(key[1], np.int32), np.zeros(args[2].shape, np.int32))
                else:
                    _, *_, self.pools = compiled(self.weights, self.pools, args[2])
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
        """Give a runner built over an abstract model the loaded one (same config, shapes and dtypes)."""
        _, weights = nnx.split(model)
        leaves, tree = jax.tree.flatten(weights)
        if tree != self._weights_def or any(a.shape != b.shape or a.dtype != b.dtype
                                            for a, b in zip(leaves, self.weights, strict=True)):
            raise ValueError("model: its parameters differ from the engine's (another config or dtype)")
        self.model, self.weights, self.weights_loaded = model, tuple(leaves), True

    def program(self, key: tuple):
        """The compiled program for ``key``, or None while it is not built (after the warm-up); before a warm-up
        (``start(warmup=False)``) a missing program is built on first use."""
        compiled = self.programs.get(key)
        if compiled is None and not self._warm:
            compiled = self.programs.build(key)
        return compiled

    # -- host batches --------------------------------------------------------------------------------
    def decode_batch(self, requests: list[Request], size: int, first: FirstTokens | None = None) -> DecodeBatch:
        """The decode step's inputs for ``requests`` padded to ``size`` rows, built on the host; the tokens of
        the requests in ``first`` are prefill's samples, taken on the device."""
        source = np.full(size, -1, np.int32)  # row of first.sampled holding the row's token, else -1
        if first is not None:
            index = {id(r): i for i, r in enumerate(requests)}
            for r, row in zip(first.requests, first.rows, strict=True):
                if id(r) in index:
                    source[index[id(r)]] = row
        batch = decode_batch(requests, size, self.layout.max_pages_per_seq, self.valid_vocab, source)
        if (source >= 0).any():
            take = self.program(("first_tokens", size))
            if take is not None:
                batch = batch._replace(tokens=take(batch.tokens, first.sampled.tokens, source))
                self.runs[("first_tokens", size)] += 1
            else:  # not built yet: read prefill's tokens on the host
                first_tokens = np.asarray(first.sampled.tokens)[np.maximum(source, 0)]
                batch = batch._replace(tokens=np.where(source >= 0, first_tokens, batch.tokens))
        if self.mesh is not None:  # placed as a chained call's inputs are (arrays on the mesh): host arrays
            batch = jax.device_put(batch, self._batch_sharding)  # would be another input type, another compile
        return batch

    def prefill_batch(self, chunks: list[tuple[Request, int]], size: int) -> PrefillBatch:
        """The prefill step's inputs: ``n`` more prompt tokens of each (request, n), packed and padded to ``size``."""
        return prefill_batch(chunks, size, self.config.max_prefill_seqs, self.layout.max_pages_per_seq,
                             self.valid_vocab)

    # -- calls ---------------------------------------------------------------------------------------
    def prefill(self, chunks: list[tuple[Request, int]], buckets: list[int]) -> Sampled:
        """Queue one prefill step over ``chunks`` at the first built of ``buckets``; its samples stay on the
        device ([max_prefill_seqs] rows, one per chunk)."""
        size, program = next((b, p) for b in buckets if (p := self.program(("prefill", b))) is not None)
        sampled, self.pools, self.snapshots = program(self.weights, self.pools, self.snapshots,
                                                      self.prefill_batch(chunks, size))
        self.runs[("prefill", size)] += 1
        return sampled

    def launch_decode(self, requests: list[Request], choices: list[tuple[Variant, int]],
                      after: DecodeCall | None = None, first: FirstTokens | None = None) -> DecodeCall | None:
        """Queue one decode call over ``requests`` with the first built of ``choices`` ((variant, bucket), best
        first); ``after``: the call in flight for the same requests, whose outputs on the device are this call's
        inputs (the host neither waits for them nor copies anything to the device); ``first``: prefill's unread
        samples, the last tokens of the requests it names. None (nothing queued) when no choice is built."""
        choice = next(((v, b, p) for v, b in choices if (p := self.program(("decode", *v, b))) is not None), None)
        if choice is None:
            return None
        variant, size, program = choice
        batch = after.next_batch if after is not None else self.decode_batch(requests, size, first)
        sampled, next_batch, self.pools = program(self.weights, self.pools, batch)
        self.runs[("decode", *variant, size)] += 1
        return DecodeCall(requests, variant, sampled, next_batch)

    def score_prompt(self, prompt_ids: list[int], top_n: int) -> list[PromptLogprob | None] | None:
        """The prompt's logprobs (see `PromptScorer.score`); None while their program is being built."""
        return self.scorer.score(self.weights, prompt_ids, top_n)

    def restore_snapshots(self, pairs: list[tuple[int, int]], *, padding: bool = False) -> None:
        """Queue copies of each (slot, snapshot)'s snapshot into the slot, before the steps queued after,
        ``max_prefill_seqs`` at a time (``padding``: once over padding, the warm-up's run)."""
        size = self.config.max_prefill_seqs
        program = self.program(("snapshot_restore", size))
        for start in range(0, len(pairs) or int(padding), size):
            group = pairs[start: start + size]
            slot_ids, snapshot_ids = np.zeros(size, np.int32), np.zeros(size, np.int32)
            for i, (slot, snapshot) in enumerate(group):
                slot_ids[i], snapshot_ids[i] = slot, snapshot
            self.pools = program(self.pools, self.snapshots, slot_ids, snapshot_ids)
            if group:
                self.runs["snapshot_restore", size] += 1

    def write_grammar_masks(self, requests: list[Request]) -> None:
        """Queue writes of each request's next-token grammar bitmask (computed here, on the host) into the pools
        at its slot, before the steps queued after; at the smallest built bucket that holds them."""
        buckets = self.config.decode_buckets
        for start in range(0, len(requests), buckets[-1]):
            group = requests[start: start + buckets[-1]]
            size, program = next((b, p) for b in buckets
                                 if b >= len(group) and (p := self.program(("grammar_masks", b))) is not None)
            slot_ids = np.zeros(size, np.int32)
            slot_ids[: len(group)] = [r.slot for r in group]
            masks = np.zeros((size, mask_words(self.model.config.vocab_size)), np.int32)
            fill_masks([r.grammar for r in group], masks)
            self.pools = program(self.pools, slot_ids, masks)
            self.runs["grammar_masks", size] += 1

    @staticmethod
    def read(call: DecodeCall) -> list[Sampled]:
        """A call's samples on the host, one set per step (waits for the call)."""
        host = host_samples(call.sampled, call.requests)
        return [jax.tree.map(lambda x, k=k: x[k], host) for k in range(call.steps)]
