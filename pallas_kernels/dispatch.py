"""What every op's dispatch function shares: choosing between the Pallas kernel and the XLA reference."""

import os
from typing import Literal

import jax

Impl = Literal["auto", "kernel", "reference", "interpret"]
# HYBRID_JAX_KERNELS=reference makes "auto" run the references everywhere (to bisect a kernel problem).
FORCE_REFERENCE_ENV = "HYBRID_JAX_KERNELS"


def is_pow2(n: int, minimum: int = 1) -> bool:
    return n >= minimum and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): Triton's block shapes are powers of two."""
    return 1 << max(n - 1, 0).bit_length()


def gdn_unsupported(num_k_heads: int, num_v_heads: int, dk: int, dv: int, state_pool) -> str | None:
    """Why the GDN kernels cannot take these head shapes / state pool (None: they can)."""
    if not (is_pow2(dk, 16) and is_pow2(dv, 16)):
        return f"dk {dk} / dv {dv}: need powers of two >= 16"
    if num_v_heads % num_k_heads:
        return f"Hv {num_v_heads} is not a multiple of Hk {num_k_heads}"
    if state_pool.dtype != "float32" or state_pool.shape[1:] != (num_v_heads, dk, dv):
        return f"state pool {state_pool.shape} {state_pool.dtype}: need [slots, {num_v_heads}, {dk}, {dv}] float32"
    return None


def kernel_mode(op: str, impl: Impl, reason: str | None) -> bool | None:
    """None: run the reference; else the kernel's ``interpret`` flag.

    ``reason`` says why the kernel cannot take the operands (None: it can). "auto" picks the kernel on a
    GPU when it can, the reference elsewhere; "kernel" and "interpret" raise when it cannot.
    """
    if impl == "reference":
        return None
    if impl in ("kernel", "interpret"):
        if reason is not None:
            raise ValueError(f"{op} kernel unsupported: {reason}")
        return impl == "interpret"
    if impl != "auto":
        raise ValueError(f"impl must be auto, kernel, reference or interpret, got {impl!r}")
    if os.environ.get(FORCE_REFERENCE_ENV) == "reference":
        return None
    return False if reason is None and jax.default_backend() == "gpu" else None
