"""Researchers differentiate the model: gradients flow through GDN (chunked form) and attention."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hybrid_jax


def test_gradients_are_finite_and_match_finite_differences():
    config = hybrid_jax.preset("tiny").replace(vocab_size=64)
    model = hybrid_jax.random_model(config, "float32", seed=2)
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 70), 0, 64, jnp.int32)  # crosses a 64-token chunk

    def loss(m):
        logp = jax.nn.log_softmax(m(ids[:, :-1]), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    grads = nnx.jit(nnx.grad(loss))(model)  # jitted, as researchers run it (op by op is ~3x slower here)
    leaves = jax.tree.leaves(nnx.to_pure_dict(grads))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    gdn_grad = grads.layers[0].linear_attn.A_log[...]
    assert np.abs(np.asarray(gdn_grad)).max() > 0

    # Directional finite difference along the A_log gradient of the first GDN layer.
    eps = 1e-3
    a_log = model.layers[0].linear_attn.A_log
    base = a_log.get_value()
    direction = gdn_grad / jnp.linalg.norm(gdn_grad)
    a_log.set_value(base + eps * direction)
    up = nnx.jit(loss)(model)
    a_log.set_value(base - eps * direction)
    down = nnx.jit(loss)(model)
    a_log.set_value(base)
    np.testing.assert_allclose((up - down) / (2 * eps), jnp.vdot(gdn_grad, direction), rtol=2e-2)
