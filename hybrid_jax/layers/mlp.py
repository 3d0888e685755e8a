"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` (the forward's projections run it: `projections.swiglu`)."""

from __future__ import annotations

from flax import nnx

from hybrid_jax.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, *, std: float, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype, std=std, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype, std=std, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype, std=std, rngs=rngs)
