"""Pure-JAX references of the few-row matmul (x times each weight) and of the SwiGLU product the fused gate/up
kernel writes."""

import jax
import jax.numpy as jnp


def gemv(x: jax.Array, weights: tuple[jax.Array, ...], out_dtype=None) -> tuple[jax.Array, ...]:
    """x [..., K] times each w [K, N_i] -> ([..., N_i], ...) in ``out_dtype`` (default: each weight's dtype)."""
    return tuple(jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype or w.dtype)
                 for w in weights)


def gemv_add(x: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array:
    """residual + x w: x [..., K], w [K, N], residual [..., N] -> [..., N] fp32; the product rounded to w's dtype
    first, as a projection's output is."""
    return residual.astype(jnp.float32) + gemv(x, (w,))[0].astype(jnp.float32)


def swiglu_product(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up rounded as HF's bf16 MLP rounds it: gate and up, then the SiLU, to the inputs' dtype,
    then the product. The roundings are `reduce_precision`s, which XLA keeps: a convert to bf16 and back it
    may drop (excess precision), and on the GPU it did, moving a tiny model's logits by 1.5%."""
    bits = jnp.finfo(gate.dtype)
    keep = lambda v: jax.lax.reduce_precision(v, exponent_bits=bits.nexp, mantissa_bits=bits.nmant)
    act = keep(jax.nn.silu(keep(gate.astype(jnp.float32))))
    return (act * keep(up.astype(jnp.float32))).astype(gate.dtype)

