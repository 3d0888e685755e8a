"""The gated attention's output gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_gate(o: jax.Array, gate: jax.Array) -> jax.Array:
    """o * sigmoid(gate) in gate's dtype, rounded as HF's bf16 attention: o and the sigmoid to that dtype, then
    the product. The roundings are `reduce_precision`s, which XLA keeps (it may drop a convert pair)."""
    bits = jnp.finfo(gate.dtype)
    keep = lambda v: jax.lax.reduce_precision(v, exponent_bits=bits.nexp, mantissa_bits=bits.nmant)
    return (keep(o.astype(jnp.float32)) * keep(jax.nn.sigmoid(gate.astype(jnp.float32)))).astype(gate.dtype)
