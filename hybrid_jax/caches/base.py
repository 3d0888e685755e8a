"""What a forward's layers run over: the projections to use and the two mixers' state.

The decoder loop (`model.Qwen35ForCausalLM.decoder`) and each mixer are written once; a cache supplies what
differs between running whole sequences, packed prefill chunks over pools and batched decode: how the
residual stream's rows are padded, how projections run (`layers.projections`), and, for layer ``index``, the
attention over its KV (from the projections on) and the conv plus delta rule over its GDN state.
"""

from __future__ import annotations

import jax

from hybrid_jax.layers.projections import XlaProjections


class Cache:
    """The interface; rows unpadded and XLA's dots unless a cache says otherwise."""

    proj = XlaProjections()
    real_rows: int | None = None  # real rows of the padded stream (None: no padding)

    def pad(self, x: jax.Array) -> jax.Array:
        """A per-token array [N, ...] -> the rows the stream runs at."""
        return x

    def unpad(self, x: jax.Array) -> jax.Array:
        return x

    def attention(self, index: int, attn, qg: jax.Array, k: jax.Array, v: jax.Array,
                  positions: jax.Array) -> jax.Array:
        """The projections of `GatedAttention` layer ``index`` -> its output projection's input [..., Hq hd]."""
        raise NotImplementedError

    def linear_attention(self, index: int, gdn, mixed: jax.Array, b: jax.Array, a: jax.Array) -> jax.Array:
        """The raw conv input mixed [..., C] and gate logits b, a [..., Hv] (fp32) of `GatedDeltaNet` layer
        ``index`` -> its delta-rule output o [..., Hv, dv] (as many rows as mixed)."""
        raise NotImplementedError
