"""The gated delta rule in three pure-JAX forms: token scan (the oracle), chunked (prefill), one step (decode).

Per value head h, with state S in R^{dk x dv} (fp32):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

Inputs are already prepared by the layer: q and k L2-normalised (q also scaled by dk^-1/2), ``g`` the
log-decay (<= 0) and ``beta`` the write strength. Value heads are grouped over key heads: value head j
reads key head j // (Hv / Hk) (consecutive grouping, as ``repeat_interleave``). Every form computes in
fp32 with the highest matmul precision (these are references: kernels are measured against them).

The chunked form is the WY / UT-transform algorithm of Yang et al., "Gated Delta Networks" (2024), as
in flash-linear-attention's ``chunk_gated_delta_rule``: within a chunk of C tokens the recurrence is a
unit-lower-triangular solve, between chunks one state update per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
CHUNK_SIZE = 64


def expand_key_heads(x: jax.Array, num_value_heads: int, head_axis: int) -> jax.Array:
    """Repeat key heads so value head j sees key head j // group (reference forms only)."""
    group = num_value_heads // x.shape[head_axis]
    return x if group == 1 else jnp.repeat(x, group, axis=head_axis)


def gated_delta_scan(q, k, v, g, beta, state):
    """Token-by-token recurrence: the oracle.

    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g, beta: [B, T, Hv]; state: [B, Hv, dk, dv] fp32.
    Returns (o [B, T, Hv, dv] fp32, final state [B, Hv, dk, dv] fp32).
    """
    hv = v.shape[2]
    q, k = (expand_key_heads(x.astype(F32), hv, 2) for x in (q, k))
    v, g, beta = v.astype(F32), g.astype(F32), beta.astype(F32)

    def step(s, xs):  # s: [B, Hv, dk, dv]
        q_t, k_t, v_t, g_t, b_t = xs  # [B, Hv, dk], [B, Hv, dk], [B, Hv, dv], [B, Hv], [B, Hv]
        # Outer-product form: S = exp(g) * (S - beta k (k^T S)) + beta k v^T.
        kts = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=HIGHEST)
        s = jnp.exp(g_t)[..., None, None] * (s - b_t[..., None, None] * k_t[..., :, None] * kts[..., None, :])
        s = s + b_t[..., None, None] * k_t[..., :, None] * v_t[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    final, o = lax.scan(step, state.astype(F32), time_major)
    return jnp.moveaxis(o, 0, 1), final


def gated_delta_step(q, k, v, g, beta, state):
    """One decode token: the recurrent update as the decode kernel computes it.

    q, k: [B, Hk, dk]; v: [B, Hv, dv]; g, beta: [B, Hv]; state: [B, Hv, dk, dv] fp32.
    Returns (o [B, Hv, dv] fp32, new state [B, Hv, dk, dv] fp32).
    """
    hv = v.shape[1]
    q, k = (expand_key_heads(x.astype(F32), hv, 1) for x in (q, k))
    s = state.astype(F32) * jnp.exp(g.astype(F32))[..., None, None]  # decay
    read = jnp.einsum("bhkv,bhk->bhv", s, k, precision=HIGHEST)  # what the state predicts for k
    delta = beta.astype(F32)[..., None] * (v.astype(F32) - read)  # [B, Hv, dv]
    s = s + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("bhkv,bhk->bhv", s, q, precision=HIGHEST), s


def gated_delta_chunked(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE, *, chunk_states: bool = False):
    """Chunked form (the algorithm the Pallas prefill kernel follows). Shapes as ``gated_delta_scan``.

    T need not be a multiple of ``chunk_size``: the tail is padded with g = beta = k = 0, which leaves
    the state untouched. With ``chunk_states``, the state after each chunk comes back third, [B, N, Hv, dk, dv].
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    n = -(-t // chunk_size)
    pad = n * chunk_size - t

    def chunks(x):  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = jnp.pad(x.astype(F32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k = (chunks(expand_key_heads(x, hv, 2)) for x in (q, k))  # [B, Hv, N, C, dk]
    v = chunks(v)  # [B, Hv, N, C, dv]
    g = jnp.cumsum(chunks(g), axis=-1)  # [B, Hv, N, C]: log-decay from the chunk start, inclusive
    beta = chunks(beta)  # [B, Hv, N, C]

    idx = jnp.arange(chunk_size)
    causal = idx[:, None] >= idx[None, :]  # [C, C] i >= j
    strict = idx[:, None] > idx[None, :]
    # decay[i, j] = exp(g_i - g_j) for i >= j; masked before exp so the upper triangle cannot overflow.
    decay = jnp.exp(jnp.where(causal, g[..., :, None] - g[..., None, :], -jnp.inf))  # [B, Hv, N, C, C]

    k_beta = k * beta[..., None]
    kk = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k, precision=HIGHEST)
    lower = jnp.where(strict, kk * decay, 0.0)  # M: strictly lower
    unit_lower = lower + jnp.eye(chunk_size, dtype=F32)  # (I + M)
    solve = lambda rhs: lax.linalg.triangular_solve(unit_lower, rhs, left_side=True, lower=True,
                                                     unit_diagonal=True)
    u = solve(v * beta[..., None])  # [B, Hv, N, C, dv]: pseudo-values (I + M)^-1 (beta v)
    w = solve(k_beta * jnp.exp(g)[..., None])  # [B, Hv, N, C, dk]: (I + M)^-1 (beta k exp(g))
    qk = jnp.einsum("bhnik,bhnjk->bhnij", q, k, precision=HIGHEST)
    intra = jnp.where(causal, qk * decay, 0.0)  # [B, Hv, N, C, C]

    def chunk_step(s, xs):  # s: [B, Hv, dk, dv]
        q_c, k_c, u_c, w_c, g_c, intra_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s, precision=HIGHEST)  # [B, Hv, C, dv]
        o_inter = jnp.einsum("bhck,bhkv->bhcv", q_c * jnp.exp(g_c)[..., None], s, precision=HIGHEST)
        o_c = o_inter + jnp.einsum("bhij,bhjv->bhiv", intra_c, v_new, precision=HIGHEST)
        g_last = g_c[..., -1]  # [B, Hv]
        k_decayed = k_c * jnp.exp(g_last[..., None] - g_c)[..., None]  # [B, Hv, C, dk]
        s = s * jnp.exp(g_last)[..., None, None] + jnp.einsum(
            "bhck,bhcv->bhkv", k_decayed, v_new, precision=HIGHEST)
        return s, (o_c, s if chunk_states else None)

    chunk_major = [jnp.moveaxis(x, 2, 0) for x in (q, k, u, w, g, intra)]
    final, (o, states) = lax.scan(chunk_step, state.astype(F32), chunk_major)  # o: [N, B, Hv, C, dv]
    o = jnp.moveaxis(o, 0, 2).reshape(b, hv, n * chunk_size, dv)[:, :, :t]
    if chunk_states:
        return jnp.moveaxis(o, 1, 2), final, jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(o, 1, 2), final
