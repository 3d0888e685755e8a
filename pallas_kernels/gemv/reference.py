"""Pure-JAX references of the few-row matmul (x times each weight, each row optionally scaled after the product:
an RMS norm's deferred division), of the projection added to the residual stream, and of the SwiGLU product
the fused gate/up kernel writes."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def gemv(x: jax.Array, weights: tuple[jax.Array, ...], out_dtype=None,
         row_scale: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """x [..., K] times each w [K, N_i] -> ([..., N_i], ...) in ``out_dtype`` (default: each weight's dtype);
    ``row_scale`` [..., 1] multiplies the fp32 products first."""
    def product(w):
        y = jnp.dot(x.astype(w.dtype), w, preferred_element_type=F32)
        return (y if row_scale is None else y * row_scale).astype(out_dtype or w.dtype)

    return tuple(product(w) for w in weights)


def rms_row_scale(sums: jax.Array, k: int, eps: float) -> jax.Array:
    """1 / sqrt(mean square + eps) of each of M rows [M, 1], from ``sums`` [J, M]: partial sums of squares of
    the rows' K entries over J column blocks."""
    return jax.lax.rsqrt(jnp.sum(sums, axis=0) / k + eps)[:, None]


def gemv_add(x: jax.Array, w: jax.Array, residual: jax.Array, norm_weight: jax.Array | None = None):
    """residual + x w: x [M, K], w [K, N], residual [M, N] -> out [M, N] fp32, the product rounded to w's dtype
    first, as a projection's output is; and, given the next norm's ``norm_weight`` [N], out * (1 + weight) in
    w's dtype and out's rows' sums of squares [1, M] (else None, None)."""
    out = residual.astype(F32) + gemv(x, (w,))[0].astype(F32)
    if norm_weight is None:
        return out, None, None
    scaled = (out * (1.0 + norm_weight.astype(F32))).astype(w.dtype)
    return out, scaled, jnp.sum(out * out, axis=-1)[None]


def swiglu_product(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up rounded as HF's bf16 MLP rounds it: gate and up, then the SiLU, to the inputs' dtype,
    then the product. The roundings are `reduce_precision`s, which XLA keeps: a convert to bf16 and back it
    may drop (excess precision), and on the GPU it did, moving a tiny model's logits by 1.5%."""
    bits = jnp.finfo(gate.dtype)
    keep = lambda v: jax.lax.reduce_precision(v, exponent_bits=bits.nexp, mantissa_bits=bits.nmant)
    act = keep(jax.nn.silu(keep(gate.astype(F32))))
    return (act * keep(up.astype(F32))).astype(gate.dtype)
