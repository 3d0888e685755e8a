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
from collections.abc import Callable
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.compilation_cache import ExecutableDir
from hybrid_jax.engine.batches import decode_batch, prefill_batch
from hybrid_jax.engine.cache import plan_layout, weight_device_bytes
from hybrid_jax.engine.calls import DecodeCall, FirstTokens, PendingSample, host_samples
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.grammar import fill_masks, mask_words
from hybrid_jax.engine.host_moves import HostMoves
from hybrid_jax.engine.host_tier import HostTier
from hybrid_jax.engine.jitted import JittedSteps
from hybrid_jax.engine.packing import Packed, pack
from hybrid_jax.engine.placement import Placement, place_model
from hybrid_jax.engine.programs import ExecutableStore, Programs, ProgramSpec
from hybrid_jax.engine.prompt_logprobs import PromptScorer
from hybrid_jax.engine.requests import PromptLogprob, Request
from hybrid_jax.engine.sampler import Sampled
from hybrid_jax.engine.scheduler import Variant
from hybrid_jax.engine.steps import DecodeBatch
from hybrid_jax.model import Qwen35ForCausalLM

log = logging.getLogger("hybrid_jax.engine")

SPLIT_DECODE = ("decode_logits", "decode_sample")  # the programs of a decode step run as forward, then sample


class Runner:
    """Owns the weights, the cache pools and the programs; runs the steps the engine loop asks for."""

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig, *, valid_vocab: int | None = None,
                 executable_dir: ExecutableDir | str | os.PathLike | None = None, grammars: bool = False):
        """``model`` may be abstract (shape-only parameters): while its weights load, its stored programs can be
        loaded (`load_stored_programs`, then `prepare_programs` allocates the pools) or the missing ones traced
        and lowered (`lower_start_programs`); `attach` gives it the loaded model before `warmup`. Its pools are
        allocated by `prepare_programs` (a loaded model's at once: its steps may run without a start).
        ``grammars``: requests may have one (their programs are built)."""
        self.model, self.config, self.grammars = model, config, grammars
        self.valid_vocab = valid_vocab or model.config.vocab_size
        # The steps take the weights as one flat tuple of arrays: jit flattens a tuple in C++, an nnx.State
        # in Python node by node (~10 us a weight a call: DESIGN).
        graphdef, weights = nnx.split(model)
        leaves, self._weights_def = jax.tree.flatten(weights)
        self.weights_loaded = not any(isinstance(w, jax.ShapeDtypeStruct) for w in leaves)
        tp = config.tensor_parallel_size
        mesh = place_model(model, tp, self.weights_loaded)
        if mesh is not None:  # sharded in place: the placed arrays
            graphdef, weights = nnx.split(model)
            leaves, self._weights_def = jax.tree.flatten(weights)
        self.weights = tuple(leaves)
        self.layout = plan_layout(model.config, model.dtype, model.config.vocab_size, max_batch=config.max_batch,
                                  max_model_len=config.max_model_len, page_size=config.page_size,
                                  memory_utilization=config.memory_utilization, num_pages=config.num_pages,
                                  tp=tp, weight_bytes=weight_device_bytes(leaves),
                                  snapshot_share=config.snapshot_share if config.enable_prefix_caching else 0.0,
                                  num_snapshots=config.num_snapshots)
        self.placement = Placement(model, self.layout, mesh, tp)
        self.devices = self.placement.devices
        self.store = ExecutableStore(executable_dir, self.devices) if executable_dir is not None else None
        self.pools = self.snapshots = None  # the cache pools and the snapshot pool: `ensure_pools`
        if self.weights_loaded:
            self.ensure_pools()
        # Under a mesh, one step per call (DESIGN's alternatives: the multi-step loop measured slow there).
        self.decode_steps = config.decode_steps if mesh is None else 1
        self.steps = JittedSteps(model.config, graphdef, self._weights_def, self.weights, self.placement,
                                 page_size=self.layout.page_size, valid_vocab=self.valid_vocab,
                                 decode_steps=self.decode_steps)
        self.host_tier = self.host_moves = None  # the prefix cache's host-memory tier (kv_offloading_size)
        if config.kv_offloading_size and self.placement.snapshot_shapes is not None:
            per_block = config.prefix_block // self.layout.page_size
            self.host_moves = HostMoves(self.placement, per_block)
            nbytes = lambda tree: sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(tree))
            self.host_tier = HostTier(int(config.kv_offloading_size * 2**30), nbytes(self.host_moves.page_shapes),
                                      nbytes(self.host_moves.row_shapes))
            log.info("prefix caching: a host tier of %.1f GiB (%.1f MiB a block, %.1f MiB a snapshot)",
                     config.kv_offloading_size, self.host_tier.block_bytes / 2**20,
                     self.host_tier.snapshot_bytes / 2**20)
        self.programs = Programs(self._program_specs(), self.store, self._program_context())
        self.scorer = PromptScorer(graphdef, self._weights_def, self.weights, self.valid_vocab,
                                   config.max_model_len, self.store, self._program_context(), self.placement.batch)
        self.runs: Counter[tuple] = Counter()  # programs run while serving (not the warm-up's), by key
        # A program's first run costs on a GPU (`run_once`); the CPU records nothing on one.
        self.first_runs = self.devices[0].platform != "cpu"
        self.ran_once: set[tuple] = set()  # programs run once on a padding batch
        self._prepared = False  # the programs start needs are built
        self._load_seconds = 0.0  # spent loading them from the store
        self._warm = False  # after warmup(): a missing program is never compiled on the engine thread

    # -- programs and warm-up ------------------------------------------------------------------------
    def _program_specs(self) -> dict[tuple, ProgramSpec]:
        """Every program the engine can run, keyed ("decode", greedy_only, steps, B) | ("prefill", greedy_only, T) |
        ("first_tokens", B) | ("grammar_masks", B), ("decode_logits", B), ("decode_sample", B) (with grammars;
        the last two without a mesh), essential ones first: the general decode at the largest batch and the
        general prefill at the largest bucket serve any request; the rest, smallest buckets first, only make
        some faster."""
        # Without a mesh the pools are uncommitted arrays: a sharding here would make each call's signature differ
        # from the compiled one's.
        placed = lambda a: a.sharding if self.placement.mesh is not None else None
        shape_of = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed(a))
        pools, snapshots = self.placement.pool_structs(), self.placement.snapshot_structs()
        weights = tuple(map(shape_of, self.weights))
        largest_decode, largest_prefill = self.config.decode_buckets[-1], self.config.prefill_buckets[-1]
        rows = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=self.placement.batch)  # placed as a batch
        specs = {}
        for size in reversed(self.config.decode_buckets):
            for (greedy, steps), fn in sorted(self.steps.decode.items()):
                ids = None if snapshots is None else jax.ShapeDtypeStruct((steps, size), jnp.int32,
                                                                          sharding=self.placement.batch)
                specs["decode", greedy, steps, size] = ProgramSpec(
                    f"decode B={size} (greedy only: {greedy}, {steps} steps per call)", fn,
                    (weights, pools, snapshots, self.decode_batch([], size), ids),
                    essential=size == largest_decode and not greedy)
            specs["first_tokens", size] = ProgramSpec(
                f"first tokens B={size}", self.steps.take_first_tokens,
                (rows(size), rows(self.config.max_prefill_seqs), rows(size)),
                essential=size == largest_decode)
            if not self.grammars:
                continue
            masks = jax.ShapeDtypeStruct((size, mask_words(self.model.config.vocab_size)), jnp.int32,
                                         sharding=self.placement.batch)
            specs["grammar_masks", size] = ProgramSpec(f"grammar masks G={size}", self.steps.write_masks,
                                                       (pools, rows(size), masks), essential=size == largest_decode)
            if self.steps.split_decode is not None:
                forward, sample = self.steps.split_decode
                batch = self.decode_batch([], size)
                logits = jax.ShapeDtypeStruct((size, self.model.config.vocab_size), jnp.float32)
                specs["decode_logits", size] = ProgramSpec(f"decode forward B={size}", forward,
                                                           (weights, pools, batch), essential=False)
                specs["decode_sample", size] = ProgramSpec(
                    f"decode sample B={size}", sample,
                    (pools, logits, batch, masks, jax.ShapeDtypeStruct((size,), jnp.bool_)), essential=False)
        for size in reversed(self.config.prefill_buckets):
            for greedy, fn in self.steps.prefill.items():
                specs["prefill", greedy, size] = ProgramSpec(
                    f"prefill T={size} (greedy only: {greedy})", fn,
                    (weights, pools, snapshots, self.prefill_batch([], size)),
                    essential=size == largest_prefill and not greedy)
        if self.host_moves is not None:
            specs.update(self.host_moves.specs(shape_of))
        # Essential first; then the smallest buckets (what a lone request runs), multi-step decode first; the
        # split decode (only grammar rows run it) last.
        order = lambda key: (not specs[key].essential, key[0] in SPLIT_DECODE, key[-1], key[0] != "decode",
                             -key[2] if key[0] == "decode" else 0)
        return {key: specs[key] for key in sorted(specs, key=order)}

    def _program_context(self) -> dict:
        """What decides the programs besides their arguments' shapes (the executable store's key)."""
        settings = {k: v for k, v in asdict(self.config).items()
                    if k not in ("max_waiting", "compile_threads", "background_compile", "memory_utilization")}
        return {"model": repr(self.model.config), "dtype": str(self.model.dtype), "valid_vocab": self.valid_vocab,
                "engine": settings, "decode_steps": self.decode_steps, "layout": repr(self.layout)}

    def load_stored_programs(self) -> bool:
        """Load the programs start needs that the executable store holds; True when none is missing."""
        wanted, start = self.start_programs, time.perf_counter()
        self.programs.load_stored(self._compile_threads, wanted)
        self._load_seconds += time.perf_counter() - start
        return all(self.programs.get(k) is not None for k in wanted)

    def ensure_pools(self) -> None:
        """Allocate the pools, zeroed, unless they are."""
        if self.pools is None:
            start = time.perf_counter()
            self.pools = self.placement.allocate_pools(self.store)
            self.snapshots = self.placement.allocate_snapshots(self.store)
            log.info("start-up: cache pools allocated in %.1f s", time.perf_counter() - start)

    def release(self) -> None:
        """Free the pools (their device memory goes back at once; `ensure_pools` allocates them again)."""
        self.pools = self.snapshots = None

    def lower_start_programs(self, until: Callable[[], bool] | None = None) -> None:
        """Trace and lower the programs start needs that are not built, from their shapes alone, until ``until()``
        (the weights are in: `prepare_programs` traces the rest itself). This may run while the weights load;
        XLA's compiles wait for `prepare_programs`."""
        missing = [k for k in self.start_programs if self.programs.get(k) is None]
        if missing:
            count, seconds = self.programs.lower(missing, until)
            log.info("start-up: %d of %d programs traced and lowered in %.1f s (compiled once the weights are in "
                     "place)", count, len(missing), seconds)

    def prepare_programs(self) -> None:
        """Load or compile the programs start needs, then allocate the pools. Over an abstract model call this
        only when the store held every one (`load_stored_programs`): XLA's compiles wait for the weights (see
        `warmup`)."""
        if not self._prepared:
            programs, threads, wanted = self.programs, self._compile_threads, self.start_programs
            self.load_stored_programs()
            log.info("start-up: %d of %d programs loaded from the executable cache in %.1f s",
                     programs.counts["loaded"], len(wanted), self._load_seconds)
            missing = [k for k in wanted if programs.get(k) is None]
            if missing:
                self.release()
                seconds = programs.compile_missing(missing, threads, "compiling programs")
                log.info("start-up: %d programs compiled in %.1f s, %d at a time", len(missing), seconds, threads)
            self._prepared = True
        self.ensure_pools()

    def warmup(self) -> None:
        """Build the programs start needs (every one, or only the essential ones with ``background_compile``):
        each loaded from the executable store or compiled; then run each once on a padding batch (`run_once`), so
        nothing compiles while serving. With ``background_compile`` the rest are loaded or compiled after, and
        the engine runs each once when it idles (`run_first_pending`).

        The (still empty) pools are released while compiling: XLA's GEMM autotuner allocates operand-sized
        scratch per program compiled (2.5 GB for the 27B lm_head), which the pools' share of memory leaves no
        room for when several programs compile at once."""
        self.prepare_programs()
        if not self.weights_loaded:
            raise RuntimeError("warmup: the engine's model is abstract; attach the loaded model first")
        programs, threads, wanted = self.programs, self._compile_threads, self.start_programs
        if self.first_runs:
            start = time.perf_counter()
            for key in wanted:
                self.run_once(key)
            jax.block_until_ready(self.pools)
            log.info("start-up: %d programs run once in %.1f s", len(wanted), time.perf_counter() - start)
        self._warm = True
        # In the background a quarter of the warm-up's threads: each compile holds XLA's autotuner scratch beside
        # the pools.
        if self.config.background_compile and programs.compile_rest(max(1, threads // 4)) is not None:
            log.info("start-up: %d programs left to load or compile in the background (a larger bucket serves "
                     "meanwhile)", programs.pending)

    def run_once(self, key: tuple) -> None:
        """Run ``key``'s built program on a padding batch (null slot, page and snapshot: nothing cached is
        touched). On a GPU a program's first run costs more than later ones (it records its CUDA graphs): tens of
        milliseconds at 9B that a request would otherwise wait."""
        compiled, args = self.programs.get(key), self.programs.specs[key].args
        if key[0] == "first_tokens":
            compiled(np.zeros(key[1], np.int32), np.zeros(self.config.max_prefill_seqs, np.int32),
                     np.full(key[1], -1, np.int32))
        elif key[0] == "prefill":
            _, self.pools, self.snapshots = compiled(self.weights, self.pools, self.snapshots, args[3])
        elif key[0] == "decode_logits":
            _, self.pools = compiled(self.weights, self.pools, args[2])
        elif key[0] == "decode_sample":
            zeros = [jnp.zeros(a.shape, a.dtype) for a in (args[1], args[3], args[4])]
            *_, self.pools = compiled(self.pools, zeros[0], args[2], *zeros[1:])
        elif self.host_moves is not None and key == self.host_moves.keys[0]:
            self.pools, self.snapshots = self.host_moves.round_trip(self.program, self.pools, self.snapshots)
        elif key[0].startswith("host_"):
            pass  # run by the round trip
        elif key[0] == "grammar_masks":
            self.pools = compiled(self.pools, np.zeros(key[1], np.int32), np.zeros(args[2].shape, np.int32))
        else:
            ids = None if args[4] is None else np.zeros(args[4].shape, np.int32)
            *_, self.pools, self.snapshots = compiled(self.weights, self.pools, self.snapshots, args[3], ids)
        self.ran_once.add(key)

    def _unrun(self) -> list[tuple]:
        """The programs built after the warm-up that nothing has run yet, in build order (none where first runs
        cost nothing)."""
        if not (self.first_runs and self._warm):
            return []
        return [k for k in tuple(self.programs.compiled) if k not in self.ran_once and not self.runs[k]]

    def first_runs_pending(self) -> int:
        """How many programs built in the background wait for their first run."""
        return len(self._unrun())

    def run_first_pending(self) -> None:
        """Run once (`run_once`) a program built in the background that nothing has run yet, and wait for it. The
        engine calls this while it idles, so no request pays a program's first run."""
        unrun = self._unrun()
        if not unrun:
            return
        key = unrun[0]
        try:
            self.run_once(key)
            jax.block_until_ready((self.pools, self.snapshots))  # one at a time on the device too
        except Exception:  # not run again; a request's step reports its own failure
            log.exception("the first run of %s failed", self.programs.specs[key].name)
            self.ran_once.add(key)

    @property
    def _compile_threads(self) -> int:
        return max(1, min(os.cpu_count() or 1, self.config.compile_threads))

    @property
    def start_programs(self) -> list[tuple]:
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
        if self.placement.mesh is not None:  # placed as a chained call's inputs are (arrays on the mesh): host arrays
            batch = jax.device_put(batch, self.placement.batch)  # would be another input type, another compile
        return batch

    def prefill_batch(self, chunks: list[tuple[Request, int]], size: int) -> Packed:
        """The prefill step's inputs: ``n`` more prompt tokens of each (request, n), packed and padded to ``size``
        tokens, as one array (one copy to the device)."""
        return pack(prefill_batch(chunks, size, self.config.max_prefill_seqs, self.layout.max_pages_per_seq,
                                  self.valid_vocab))

    # -- calls ---------------------------------------------------------------------------------------
    def prefill(self, chunks: list[tuple[Request, int]], buckets: list[int], greedy: bool = False) -> Sampled:
        """Queue one prefill step over ``chunks`` at the first built of ``buckets`` (``greedy``: every prompt the
        step ends samples greedily without logprobs or constraints: the greedy-only program where built); its
        samples stay on the device ([max_prefill_seqs] rows, one per chunk)."""
        self.apply_host_moves()
        keys = [("prefill", g, b) for b in buckets for g in dict.fromkeys((greedy, False))]
        key, program = next((k, p) for k in keys if (p := self.program(k)) is not None)
        sampled, self.pools, self.snapshots = program(self.weights, self.pools, self.snapshots,
                                                      self.prefill_batch(chunks, key[2]))
        self.runs[key] += 1
        return sampled

    def decode_choice(self, choices: list[tuple[Variant, int]]) -> tuple[Variant, int] | None:
        """The first built of ``choices`` ((variant, bucket), best first); None when none is."""
        return next(((v, b) for v, b in choices if self.program(("decode", *v, b)) is not None), None)

    def launch_decode(self, requests: list[Request], variant: Variant, size: int, after: DecodeCall | None = None,
                      first: FirstTokens | None = None, snapshot_ids: np.ndarray | None = None) -> DecodeCall:
        """Queue one decode call over ``requests`` with the built program of ``variant`` at bucket ``size``;
        ``after``: the call in flight for the same requests, whose outputs on the device are this call's inputs
        (the host neither waits for them nor copies them to the device); ``first``: prefill's unread samples, the
        last tokens of the requests it names; ``snapshot_ids`` [steps, size] i32: the snapshots each step writes
        (0: none; with a snapshot pool)."""
        self.apply_host_moves()
        batch = after.next_batch if after is not None else self.decode_batch(requests, size, first)
        if self.snapshots is not None and snapshot_ids is None:
            snapshot_ids = np.zeros((variant[1], size), np.int32)
        program = self.program(("decode", *variant, size))
        sampled, next_batch, self.pools, self.snapshots = program(self.weights, self.pools, self.snapshots, batch,
                                                                  snapshot_ids)
        self.runs[("decode", *variant, size)] += 1
        return DecodeCall(requests, variant, sampled, next_batch)

    def launch_forward(self, requests: list[Request], buckets: list[int],
                       after: DecodeCall | None = None) -> PendingSample | None:
        """Queue the forward of a one-step decode call over ``requests`` (``after``: chained after it, as in
        `launch_decode`) at the first of ``buckets`` whose forward and sample are both built; `launch_sample`
        queues its sample. None (nothing queued) when none is built."""
        if self.steps.split_decode is None:
            return None
        size = next((b for b in buckets if self.program(("decode_logits", b)) is not None
                     and self.program(("decode_sample", b)) is not None), None)
        if size is None:
            return None
        self.apply_host_moves()
        batch = after.next_batch if after is not None else self.decode_batch(requests, size)
        logits, self.pools = self.program(("decode_logits", size))(self.weights, self.pools, batch)
        self.runs["decode_logits", size] += 1
        return PendingSample(requests, logits, batch)

    def launch_sample(self, pending: PendingSample) -> DecodeCall:
        """Compute the next-token bitmask of each of ``pending``'s requests whose grammar is active (on the host,
        while the forward runs) and queue the sample with them."""
        size = pending.batch.tokens.shape[0]
        masks = np.zeros((size, mask_words(self.model.config.vocab_size)), np.int32)
        active = [i for i, r in enumerate(pending.requests) if r.grammar_active]
        fill_masks([pending.requests[i].grammar for i in active], masks, active)
        masked = np.zeros(size, np.bool_)
        masked[active] = True
        sampled, next_batch, self.pools = self.program(("decode_sample", size))(
            self.pools, pending.logits, pending.batch, masks, masked)
        self.runs["decode_sample", size] += 1
        return DecodeCall(pending.requests, (False, 1), sampled, next_batch)

    def score_prompt(self, prompt_ids: list[int], top_n: int) -> list[PromptLogprob | None] | None:
        """The prompt's logprobs (see `PromptScorer.score`); None while their program is being built."""
        return self.scorer.score(self.weights, prompt_ids, top_n)

    def apply_host_moves(self) -> None:
        """Queue the host tier's pending copies, before the device calls that could write what they read (pages
        and snapshots its evictions freed) or read what they write (the blocks a hit brings back)."""
        if self.host_tier is not None and self.host_tier.moves:
            moves, self.host_tier.moves = self.host_tier.moves, []
            self.pools, self.snapshots = self.host_moves.run(moves, self.program, self.pools, self.snapshots)
            read_pages, write_pages = self.host_moves.keys[:2]
            for move in moves:
                self.runs[read_pages if move.direction == "out" else write_pages] += 1

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
