"""The residual add fused with the zero-centred RMSNorm after it: one dispatch.

`impl`: "auto" runs the Pallas kernel on a GPU when D splits into power-of-two chunks of at least 16 columns,
the reference elsewhere; "kernel" / "interpret" force the kernel (compiled / interpret mode), "reference"
the reference.
"""

import jax

from pallas_kernels.add_rms_norm import kernel, reference
from pallas_kernels.dispatch import Impl, kernel_mode

MIN_CHUNK = 16


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, out_dtype, *,
                 impl: Impl = "auto") -> tuple[jax.Array, jax.Array]:
    """x [..., D] fp32 residual stream, delta [..., D] or None (nothing to add), weight [D] ->
    (x + delta in fp32, (x + delta) / rms * (1 + weight) in ``out_dtype``)."""
    d = x.shape[-1]
    reason = None
    if kernel.chunk_width(d) < MIN_CHUNK:
        reason = f"D = {d}: needs a power-of-two chunk of >= {MIN_CHUNK} columns dividing it"
    elif weight.shape != (d,) or (delta is not None and delta.shape != x.shape):
        reason = f"shapes x {x.shape}, delta {None if delta is None else delta.shape}, weight {weight.shape}"
    interpret = kernel_mode("add_rms_norm", impl, reason)
    if interpret is None:
        return reference.add_rms_norm(x, delta, weight, eps, out_dtype)
    return kernel.add_rms_norm(x, delta, weight, eps, out_dtype, interpret=interpret)


__all__ = ["Impl", "add_rms_norm"]
