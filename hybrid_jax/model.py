"""The Qwen3.5 dense hybrid decoder (Flax NNX): GDN layers, every 4th layer gated attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.caches.base import Cache
from hybrid_jax.caches.dense import DenseCache
from hybrid_jax.config import FULL_ATTENTION, Qwen35Config
from hybrid_jax.layers.attention import GatedAttention
from hybrid_jax.layers.gdn import GatedDeltaNet
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.mlp import MLP
from hybrid_jax.layers.norm import RMSNorm
from pallas_kernels.gemv import NormedRows

F32 = jnp.float32


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype, *, std: float, rngs: nnx.Rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim), dtype) * std)

    def __call__(self, ids: jax.Array) -> jax.Array:  # [...] int -> [..., D]
        return jnp.take(self.weight[...], ids, axis=0)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: mixer (GDN or gated attention), then SwiGLU MLP."""

    def __init__(self, config: Qwen35Config, layer_type: str, dtype, *, rngs: nnx.Rngs):
        self.is_attention = layer_type == FULL_ATTENTION
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if self.is_attention:
            self.self_attn = GatedAttention(config, dtype, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(config, dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype, std=config.initializer_range, rngs=rngs)

    @property
    def mixer(self) -> GatedAttention | GatedDeltaNet:
        return self.self_attn if self.is_attention else self.linear_attn

    def __call__(self, x: jax.Array, normed: NormedRows | None, positions: jax.Array, cache: Cache, index: int,
                 norms_after: tuple[RMSNorm | None, RMSNorm | None]):
        """x [..., D] fp32 residual stream (``normed``: this layer's input norm of it, where the last add wrote
        it) -> (the new stream, the next norm where this layer's last add wrote it). ``norms_after``: the norms
        that follow the mixer's and the MLP's adds (the next layer's input norm; None after the last layer)."""
        dtype = self.mlp.down_proj.kernel.dtype
        proj = cache.proj
        h = self.input_layernorm(x, dtype) if normed is None else normed
        y = self.self_attn(h, positions, cache, index) if self.is_attention else self.linear_attn(h, cache, index)
        x, normed = proj.add_projection(x, cache.pad(y), self.mixer.output_projection, next_norm=norms_after[0],
                                        real_rows=cache.real_rows)
        h = self.post_attention_layernorm(x, dtype) if normed is None else normed
        return proj.add_projection(x, proj.swiglu(h, self.mlp.gate_proj, self.mlp.up_proj), self.mlp.down_proj,
                                   next_norm=norms_after[1], real_rows=cache.real_rows)


class Qwen35ForCausalLM(nnx.Module):
    """Qwen3.5 text model with its LM head.

    ``model(input_ids [B, T])`` gives fp32 logits [B, T, V] for full sequences; ``model.forward`` also
    carries a cache (``init_cache``) for incremental decoding.
    """

    def __init__(self, config: Qwen35Config, dtype=jnp.bfloat16, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        std = config.initializer_range
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, std=std, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(config, t, dtype, rngs=rngs) for t in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype, std=std, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
        return self.forward(input_ids, positions)[0]

    def forward(self, input_ids: jax.Array, positions: jax.Array, cache: list | None = None):
        """input_ids, positions [B, T] -> (logits [B, T, V] fp32, new dense cache or None)."""
        return self.logits(*self.hidden_states(input_ids, positions, cache))

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array, cache: list | None = None):
        """Final-normed hidden states [B, T, D] and the new dense cache (None without one)."""
        dense = DenseCache(cache)
        x = self.decoder(self.embed_tokens(input_ids).astype(F32), positions, dense)
        return self.norm(x, self.dtype), dense.updated

    def decoder(self, x: jax.Array, positions: jax.Array, cache: Cache) -> jax.Array:
        """The layer loop: x [..., D] fp32 embeddings (the residual stream is kept in fp32), positions [...]
        -> the final residual stream (before the final norm), over ``cache`` (`caches.base.Cache`)."""
        x, positions = cache.pad(x), cache.pad(positions)
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        after = [*norms[1:], None]
        normed = None
        for i, layer in enumerate(self.layers):
            x, normed = layer(x, normed, positions, cache, i, (after[2 * i], after[2 * i + 1]))
        return cache.unpad(x)

    def logits(self, h: jax.Array, cache=None):
        """h [..., D] -> (logits [..., V] fp32, cache)."""
        if self.config.tie_word_embeddings:
            w = self.embed_tokens.weight[...]  # [V, D]
            out = jnp.einsum("...d,vd->...v", h.astype(w.dtype), w, preferred_element_type=F32)
        else:
            w = self.lm_head.kernel[...]  # [D, V]
            out = jnp.dot(h.astype(w.dtype), w, preferred_element_type=F32)
        return out, cache

    def init_cache(self, batch: int, max_len: int) -> list[dict]:
        """Dense per-layer cache: KV [B, max_len, Hkv, hd] for attention, conv + fp32 state for GDN."""
        return [layer.self_attn.init_cache(batch, max_len, self.dtype) if layer.is_attention
                else layer.linear_attn.init_cache(batch, self.dtype) for layer in self.layers]
