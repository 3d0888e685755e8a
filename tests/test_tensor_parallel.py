"""Tensor parallelism on fake CPU devices: logits and greedy continuations equal to tp=1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hybrid_jax
import pallas_kernels.gemv as gemv_dispatch
from hybrid_jax.caches.dense import DenseCache
from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling_params import SamplingParams
from hybrid_jax.layers.projections import ShardedProjections
from hybrid_jax.sharding import linear_splits, make_mesh, shard_model

# Heads that split over 8 shards; 2 KV heads, so tp=4 and tp=8 store one expanded KV head per shard.
CONFIG = hybrid_jax.preset("tiny").replace(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=8, linear_value_head_dim=8,
    tie_word_embeddings=False)
IDS = jax.random.randint(jax.random.PRNGKey(0), (2, 70), 0, 512, jnp.int32)


def perturbed_model(seed=5):
    model = hybrid_jax.random_model(CONFIG, "float32", seed=seed)
    # Non-trivial norm weights so every parameter matters.
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "weight" and var.ndim == 1:
            var.set_value(var.get_value() + 0.2 * jax.random.normal(jax.random.PRNGKey(len(path)), var.shape))
    return model


@pytest.fixture(scope="module")
def reference_logits():
    return np.asarray(nnx.jit(lambda m, x: m(x))(perturbed_model(), IDS))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sharded_logits_equal_tp1(tp, reference_logits):
    model = perturbed_model()
    mesh = make_mesh(tp)
    shard_model(model, mesh)
    kernel = model.layers[0].linear_attn.in_proj_qkv.kernel.get_value()
    assert len(kernel.sharding.device_set) == tp
    logits = nnx.jit(lambda m, x: m(x))(model, IDS)
    np.testing.assert_allclose(logits, reference_logits, atol=1e-4 * np.abs(reference_logits).max(), rtol=0)


def greedy(tp):
    engine = Engine(perturbed_model(), EngineConfig(max_batch=4, max_model_len=128, page_size=16, prefill_chunk=32,
                                                    max_prefill_seqs=2, tensor_parallel_size=tp, decode_sizes=(4,),
                                                    prefill_sizes=(32,))).start(warmup=False)  # built as used
    try:
        prompts = [IDS[0, :40].tolist(), IDS[1, :7].tolist(), IDS[1, :33].tolist()]
        handles = [engine.submit(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts]
        return [[e.token_id for e in h] for h in handles]
    finally:
        engine.shutdown()


def test_engine_greedy_equal_across_tp():
    expected = greedy(1)
    assert greedy(2) == expected
    assert greedy(8) == expected


def test_padded_rows_under_a_mesh(monkeypatch):
    """On a GPU the steps pad their rows to the few-row kernel's 16, also per shard under a mesh."""
    import hybrid_jax.caches.paged as paged

    expected = greedy(1)
    monkeypatch.setattr(paged, "padded_rows", lambda n: max(n, 16))
    assert greedy(2) == expected


@pytest.mark.parametrize("field, value, tp", [("num_attention_heads", 6, 4), ("linear_num_key_heads", 4, 8)])
def test_heads_that_do_not_divide_are_rejected(field, value, tp):
    config = CONFIG.replace(**{field: value})
    model = hybrid_jax.random_model(config, "float32")
    with pytest.raises(ValueError, match=rf"{field}={value}.*tensor_parallel_size={tp}"):
        shard_model(model, make_mesh(tp))


def test_nothing_compiles_while_serving_sharded(compile_log):
    """Greedy calls chained on the device (each call's inputs are the last call's outputs, arrays on the mesh)
    and sampled ones: all compiled by the warm-up."""
    engine = Engine(perturbed_model(), EngineConfig(max_batch=2, max_model_len=128, page_size=16, prefill_chunk=32,
                                                    tensor_parallel_size=2, decode_steps=3, prefill_sizes=(32,),
                                                    decode_sizes=(2,))).start()
    assert engine.decode_steps == 1  # one step per call under a mesh (see Runner.__init__)
    prompts = [IDS[0, :40].tolist(), IDS[1, :7].tolist()]
    compile_log.clear()
    try:
        greedy = [engine.submit(p, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)) for p in prompts]
        sampled = engine.submit(prompts[1], SamplingParams(max_tokens=5, temperature=0.7, seed=3, ignore_eos=True))
        for handle, length in [(greedy[0], 9), (greedy[1], 9), (sampled, 5)]:
            events = list(handle)  # a failed step would end the stream early with finish_reason "error"
            assert events[-1].finish_reason == "length"
            assert len([e for e in events if e.token_id is not None]) == length
        assert compile_log.messages() == []
    finally:
        engine.shutdown()


def test_the_sharding_table_splits_each_linear_layer():
    model = perturbed_model()  # 2 KV heads < 4 shards: k/v projections stay whole
    attn, gdn, mlp = model.layers[3].self_attn, model.layers[0].linear_attn, model.layers[0].mlp
    split = linear_splits(model, 4)
    assert (split[id(attn.q_proj)], split[id(attn.k_proj)], split[id(attn.o_proj)]) == ("out", None, "in")
    assert (split[id(gdn.in_proj_qkv)], split[id(gdn.in_proj_b)], split[id(gdn.out_proj)]) == ("out", "out", "in")
    assert (split[id(mlp.gate_proj)], split[id(mlp.down_proj)]) == ("out", "in")


def test_per_shard_projection_kernel_matches_xla(monkeypatch):
    """The engine's projections under a mesh: the few-row kernel (interpret mode) on each shard's slice of the
    bf16 weights, row-parallel partial sums added over the shards, give the unsharded XLA logits (within the
    bf16 rounding of a different summation order, as tests/kernels/test_gemv_in_model.py)."""
    used = []

    def interpret_where_supported(op, impl, reason):
        used.append(reason is None)
        return True if reason is None else None

    want = np.asarray(nnx.jit(lambda m, x: m(x))(hybrid_jax.random_model(CONFIG, "bfloat16", seed=2), IDS[:, :4]))
    model = hybrid_jax.random_model(CONFIG, "bfloat16", seed=2)
    mesh = make_mesh(2)
    shard_model(model, mesh)
    monkeypatch.setattr(gemv_dispatch, "kernel_mode", interpret_where_supported)

    def forward(m, ids):
        cache = DenseCache(None, ShardedProjections(mesh, linear_splits(m, 2)))
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        x = m.decoder(m.embed_tokens(ids).astype(jnp.float32), positions, cache)
        return m.logits(m.norm(x, m.dtype))[0]

    got = np.asarray(nnx.jit(forward)(model, IDS[:, :4]), np.float32)
    # Every projection set: its narrow members (GDN's b and a, 8 columns a shard here, as at 0.8B/2B/27B and
    # tp=2) go to XLA's dot beside the kernel's launch for the rest.
    assert len(used) == 16 and all(used)
    np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=0.01 * np.abs(want).max(), rtol=0)
