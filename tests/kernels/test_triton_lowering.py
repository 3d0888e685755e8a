"""Every Pallas kernel lowers to Triton for an H200, on a machine without one.

`jax.export` for the "cuda" platform under an abstract H200 runs the Pallas-to-Triton lowering (what fails
when a kernel uses an op or a shape the Triton backend does not take) without a GPU; only the PTX compile,
which needs one, is left to the GPU tests. Shapes are 9B's (`preset("9b")`) at a decode batch of 1 padded
to 16 rows and a 64-token prefill.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from hybrid_jax.config import preset
from pallas_kernels.gdn_chunk.kernel import gdn_chunk
from pallas_kernels.gdn_decode.kernel import gdn_decode, gdn_decode_fused
from pallas_kernels.gemv.kernel import gemv, gemv_add, gemv_swiglu
from pallas_kernels.paged_attention.kernel import (
    decode_attention_inputs,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

TRITON_CALL = "__gpu$xla.gpu.triton"
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                    platform="cuda"))
C = preset("9b")
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
ROWS, B, T, SEQS, SLOTS, PAGES, PAGE, SNAPSHOTS = 16, 1, 64, 2, 4, 64, 16, 5
HK, HV, DK, DV = C.linear_num_key_heads, C.linear_num_value_heads, C.linear_key_head_dim, C.linear_value_head_dim
HQ, HKV, HD = C.num_attention_heads, C.num_key_value_heads, C.head_dim
D, I, K = C.hidden_size, C.intermediate_size, C.linear_conv_kernel_dim


def s(*shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


KV_PAGES = s(PAGES, PAGE, HKV, HD)
CASES = {
    "gemv": (gemv, (s(ROWS, D), (s(D, C.conv_dim), s(D, C.linear_value_dim), s(D, HV), s(D, HV)))),
    "gemv_swiglu": (gemv_swiglu, (s(ROWS, D), s(D, I), s(D, I))),
    "gemv_normed": (lambda x, ws, sums: gemv(x, ws, None, sums, C.rms_norm_eps),
                    (s(ROWS, D), (s(D, C.conv_dim), s(D, HV)), s(D // 64, ROWS, dtype=F32))),
    "gemv_swiglu_normed": (lambda x, wg, wu, sums: gemv_swiglu(x, wg, wu, sums, C.rms_norm_eps),
                           (s(ROWS, D), s(D, I), s(D, I), s(D // 64, ROWS, dtype=F32))),
    "gemv_add": (gemv_add, (s(ROWS, I), s(I, D), s(ROWS, D, dtype=F32), s(D // 16, dtype=I32))),
    "gemv_add_normed_27b": (gemv_add, (s(ROWS, 6144), s(6144, 5120), s(ROWS, 5120, dtype=F32),
                                       s(5120 // 16, dtype=I32), s(5120))),
    "gemv_swiglu_27b": (gemv_swiglu, (s(ROWS, 5120), s(5120, 17408), s(5120, 17408))),  # its measured tiles
    "gemv_add_normed_27b_down": (gemv_add, (s(ROWS, 17408), s(17408, 5120), s(ROWS, 5120, dtype=F32),
                                            s(5120 // 16, dtype=I32), s(5120))),
    "gdn_decode": (gdn_decode, (s(B, HK, DK), s(B, HK, DK), s(B, HV, DV), s(B, HV, dtype=F32), s(B, HV, dtype=F32),
                                s(B, dtype=I32), s(SLOTS, HV, DK, DV, dtype=F32))),
    "gdn_decode_fused": (
        functools.partial(gdn_decode_fused, num_k_heads=HK, head_k_dim=DK, head_v_dim=DV, out_rows=ROWS),
        (s(ROWS, C.conv_dim), s(ROWS, HV), s(ROWS, HV), s(K, C.conv_dim), s(HV, dtype=F32), s(HV), s(B, dtype=I32),
         s(B, dtype=I32), s(SLOTS, K, C.conv_dim), s(SLOTS, HV, DK, DV, dtype=F32))),
    "gdn_decode_fused_snapshots": (  # the third layer's ring of a snapshot pool stacking three
        functools.partial(gdn_decode_fused, num_k_heads=HK, head_k_dim=DK, head_v_dim=DV, out_rows=ROWS,
                          snapshot_layer=2),
        (s(ROWS, C.conv_dim), s(ROWS, HV), s(ROWS, HV), s(K, C.conv_dim), s(HV, dtype=F32), s(HV), s(B, dtype=I32),
         s(B, dtype=I32), s(SLOTS, K, C.conv_dim), s(SLOTS, HV, DK, DV, dtype=F32), s(B, dtype=I32),
         s(SNAPSHOTS, 3 * K, C.conv_dim), s(SNAPSHOTS, HV, DK, DV, dtype=F32))),
    "gdn_chunk": (gdn_chunk, (s(T, HK, DK), s(T, HK, DK), s(T, HV, DV), s(T, HV, dtype=F32), s(T, HV, dtype=F32),
                              s(SEQS + 1, dtype=I32), s(SEQS, dtype=I32), s(SLOTS, HV, DK, DV, dtype=F32))),
    "gdn_chunk_snapshots": (gdn_chunk, (s(T, HK, DK), s(T, HK, DK), s(T, HV, DV), s(T, HV, dtype=F32),
                                        s(T, HV, dtype=F32), s(SEQS + 1, dtype=I32), s(SEQS, dtype=I32),
                                        s(SLOTS, HV, DK, DV, dtype=F32), s(SEQS, T // 64, dtype=I32),
                                        s(SNAPSHOTS, HV, DK, DV, dtype=F32))),
    "paged_decode_attention": (
        lambda q, k, v, tables, lens, gate: paged_decode_attention(q, k, v, tables, lens, scale=HD**-0.5, gate=gate,
                                                                   out_rows=ROWS),
        (s(B, HQ, HD), KV_PAGES, KV_PAGES, s(B, PAGES, dtype=I32), s(B, dtype=I32), s(ROWS, HQ * 2 * HD))),
    "decode_attention_inputs": (
        functools.partial(decode_attention_inputs, num_q_heads=HQ, eps=C.rms_norm_eps),
        (s(ROWS, HQ * 2 * HD), s(ROWS, HKV * HD), s(ROWS, HKV * HD), s(ROWS, C.rotary_dim), s(ROWS, C.rotary_dim),
         s(HD), s(HD), s(B, dtype=I32), KV_PAGES, KV_PAGES)),
    "paged_prefill_attention": (
        functools.partial(paged_prefill_attention, scale=HD**-0.5),
        (s(T, HQ, HD), KV_PAGES, KV_PAGES, s(SEQS, PAGES, dtype=I32), s(SEQS + 1, dtype=I32), s(SEQS, dtype=I32))),
    "write_kv": (write_kv, (KV_PAGES, KV_PAGES, s(T, HKV, HD), s(T, HKV, HD), s(T, dtype=I32))),
}


@pytest.mark.parametrize("name", CASES)
def test_lowers_for_an_h200(name):
    fn, args = CASES[name]
    with use_abstract_mesh(H200):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
    assert TRITON_CALL in exported.mlir_module()
