"""The engine: one thread owns the device and runs FCFS continuous batching over the hybrid cache.

Requests are admitted when their whole lifetime fits (a state slot plus KV pages for prompt + max_tokens),
prefilled in chunks under a per-step token budget, then decoded together in fixed-shape batch buckets. The
`Scheduler` decides each step from request state alone; the `Runner` owns the weights, the pools and the
compiled programs and queues the steps on the device; the loop here joins the two, ordering the device's
work ahead of the host's reads. Requests with a grammar (structured outputs) need the host between steps: while
one decodes, the batch runs a step per call, its masks computed while the step's forward runs (see
`_decode_stepwise`).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

from hybrid_jax.compilation_cache import ExecutableDir
from hybrid_jax.engine.cache import BlockAllocator, memory_report
from hybrid_jax.engine.calls import DecodeCall, FirstTokens, host_samples
from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.grammar import GrammarCompiler, GrammarError, GrammarState
from hybrid_jax.engine.prefix_cache import PrefixCache
from hybrid_jax.engine.requests import QueueFullError, Request, RequestHandle, ThinkingEnd, TokenEvent
from hybrid_jax.engine.runner import Runner
from hybrid_jax.engine.sampling_params import MAX_MIN_TOKENS_STOPS, SamplingParams
from hybrid_jax.engine.scheduler import Scheduler, Variant
from hybrid_jax.model import Qwen35ForCausalLM
from hybrid_jax.tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "QueueFullError", "Request", "RequestHandle", "TokenEvent"]

log = logging.getLogger("hybrid_jax.engine")


class Engine:
    """Owns the scheduler, the runner and the engine thread."""

    def __init__(self, model: Qwen35ForCausalLM, config: EngineConfig = EngineConfig(), *,  # noqa: B008 (frozen)
                 eos_token_ids: tuple[int, ...] = (), think_token_ids: tuple[int, int] | None = None,
                 valid_vocab: int | None = None, executable_dir: ExecutableDir | str | os.PathLike | None = None,
                 tokenizer: Tokenizer | None = None):
        """``executable_dir``: keep the compiled programs there (see `programs.ExecutableStore`; a bare path has
        the default size limit). ``model`` may be abstract (shape-only parameters, as `weights.abstract_model`
        makes): its programs can be built (`prepare_programs`) while the weights load, and `attach` gives it the
        loaded model before `start`.
        ``think_token_ids``: the (start, end) tokens of a think block; a request's thinking_token_budget applies
        when its prompt leaves one open. ``tokenizer``: what grammars are compiled against (None: requests with
        structured_outputs are refused)."""
        self.config = config
        self.think_token_ids = think_token_ids
        self.runner = Runner(model, config, valid_vocab=valid_vocab, executable_dir=executable_dir,
                             grammars=tokenizer is not None)
        layout = self.runner.layout
        pages = BlockAllocator(layout.num_pages)
        prefix = None
        if layout.num_snapshots:
            prefix = PrefixCache(config.prefix_block, layout.page_size, pages, BlockAllocator(layout.num_snapshots),
                                 config.snapshot_stride, host=self.runner.host_tier)
        log.info("start-up: %s", memory_report(layout, model.config, model.dtype, model.config.vocab_size,
                                               config.tensor_parallel_size))
        log.info("prefix caching: %s", f"on, blocks of {config.prefix_block} tokens, a snapshot every "
                 f"{config.snapshot_stride} blocks and at a prompt's last boundaries" if prefix is not None else "off")
        self.scheduler = Scheduler(config, BlockAllocator(layout.num_slots), pages, page_size=layout.page_size,
                                   decode_steps=self.runner.decode_steps, eos_token_ids=eos_token_ids,
                                   prefix=prefix)
        self._reset_prefix = threading.Event()  # a reset of the prefix cache the engine thread has yet to do
        self.runner.scorer.on_built = self.scheduler.wake
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer, model.config.vocab_size,
                                                                        eos_token_ids)
        self._inflight: DecodeCall | None = None
        self._first: FirstTokens | None = None
        self._ids = itertools.count()
        self._seeds = np.random.default_rng()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- public API ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               cache_salt: str | None = None) -> RequestHandle:
        """Queue a request; raises ValueError if it can never fit, QueueFullError when the queue is full.
        ``cache_salt``: the prefix cache shares blocks only among requests with the same salt (vLLM's)."""
        params.validate()
        vocab = self.runner.model.config.vocab_size
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        self._check_token_ids(params)
        stops = self._min_tokens_stops(params)
        self.scheduler.check(len(prompt_ids), params.max_tokens)
        # The step reads seeds as uint32: any integer seed maps into that range (negative or > 2**32 too).
        seed = params.seed % 2**32 if params.seed is not None else int(self._seeds.integers(0, 2**31))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt: must be a non-empty string if given")
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, seed,
                          min_tokens_stops=stops, thinking_end=self._thinking_end(prompt_ids, params),
                          grammar=self._grammar(prompt_ids, params), cache_salt=cache_salt)
        self.scheduler.put(request)
        return RequestHandle(request, self.cancel)

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Raise ValueError naming the field whose token ids are past the vocabulary (or untokenized)."""
        if params.bad_words and not params.bad_words_token_ids:
            raise ValueError("bad_words: not tokenized (SamplingParams.update_from_tokenizer)")
        vocab = self.runner.valid_vocab
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("bad_words", [t for sequence in params.bad_words_token_ids for t in sequence])):
            if past := [t for t in ids if t >= vocab]:
                raise ValueError(f"{name}: token id {past[0]} is out of the vocabulary [0, {vocab})")

    def _min_tokens_stops(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens held back until min_tokens: eos (unless ignored) and the stop tokens."""
        if not params.min_tokens:
            return ()
        eos = () if params.ignore_eos else sorted(self.scheduler.eos_token_ids)
        stops = tuple(dict.fromkeys([*eos, *params.stop_token_ids]))
        if len(stops) > MAX_MIN_TOKENS_STOPS:
            raise ValueError(f"min_tokens: at most {MAX_MIN_TOKENS_STOPS} eos and stop_token_ids can be held back, "
                             f"got {len(stops)}")
        return stops

    def _opens_think(self, prompt_ids: list[int]) -> bool:
        """The prompt leaves a think block open."""
        if self.think_token_ids is None:
            return False
        start, end = self.think_token_ids
        return next((t for t in reversed(prompt_ids) if t in (start, end)), None) == start

    def _thinking_end(self, prompt_ids: list[int], params: SamplingParams) -> ThinkingEnd | None:
        """The forced end of the think block the prompt leaves open, under the request's thinking budget."""
        if params.thinking_token_budget is None or not self._opens_think(prompt_ids):
            return None
        return ThinkingEnd(self.think_token_ids[1], params.thinking_token_budget)

    def compile_grammar(self, params: SamplingParams):
        """A fresh matcher for ``params.structured_outputs`` (compiled, or copied from the cache); GrammarError
        when it is invalid or too slow to compile, ValueError when this engine has no tokenizer for grammars."""
        if self.grammars is None:
            raise ValueError("structured_outputs: this engine was built without a tokenizer for grammars")
        return self.grammars.compile(params.structured_outputs)

    def _grammar(self, prompt_ids: list[int], params: SamplingParams) -> GrammarState | None:
        """The request's grammar state, starting after the think block its prompt opens (if any)."""
        if params.structured_outputs is None:
            return None
        try:
            matcher = self.compile_grammar(params)
        except GrammarError as e:
            raise ValueError(f"structured_outputs: {e}") from e
        return GrammarState(matcher, self.think_token_ids[1] if self._opens_think(prompt_ids) else None)

    def cancel(self, request: Request) -> None:
        self.scheduler.cancel(request)

    def start(self, warmup: bool = True) -> Engine:
        if not self.runner.weights_loaded:
            raise RuntimeError("start: the engine's model is abstract; attach the loaded model first")
        if warmup:
            self.warmup()
        else:  # programs compile on first use
            self.runner.ensure_pools()
        self._thread = threading.Thread(target=self._loop, name="hybrid-jax-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop the engine thread and the background compiles (waiting for the compiles under way)."""
        self._stop.set()
        self.scheduler.wake()
        self.runner.programs.stop(timeout=30)
        if self._thread:
            self._thread.join(timeout=30)

    def reset_prefix_cache(self) -> None:
        """Evict every cached prefix block no request holds (on the engine thread, before its next step)."""
        self._reset_prefix.set()
        self.scheduler.wake()

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "programs_pending": self.runner.programs.pending,
                "programs_first_runs_pending": self.runner.first_runs_pending(), **self.scheduler.counters}

    def warmup(self) -> None:
        """Build and run once every program start needs (see `Runner.warmup`)."""
        self.runner.warmup()

    def prepare_programs(self) -> None:
        """Load or compile the programs start needs and allocate the pools (see `Runner.prepare_programs`)."""
        self.runner.prepare_programs()

    def load_stored_programs(self) -> bool:
        """Load the stored programs start needs; True when none is missing (see `Runner.load_stored_programs`)."""
        return self.runner.load_stored_programs()

    def release(self) -> None:
        """Free the pools' device memory (see `Runner.release`)."""
        self.runner.release()

    def lower_start_programs(self, until: Callable[[], bool] | None = None) -> None:
        """Trace and lower the missing programs start needs, from the model's shapes alone, until ``until()`` (see
        `Runner.lower_start_programs`)."""
        self.runner.lower_start_programs(until)

    def attach(self, model: Qwen35ForCausalLM) -> None:
        """Give an engine built over an abstract model the loaded one (same config, shapes and dtypes)."""
        self.runner.attach(model)

    def launch_decode(self, requests: list[Request], variant: Variant, after: DecodeCall | None = None,
                      first: FirstTokens | None = None) -> DecodeCall | None:
        """Queue one decode call over admitted ``requests`` at their bucket (``after``'s, chained after it),
        with ``variant`` or a plainer one while it is not built, and the output snapshots its steps write; None
        when ``after``'s bucket has none built."""
        s = self.scheduler
        choice = self.runner.decode_choice(s.decode_choices(variant, len(requests),
                                                            after.size if after is not None else None))
        if choice is None:
            return None
        variant, size = choice
        if after is None:
            positions = s.decode_positions(requests, first.requests if first is not None else ())
        else:
            positions = after.positions + after.steps if after.positions is not None else None
        plan, ids = [], None
        if s.output_snapshots is not None and positions is not None:
            plan, ids = s.output_snapshots.plan(requests, positions, variant[1], size)
        call = self.runner.launch_decode(requests, variant, size, after=after, first=first, snapshot_ids=ids)
        return call._replace(positions=positions, snapshots=plan)

    # What scripts and tests read of the parts.
    pools = property(lambda self: self.runner.pools)
    programs = property(lambda self: self.runner.programs)
    layout = property(lambda self: self.runner.layout)
    decode_steps = property(lambda self: self.runner.decode_steps)
    pages = property(lambda self: self.scheduler.pages)
    slots = property(lambda self: self.scheduler.slots)

    # -- the engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        s = self.scheduler
        while not self._stop.is_set():
            s.take_arrivals(block=s.idle and not self._can_score() and not self._can_run_first())
            with s.holding_events():  # handed out once the turn's decode call is queued, and at its end
                self._turn()
            if self._can_run_first():
                self.runner.run_first_pending()

    def _turn(self) -> None:
        """One turn of the loop after the arrivals: cancellations, a prefix cache reset, scoring, admission,
        then the prefill step and the decode call."""
        s = self.scheduler
        s.reap_cancelled()
        if self._reset_prefix.is_set():
            self._reset_prefix.clear()
            s.reset_prefix_cache()
        self._score()
        try:
            s.admit()
            if s.prefilling:
                self._prefill()
            if s.decoding or self._inflight:
                self._decode()
        except Exception as e:  # a failed step ends its requests, never the server
            log.exception("engine step failed")
            self._inflight = self._first = None
            s.fail_running(e)

    def _can_run_first(self) -> bool:
        """Whether the engine idles with a program built in the background that has not run yet: its first run
        (`Runner.run_once`) goes now, one program per turn of the loop, so an arrival waits for one at most."""
        return self.scheduler.idle and self._inflight is None and self.runner.first_runs_pending() > 0

    def _can_score(self) -> bool:
        """Whether the first request waiting for its prompt logprobs can be scored now (its program is built)."""
        s = self.scheduler
        return bool(s.scoring) and self.runner.scorer.ready(len(s.scoring[0].prompt_ids))

    def _score(self) -> None:
        """Compute the prompt logprobs of the first request that waits for them, unless their program is still
        being built in the background (the build wakes the loop when done)."""
        s = self.scheduler
        if not s.scoring:
            return
        r = s.scoring[0]
        try:
            logprobs = self.runner.score_prompt(r.prompt_ids, r.params.prompt_logprobs)
        except Exception as e:  # a failed scoring ends its request, never the server
            log.exception("scoring a prompt failed")
            s.fail_scoring(r, e)
            return
        if logprobs is not None:
            s.scored(r, logprobs)

    def _prefill(self) -> None:
        chunks = self.scheduler.prefill_chunks()
        # Only a prompt ending in this step keeps its sample (its first token, under its grammar's first mask):
        # the step runs greedy-only when those all sample greedily (a fill's sample is never read).
        ending = [r for r, n in chunks if r.num_prefilled + n == len(r.prompt_ids) and not r.fill]
        self.runner.write_grammar_masks([r for r in ending if r.grammar_active])
        sampled = self.runner.prefill(chunks, self.scheduler.prefill_buckets(chunks),
                                      self.scheduler.greedy_only(ending))
        done, rows = self.scheduler.prefilled(chunks)
        self.scheduler.cache_prefilled(chunks)
        if done:  # read by `_decode`, after it queues the first decode call over them
            self._first = FirstTokens(done, rows, sampled)

    def _decode(self) -> None:
        """Queue the next decode call, then hand out the samples of the call before it.

        While the decoding requests stay the same, each call takes its inputs from the previous call's outputs
        on the device and is queued before the host reads that output: the device runs call after call while
        the host delivers tokens. Likewise the first call after a prefill takes the prompts' first tokens from
        prefill's output on the device, and is queued before the host reads them. A call that runs past a
        request's end (eos, max_tokens, cancel) computes rows the host discards; positions past a request's
        pages write to the null page.
        """
        s = self.scheduler
        if any(r.grammar is not None for r in s.decoding):
            self._decode_stepwise()
            return
        previous, self._inflight = self._inflight, None
        first, self._first = self._first, None
        greedy = s.greedy_only(s.decoding)
        chain = None
        if first is None and previous is not None:
            chain = s.chained(previous.requests, previous.steps, greedy)
        if chain is not None:
            self._inflight = self.launch_decode(*chain, after=previous)
            if self._inflight is not None:
                s.send_held()  # the device has its next call (the turn's cancellations may have events)
                self._deliver(previous)
                return
        if previous is not None:
            self._deliver(previous)
        call = s.unchained(greedy, first.requests if first is not None else ())
        if call is not None:
            self._inflight = self.launch_decode(*call, first=first)
        s.send_held()  # the device has its next call: wake the callers now, not after prefill's tokens are read
        if first is not None:
            s.deliver(first.requests, host_samples(first.sampled, first.requests), first.rows)

    def _decode_stepwise(self) -> None:
        """A decode call of one step over a batch with grammar rows: each row's next mask depends on the token
        just sampled. The call's forward is queued first (chained after the call in flight when the requests
        stay the same); then the host reads the samples before it (and prefill's first tokens), its matchers
        consume them, and the masks are computed while the forward runs; then the sample is queued with them.
        Until the forward and sample programs are built, the whole step runs after the masks, written into the
        pools. Rows whose think block is still open are unconstrained, but wait for the host the same way (the
        step after their end-of-think token is masked)."""
        s, runner = self.scheduler, self.runner
        previous, self._inflight = self._inflight, None
        first, self._first = self._first, None
        pending = None
        if previous is not None and first is None and s.chained(previous.requests, previous.steps, False):
            pending = runner.launch_forward(previous.requests, [previous.size], after=previous)
        if previous is not None:
            self._deliver(previous)
        if first is not None:
            s.deliver(first.requests, host_samples(first.sampled, first.requests), first.rows)
        if pending is None:
            call = s.unchained(False)
            if call is None:
                return
            pending = runner.launch_forward(call[0], s.decode_buckets(len(call[0])))
            if pending is None:
                runner.write_grammar_masks([r for r in call[0] if r.grammar_active])
                self._inflight = self.launch_decode(*call)
                return
        self._inflight = runner.launch_sample(pending)

    def _deliver(self, call: DecodeCall) -> None:
        """Hand out each step's samples, caching first the output blocks whose snapshot that step wrote (their
        tokens are all out before the step's own sample)."""
        s = self.scheduler
        for step, sampled in enumerate(self.runner.read(call)):
            if planned := [p for p in call.snapshots if p.step == step]:
                s.output_snapshots.cache(planned)
            s.deliver(call.requests, sampled)
