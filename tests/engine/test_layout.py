"""The cache layout: planned from the device's memory limit and the weights' size, so an engine over an abstract
model (start-up with stored programs) and one over the loaded model plan the same pools."""

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import preset
from hybrid_jax.engine import cache
from hybrid_jax.loader import random_model
from hybrid_jax.weights import abstract_model


def test_weight_bytes_same_abstract_and_loaded():
    config = preset("tiny")
    loaded = jax.tree.leaves(nnx.state(random_model(config, "float32", 0)))
    abstract = jax.tree.leaves(nnx.state(abstract_model(config, jnp.dtype("float32"))))
    assert cache.weight_device_bytes(abstract) == cache.weight_device_bytes(loaded) == sum(w.nbytes for w in loaded)


def test_plan_from_the_memory_limit(monkeypatch):
    config = preset("tiny")
    monkeypatch.setattr(cache, "device_memory_limit", lambda: 2**30)
    plan = lambda weight_bytes, share=0.0: cache.plan_layout(
        config, jnp.float32, config.vocab_size, max_batch=4, max_model_len=256, page_size=16,
        memory_utilization=0.5, weight_bytes=weight_bytes, snapshot_share=share)
    assert plan(2**28) == plan(2**28)
    assert plan(2**28).num_pages > plan(2**29).num_pages  # the weights' share is taken first
    with_snapshots = plan(2**28, share=0.25)
    assert with_snapshots.num_snapshots > 1 and with_snapshots.num_pages < plan(2**28).num_pages


def test_memory_report_gives_the_pools_in_tokens_snapshots_and_gib():
    config = preset("tiny")
    layout = cache.CacheLayout(num_pages=101, page_size=16, num_slots=5, max_pages_per_seq=16, num_snapshots=9)
    report = cache.memory_report(layout, config, jnp.float32, config.vocab_size)
    kv_gib = 100 * cache.page_bytes(config, jnp.float32, 16) / 2**30
    snapshot_gib = 8 * cache.snapshot_bytes(config, jnp.float32, config.vocab_size) / 2**30
    assert report == (f"KV cache: 100 pages of 16 tokens (1,600 tokens, {kv_gib:.2f} GiB), shared by running "
                      f"requests and cached prefix blocks; 8 GDN state snapshots ({snapshot_gib:.2f} GiB)")
    off = cache.memory_report(cache.CacheLayout(101, 16, 5, 16), config, jnp.float32, config.vocab_size, tp=2)
    assert off.startswith("KV cache: 100 pages of 16 tokens (1,600 tokens, ") and off.endswith("GiB per device)")
