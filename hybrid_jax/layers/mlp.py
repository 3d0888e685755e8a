"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import jax
from flax import nnx

from hybrid_jax.layers.linear import Linear, swiglu
from pallas_kernels.gemv import NormedRows


class MLP(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, *, std: float, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype, std=std, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, dtype, std=std, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype, std=std, rngs=rngs)

    def hidden(self, x: jax.Array | NormedRows) -> jax.Array:  # [..., D] -> the down projection's input [..., I]
        return swiglu(x, self.gate_proj, self.up_proj)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        return self.down_proj(self.hidden(x))
