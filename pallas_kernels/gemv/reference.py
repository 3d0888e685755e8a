"""Pure-JAX references of the few-row matmul (x times each weight), of the SwiGLU product the fused gate/up
kernel writes, and of the RMS norm the kernels apply to x as they load it (from `gemv_add`'s sums of squares)."""

import jax
import jax.numpy as jnp


def gemv(x: jax.Array, weights: tuple[jax.Array, ...], out_dtype=None) -> tuple[jax.Array, ...]:
    """x [..., K] times each w [K, N_i] -> ([..., N_i], ...) in ``out_dtype`` (default: each weight's dtype)."""
    return tuple(jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(out_dtype or w.dtype)
                 for w in weights)


def gemv_add(x: jax.Array, w: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
    """residual + x w: x [M, K], w [K, N], residual [M, N] -> (out [M, N] fp32, its rows' sums of squares [1, M]);
    the product rounded to w's dtype first, as a projection's output is."""
    out = residual.astype(jnp.float32) + gemv(x, (w,))[0].astype(jnp.float32)
    return out, jnp.sum(out * out, axis=-1)[None]


def rms_norm_from_sums(x: jax.Array, sums: jax.Array, weight: jax.Array, eps: float, dtype) -> jax.Array:
    """The zero-centred RMS norm of x [M, K] fp32, ``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in ``dtype``,
    with mean(x^2) from ``sums`` [J, M]: partial sums of squares of x's rows (their total over J / K)."""
    scale = jax.lax.rsqrt(jnp.sum(sums, axis=0) / x.shape[-1] + eps)[:, None]  # [M, 1]
    return (x.astype(jnp.float32) * scale * (1.0 + weight.astype(jnp.float32))).astype(dtype)


def swiglu_product(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up rounded as HF's bf16 MLP rounds it: gate and up, then the SiLU, to the inputs' dtype,
    then the product. The roundings are `reduce_precision`s, which XLA keeps: a convert to bf16 and back it
    may drop (excess precision), and on the GPU it did, moving a tiny model's logits by 1.5%."""
    bits = jnp.finfo(gate.dtype)
    keep = lambda v: jax.lax.reduce_precision(v, exponent_bits=bits.nexp, mantissa_bits=bits.nmant)
    act = keep(jax.nn.silu(keep(gate.astype(jnp.float32))))
    return (act * keep(up.astype(jnp.float32))).astype(gate.dtype)

