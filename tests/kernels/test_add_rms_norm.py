"""The fused residual add + RMSNorm kernel against its reference: interpret mode on CPU, compiled on a GPU.

Random inputs (never zeros): 1, 5 and 33 rows, widths of one chunk (64), several power-of-two chunks (2560 =
5 x 512, 5120 = 5 x 1024: the 4B and 27B hidden sizes), a bf16 and an fp32 delta, and no delta at all.
Tolerances: the sum is the same fp32 addition in both (exact); the normed rows differ only in the order of
the fp32 sum of squares (fp32 output: rtol 1e-5; bf16 output: one bf16 ulp).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.add_rms_norm import add_rms_norm

ON_GPU = jax.default_backend() == "gpu"
IMPL = "kernel" if ON_GPU else "interpret"
EPS = 1e-6


def _inputs(seed, rows, d, delta_dtype):
    kx, kd, kw = jax.random.split(jax.random.key(seed), 3)
    x = 3.0 * jax.random.normal(kx, (rows, d), jnp.float32)
    delta = None if delta_dtype is None else jax.random.normal(kd, (rows, d), delta_dtype)
    weight = 0.1 * jax.random.normal(kw, (d,), jnp.bfloat16)
    return x, delta, weight


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("d", [64, 2560, 5120])
@pytest.mark.parametrize("delta_dtype", [jnp.bfloat16, jnp.float32, None])
def test_matches_reference(rows, d, delta_dtype):
    x, delta, weight = _inputs(rows + d, rows, d, delta_dtype)
    total, normed = add_rms_norm(x, delta, weight, EPS, jnp.float32, impl=IMPL)
    want_total, want_normed = add_rms_norm(x, delta, weight, EPS, jnp.float32, impl="reference")
    assert total.dtype == jnp.float32 and total.shape == normed.shape == (rows, d)
    np.testing.assert_array_equal(total, want_total)
    np.testing.assert_allclose(normed, want_normed, rtol=1e-5, atol=1e-5)


def test_bf16_output_and_leading_axes():
    x, delta, weight = _inputs(7, 6, 256, jnp.bfloat16)
    x, delta = x.reshape(2, 3, 256), delta.reshape(2, 3, 256)
    total, normed = add_rms_norm(x, delta, weight, EPS, jnp.bfloat16, impl=IMPL)
    want_total, want_normed = add_rms_norm(x, delta, weight, EPS, jnp.bfloat16, impl="reference")
    assert normed.shape == (2, 3, 256) and normed.dtype == jnp.bfloat16
    np.testing.assert_array_equal(total, want_total)
    np.testing.assert_allclose(normed.astype(np.float32), want_normed.astype(np.float32), rtol=2**-7, atol=2**-7)


def test_reference_is_the_models_norm():
    """The reference is the decoder's own `x + h` then `RMSNorm`: what the engine's fused path replaces."""
    from hybrid_jax.layers.norm import RMSNorm

    x, delta, weight = _inputs(3, 4, 128, jnp.bfloat16)
    norm = RMSNorm(128, EPS, jnp.bfloat16)
    norm.weight.set_value(weight)
    total, normed = add_rms_norm(x, delta, weight, EPS, jnp.bfloat16, impl="reference")
    np.testing.assert_array_equal(total, x + delta)
    np.testing.assert_array_equal(normed, norm(x + delta, jnp.bfloat16))


def test_auto_falls_back_beyond_its_shapes():
    x, delta, weight = _inputs(0, 2, 40, jnp.bfloat16)  # 40 columns: power-of-two chunks of 8 only
    np.testing.assert_array_equal(add_rms_norm(x, delta, weight, EPS, jnp.float32)[1],
                                  add_rms_norm(x, delta, weight, EPS, jnp.float32, impl="reference")[1])
    with pytest.raises(ValueError, match="D = 40"):
        add_rms_norm(x, delta, weight, EPS, jnp.float32, impl="interpret")
