"""The model's projections through the few-row kernels (compiled on a GPU, interpret mode on CPU) give the XLA
path's logits.

`FewRowProjections` are what the engine's steps project with; here the dispatch is made to pick the kernel
wherever it would on a GPU (the MLP's gate/up through the fused SwiGLU kernel). bf16 weights:
the two paths round the same fp32 sums to bf16 in a different summation order (bound: 1% of the largest
logit). The engine's decode step with `gemv_add` and the norms it defers, against the weights in fp32.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybrid_jax
import pallas_kernels.gemv as gemv_dispatch
import pallas_kernels.gemv.kernel as gemv_kernel
import pallas_kernels.gemv.tiles as gemv_tiles
from hybrid_jax.caches.dense import DenseCache
from hybrid_jax.config import preset
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.layers.projections import FewRowProjections, XlaProjections


class KernelProjections(FewRowProjections):
    """The few-row kernels for the projection sets and the SwiGLU; the residual adds as XLA's."""

    add_projection = XlaProjections.add_projection


def forward(model, ids, positions):
    """The model's logits with its projections through `KernelProjections`."""
    x = model.decoder(model.embed_tokens(ids).astype(jnp.float32), positions, DenseCache(None, KernelProjections()))
    return model.logits(model.norm(x, model.dtype))[0]


def test_decode_logits_match_xla_dots(monkeypatch):
    config = dataclasses.replace(preset("tiny"), linear_num_value_heads=16, vocab_size=512)
    model = hybrid_jax.random_model(config, "bfloat16", seed=1)
    ids = jnp.asarray([[5, 17, 300, 41]])
    positions = jnp.arange(4)[None]
    want, _ = model.forward(ids, positions)
    used = []

    def kernel_where_supported(op, impl, reason):  # compiled on a GPU, interpreted elsewhere
        used.append((op, reason is None))
        return jax.default_backend() != "gpu" if reason is None else None

    monkeypatch.setattr(gemv_dispatch, "kernel_mode", kernel_where_supported)
    mlp = (config.hidden_size, config.intermediate_size)  # the fused gate/up + SwiGLU kernel as a GPU tuned for it
    monkeypatch.setitem(gemv_tiles.SWIGLU.on(), mlp, gemv_tiles.SWIGLU.default)
    got = jax.jit(forward)(model, ids, positions)
    assert used and all(ok for _, ok in used)  # every projection set went through a kernel
    assert {op for op, _ in used} == {"gemv", "gemv_swiglu"}
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.01 * scale)


@pytest.mark.parametrize("ops", [{"gemv_add"}, {"gemv_add", "gemv", "gemv_swiglu"}])
def test_engine_adds_projections_through_the_kernel(monkeypatch, ops):
    """The engine's steps add each output and down projection to the residual stream with `gemv_add` (tiles
    small enough here for 8 K-splits, summed by whichever program arrives last), which also writes the next
    RMS norm with its division deferred to the decode step's projections after it (on the kernels or, with
    `gemv_add` alone, in XLA). That rounds the norm's output before the division, where HF rounds after it: as
    accurate, not the same bits. So against the same weights in fp32: the same greedy tokens as the XLA bf16
    path, and the top alternatives' log-probabilities off by at most twice as much as that path's (0.9-1.5x
    on the mean over seeds 1-3)."""
    config = dataclasses.replace(preset("tiny"), linear_num_value_heads=16, vocab_size=512)
    model = hybrid_jax.random_model(config, "bfloat16", seed=1)
    graph, state = nnx.split(model)
    model_fp32 = nnx.merge(graph, jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a,
                                               state))
    prompts = [[5, 17, 300, 41], list(range(100, 121))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=5)

    def generate(model=model):
        engine = Engine(model, EngineConfig(max_batch=2, max_model_len=64, page_size=16, prefill_chunk=32,
                                            prefill_sizes=(32,), decode_sizes=(2,), max_prefill_seqs=2,
                                            num_pages=16))  # not sized from free memory: a GPU holds 4
        engine.start(warmup=False)  # builds only the programs it runs
        try:
            handles = [engine.submit(p, params) for p in prompts]
            events = [[e for e in h if e.token_id is not None] for h in handles]
            # The top alternatives too: this random model is nearly sure of its tokens, their own logprobs ~0.
            return ([[e.token_id for e in es] for es in events],
                    np.asarray([[[lp for _, lp in e.top_logprobs] for e in es] for es in events]))
        finally:
            engine.shutdown()

    exact_tokens, exact_logprobs = generate(model_fp32)
    want_tokens, want_logprobs = generate()
    used, normed = [], []

    def only(op, impl, reason):  # the other projections keep XLA's dots
        used.append((op, reason is None))
        return jax.default_backend() != "gpu" if op in ops and reason is None else None

    def counting_norms(fn):
        def run(*args, **kw):
            normed.append(len(args) > 3 and args[3] is not None)
            return fn(*args, **kw)
        return run

    monkeypatch.setattr(gemv_dispatch, "kernel_mode", only)
    monkeypatch.setattr(gemv_dispatch.kernel, "gemv_add", functools.partial(
        gemv_kernel.gemv_add, block_k=16, block_n=16, target_programs=64))
    for name in ("gemv", "gemv_swiglu"):
        monkeypatch.setattr(gemv_dispatch.kernel, name, counting_norms(getattr(gemv_kernel, name)))
    mlp = (config.hidden_size, config.intermediate_size)
    monkeypatch.setitem(gemv_tiles.SWIGLU.on(), mlp, gemv_tiles.SWIGLU.default)
    got_tokens, got_logprobs = generate()
    assert {op for op, ok in used if ok} >= ops
    assert any(normed) == (ops != {"gemv_add"})  # the norms went through the kernels' loads
    assert got_tokens == want_tokens == exact_tokens
    error = lambda logprobs: float(np.mean(np.abs(logprobs - exact_logprobs)))  # k-th best against k-th best
    assert 0 < error(got_logprobs) <= 2 * error(want_logprobs)
