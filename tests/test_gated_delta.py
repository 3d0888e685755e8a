"""Parity between the three pure-JAX gated-delta-rule forms: scan (oracle), chunked, one-step decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.math.gated_delta import gated_delta_chunked, gated_delta_scan, gated_delta_step


def random_inputs(seed, b, t, hk, hv, dk, dv):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    l2 = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q = l2(jax.random.normal(ks[0], (b, t, hk, dk))) * dk**-0.5
    k = l2(jax.random.normal(ks[1], (b, t, hk, dk)))
    v = jax.random.normal(ks[2], (b, t, hv, dv))
    g = -jax.nn.softplus(2 * jax.random.normal(ks[3], (b, t, hv)))  # decays spread over (0, 1)
    beta = jax.nn.sigmoid(2 * jax.random.normal(ks[4], (b, t, hv)))
    state = jax.random.normal(ks[5], (b, hv, dk, dv))
    return q, k, v, g, beta, state


# (batch, tokens, Hk, Hv, dk, dv): chunk boundaries 63/64/65, grouped heads, dk != dv.
CASES = [(1, 1, 2, 2, 16, 16), (2, 63, 2, 4, 16, 24), (1, 64, 1, 3, 8, 8), (2, 65, 2, 2, 32, 16),
         (1, 200, 2, 4, 16, 16)]


@pytest.mark.parametrize("shape", CASES)
def test_chunked_matches_scan(shape):
    args = random_inputs(0, *shape)
    o_ref, s_ref = gated_delta_scan(*args)
    o, s = gated_delta_chunked(*args)
    np.testing.assert_allclose(o, o_ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, s_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("shape", CASES[:3])
def test_step_matches_scan(shape):
    q, k, v, g, beta, state = random_inputs(1, *shape)
    o_ref, s_ref = gated_delta_scan(q, k, v, g, beta, state)
    step = jax.jit(gated_delta_step)
    outs = []
    for t in range(q.shape[1]):
        o, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    np.testing.assert_allclose(jnp.stack(outs, 1), o_ref, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(state, s_ref, atol=1e-5, rtol=1e-4)


def test_chunked_carries_state_across_calls():
    q, k, v, g, beta, state = random_inputs(2, 1, 150, 2, 4, 16, 16)
    o_all, s_all = gated_delta_chunked(q, k, v, g, beta, state)
    o1, s1 = gated_delta_chunked(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], state)
    o2, s2 = gated_delta_chunked(q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], s1)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o_all, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s2, s_all, atol=2e-5, rtol=1e-4)


def test_grouping_is_consecutive():
    """Value head j reads key head j // (Hv/Hk): with Hk=2, Hv=4, heads 0,1 use key 0 and 2,3 use key 1."""
    q, k, v, g, beta, state = random_inputs(3, 1, 5, 2, 4, 8, 8)
    o, _ = gated_delta_scan(q, k, v, g, beta, state)
    for j in range(4):
        sl = slice(j, j + 1)
        kj = j // 2
        o_j, _ = gated_delta_scan(q[:, :, kj:kj + 1], k[:, :, kj:kj + 1], v[:, :, sl], g[:, :, sl],
                                  beta[:, :, sl], state[:, sl])
        np.testing.assert_allclose(o[:, :, sl], o_j, atol=1e-6)
