"""The model's projections through the few-row kernels (compiled on a GPU, interpret mode on CPU) give the XLA
path's logits.

`few_row_kernel()` is what the engine's steps trace under; here the dispatch is made to pick the kernel
wherever it would on a GPU (the MLP's gate/up through the fused SwiGLU kernel). bf16 weights:
the two paths round the same fp32 sums to bf16 in a different summation order (bound: 1% of the largest
logit).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import hybrid_jax
import pallas_kernels.gemv as gemv_dispatch
import pallas_kernels.gemv.kernel as gemv_kernel
from hybrid_jax.config import preset
from hybrid_jax.layers.linear import few_row_kernel


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
    monkeypatch.setitem(gemv_kernel.SWIGLU_TUNING, mlp, gemv_kernel.SWIGLU_DEFAULT)
    with few_row_kernel():
        got, _ = jax.jit(model.forward)(ids, positions)
    assert used and all(ok for _, ok in used)  # every projection set went through a kernel
    assert {op for op, _ in used} == {"gemv", "gemv_swiglu"}
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.01 * scale)
