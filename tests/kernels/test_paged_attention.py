"""Paged attention: the Pallas kernels (interpret mode on CPU, compiled when a GPU is present) against the
pure-JAX reference, and the reference against naive dense attention (numpy float64) over unpaged K/V; the
decode step's fused attention inputs (q/k norms, RoPE, K/V write) and gated output against theirs.

Every input is random, the whole pool included: page 0 (the null page) and unused pages hold garbage, so
a read of a wrong slot shows. Tolerances (rtol = atol, inputs ~ N(0, 1)): fp32 1e-5 (kernel vs reference) /
2e-5 (vs float64 dense); bf16 2e-2 (bf16 inputs, bf16 P.V operands, outputs rounded to bf16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.config import preset
from hybrid_jax.layers.attention import GatedAttention
from hybrid_jax.layers.projections import XlaProjections
from pallas_kernels import paged_attention as pa
from pallas_kernels.math.rope import rope_cos_sin
from pallas_kernels.paged_attention import reference

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
DENSE_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

ON_GPU = jax.default_backend() == "gpu"
IMPLS = [  # on a GPU the compiled kernel replaces the interpreter (whose fp32 dots would be TF32 there)
    pytest.param("interpret", marks=pytest.mark.skipif(ON_GPU, reason="CPU only: the GPU runs the kernel")),
    pytest.param("kernel", marks=pytest.mark.skipif(not ON_GPU, reason="needs a GPU")),
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedCase:
    """Random K/V pools with sequences of the given context lengths on shuffled pages (numpy side kept)."""

    def __init__(self, rng, context_lens, page_size, num_kv_heads, head_dim, dtype, spare_pages=3):
        num_used = [_cdiv(n, page_size) for n in context_lens]
        num_pages = 1 + sum(num_used) + spare_pages
        free = iter(rng.permutation(np.arange(1, num_pages)))  # page 0 is the null page
        self.page_tables = np.zeros((len(context_lens), max(num_used) + 1), np.int32)  # [S, max_pages]
        for s, n in enumerate(num_used):
            self.page_tables[s, :n] = [next(free) for _ in range(n)]
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages = jnp.asarray(rng.standard_normal(shape), dtype)  # [P, page_size, Hkv, hd]
        self.v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
        self.context_lens = np.asarray(context_lens, np.int32)  # [S]
        self.page_size = page_size

    def dense(self, s: int, k_pages=None, v_pages=None) -> tuple[np.ndarray, np.ndarray]:
        """Sequence s's K, V [L, Hkv, hd] in float64, read through the numpy page table (of these pools)."""
        n = self.context_lens[s]
        pages = self.page_tables[s, : _cdiv(n, self.page_size)]
        k = _f64(self.k_pages if k_pages is None else k_pages)[pages]  # [n_pages, page_size, Hkv, hd]
        v = _f64(self.v_pages if v_pages is None else v_pages)[pages]
        return k.reshape(-1, *k.shape[2:])[:n], v.reshape(-1, *v.shape[2:])[:n]

    def args(self):
        return self.k_pages, self.v_pages, jnp.asarray(self.page_tables)

    def nan_garbage_args(self):
        """args() with NaN in every slot that holds no token of a sequence (page 0 included)."""
        real = np.zeros(self.k_pages.shape[:2], bool)  # [P, page_size]
        for s, n in enumerate(self.context_lens):
            for i in range(n):
                real[self.page_tables[s, i // self.page_size], i % self.page_size] = True
        keep = jnp.asarray(real)[:, :, None, None]
        nan = jnp.asarray(np.nan, self.k_pages.dtype)
        return jnp.where(keep, self.k_pages, nan), jnp.where(keep, self.v_pages, nan), jnp.asarray(self.page_tables)


def _dense_attention(q, k, v, positions, scale):
    """Naive float64 attention: q [n, Hq, hd] at `positions` [n] over k, v [L, Hkv, hd]; -> [n, Hq, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [L, Hq, hd]
    s = np.einsum("nhd,lhd->nhl", q, k) * scale
    s = np.where(np.arange(k.shape[0])[None, None, :] <= positions[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nhl,lhd->nhd", p / p.sum(-1, keepdims=True), v)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _assert_close(got, want, tol: float) -> None:
    np.testing.assert_allclose(_f64(got), _f64(want), rtol=tol, atol=tol)


def _decode_inputs(rng, context_lens, page_size, group, num_kv_heads, head_dim, dtype):
    case = PagedCase(rng, context_lens, page_size, num_kv_heads, head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(context_lens), group * num_kv_heads, head_dim)), dtype)  # [B, Hq, hd]
    return case, q


def _prefill_inputs(rng, q_lens, prefix_lens, page_size, group, num_kv_heads, head_dim, dtype, pad_rows):
    """Sequences of q_lens new tokens after prefix_lens cached ones, packed, then pad_rows padding rows."""
    context_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    case = PagedCase(rng, context_lens, page_size, num_kv_heads, head_dim, dtype)
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)  # [S + 1]
    num_tokens = int(cu_q_lens[-1]) + pad_rows
    q = jnp.asarray(rng.standard_normal((num_tokens, group * num_kv_heads, head_dim)), dtype)  # [T, Hq, hd]
    return case, q, cu_q_lens


def _dense_prefill(case, q, cu_q_lens, scale) -> np.ndarray:  # [T, Hq, hd], padding rows 0
    q64, out = _f64(q), np.zeros(q.shape)
    for s in range(len(cu_q_lens) - 1):
        start, end = cu_q_lens[s], cu_q_lens[s + 1]
        if end > start:
            k, v = case.dense(s)
            positions = case.context_lens[s] - (end - start) + np.arange(end - start)
            out[start:end] = _dense_attention(q64[start:end], k, v, positions, scale)
    return out


# ---------------------------------------------------------------- the reference against dense attention


def test_reference_decode_matches_dense():
    rng = np.random.default_rng(0)
    page_size, scale = 8, 0.3
    case, q = _decode_inputs(rng, [1, 7, 8, 9, 29, 0], page_size, 2, 2, 16, jnp.float32)
    out = reference.paged_decode_attention(q, *case.nan_garbage_args(), jnp.asarray(case.context_lens), scale=scale)
    q64 = _f64(q)
    for b, n in enumerate(case.context_lens):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(out[b]), 0.0)
        else:
            k, v = case.dense(b)
            want = _dense_attention(q64[b : b + 1], k, v, np.array([n - 1]), scale)[0]
            _assert_close(out[b], want, DENSE_TOL[jnp.float32])


@pytest.mark.parametrize(
    ("q_lens", "prefix_lens", "page_size"),
    [([1, 63, 64, 65], [0, 0, 0, 0], 16), ([5, 1, 33], [11, 16, 40], 8), ([4097], [0], 64)],
    ids=["prefill", "extend", "long4097"],
)
def test_reference_prefill_matches_dense(q_lens, prefix_lens, page_size):
    rng = np.random.default_rng(1)
    scale = 0.25
    case, q, cu = _prefill_inputs(rng, q_lens, prefix_lens, page_size, 2, 1, 16, jnp.float32, pad_rows=3)
    out = reference.paged_prefill_attention(
        q, *case.nan_garbage_args(), jnp.asarray(cu), jnp.asarray(case.context_lens), scale=scale
    )
    _assert_close(out, _dense_prefill(case, q, cu, scale), DENSE_TOL[jnp.float32])
    np.testing.assert_array_equal(np.asarray(out[cu[-1] :]), 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_write_kv_round_trip(impl):
    """Tokens written through their slots read back through the page table; padding goes to page 0 only."""
    rng = np.random.default_rng(2)
    page_size, num_kv_heads, head_dim = 4, 2, 16
    case = PagedCase(rng, [6, 9], page_size, num_kv_heads, head_dim, jnp.float32)
    slots = [
        case.page_tables[s, i // page_size] * page_size + i % page_size
        for s, n in enumerate(case.context_lens)
        for i in range(n)
    ]
    slots = np.asarray(slots + [0, 0, 1], np.int32)  # [T], three padding tokens into page 0
    k_new = jnp.asarray(rng.standard_normal((len(slots), num_kv_heads, head_dim)), jnp.float32)  # [T, Hkv, hd]
    v_new = jnp.asarray(rng.standard_normal((len(slots), num_kv_heads, head_dim)), jnp.float32)
    written = {}
    for name in ["reference", impl]:
        k_pages, v_pages = pa.write_kv(case.k_pages, case.v_pages, k_new, v_new, jnp.asarray(slots), impl=name)
        got = [case.dense(s, k_pages, v_pages) for s in range(2)]
        np.testing.assert_array_equal(np.concatenate([k for k, _ in got]), np.asarray(k_new[:15]))
        np.testing.assert_array_equal(np.concatenate([v for _, v in got]), np.asarray(v_new[:15]))
        untouched = np.ones(case.k_pages.shape[0] * page_size, bool)
        untouched[slots] = False
        flat = (-1, num_kv_heads, head_dim)
        np.testing.assert_array_equal(
            np.asarray(k_pages.reshape(flat))[untouched], np.asarray(case.k_pages.reshape(flat))[untouched]
        )
        written[name] = (k_pages[1:], v_pages[1:])  # page 0 takes racing padding writes: garbage
    for a, b in zip(written["reference"], written[impl], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------- kernels against the reference

DECODE_CASES = [  # group, Hkv, head_dim, page_size, dtype, tuning
    (1, 2, 16, 8, jnp.float32, dict(block_kv=16, num_splits=1)),
    (2, 2, 256, 16, jnp.float32, dict(block_kv=16, num_splits=3)),
    (4, 1, 16, 32, jnp.bfloat16, dict(block_kv=16, num_splits=1)),
    (4, 2, 256, 8, jnp.bfloat16, dict(block_kv=32, num_splits=2)),
    (6, 2, 16, 16, jnp.float32, dict(block_kv=16)),  # 27B's group; default splits
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("group", "num_kv_heads", "head_dim", "page_size", "dtype", "tuning"),
    DECODE_CASES,
    ids=lambda x: getattr(x, "__name__", None),
)
def test_decode_kernel(impl, group, num_kv_heads, head_dim, page_size, dtype, tuning):
    rng = np.random.default_rng(3)
    ps = page_size
    lens = [1, ps - 1, ps, ps + 1, 3 * ps + 5, 0, 2, 5 * ps]  # 0: a padded row (page table row of zeros)
    case, q = _decode_inputs(rng, lens, ps, group, num_kv_heads, head_dim, dtype)
    args = (q, *case.args(), jnp.asarray(case.context_lens))
    scale = head_dim**-0.5
    want = pa.paged_decode_attention(*args, scale=scale, impl="reference")
    got = pa.paged_decode_attention(*args, scale=scale, impl=impl, **tuning)
    assert got.shape == q.shape and got.dtype == q.dtype
    _assert_close(got, want, TOL[dtype])
    np.testing.assert_array_equal(np.asarray(got[5].astype(jnp.float32)), 0.0)
    nan_args = (q, *case.nan_garbage_args(), args[-1])  # slots past the context may hold NaN
    np.testing.assert_array_equal(
        np.asarray(pa.paged_decode_attention(*nan_args, scale=scale, impl=impl, **tuning)), np.asarray(got)
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("group", "num_kv_heads", "head_dim", "page_size", "dtype", "tuning"), [
    (2, 2, 256, 16, jnp.float32, dict(block_kv=16, num_splits=3)),  # the split combine + gate launch
    (4, 2, 256, 8, jnp.bfloat16, dict(block_kv=32, num_splits=2)),
    (6, 2, 16, 16, jnp.bfloat16, dict(block_kv=16, num_splits=4)),  # 27B's group
    (4, 1, 16, 32, jnp.bfloat16, dict(block_kv=16, num_splits=1)),  # one split: XLA gates
], ids=lambda x: getattr(x, "__name__", None))
def test_decode_kernel_gated_output(impl, group, num_kv_heads, head_dim, page_size, dtype, tuning):
    """With the gate (qg, per head query then gate), the output is o * sigmoid(gate) flattened, with zero rows
    past the batch up to out_rows, as the output projection takes it."""
    rng = np.random.default_rng(7)
    lens = [1, page_size + 1, 3 * page_size + 5, 0, 5 * page_size]  # 0: a padded row
    case, q = _decode_inputs(rng, lens, page_size, group, num_kv_heads, head_dim, dtype)
    num_q_heads = group * num_kv_heads
    qg = jnp.asarray(rng.standard_normal((8, num_q_heads * 2 * head_dim)), dtype)  # rows past B: never read
    args = (q, *case.args(), jnp.asarray(case.context_lens))
    scale = head_dim**-0.5
    want = pa.paged_decode_attention(*args, scale=scale, gate=qg, out_rows=8, impl="reference")
    got = pa.paged_decode_attention(*args, scale=scale, gate=qg, out_rows=8, impl=impl, **tuning)
    assert got.shape == want.shape == (8, num_q_heads * head_dim) and got.dtype == dtype
    _assert_close(got, want, TOL[dtype])
    np.testing.assert_array_equal(np.asarray(got[3].astype(jnp.float32)), 0.0)  # the padded row
    np.testing.assert_array_equal(np.asarray(got[5:].astype(jnp.float32)), 0.0)  # rows past the batch
    plain = pa.paged_decode_attention(*args, scale=scale, impl="reference")  # [B, Hq, hd]
    gate = qg[:5].reshape(5, num_q_heads, 2 * head_dim)[..., head_dim:]
    gated = (_f64(plain) / (1 + np.exp(-_f64(gate)))).reshape(5, -1)
    np.testing.assert_allclose(_f64(want[:5]), gated, rtol=TOL[dtype], atol=TOL[dtype])


def _inputs_case(rng, dtype, num_q_heads=4, num_kv_heads=2, head_dim=32, rotary=8, rows=6):
    """Raw projections of `rows` rows (the first 3 are the batch), cos/sin, norms and random pools."""
    case = PagedCase(rng, [5, 9, 2], 4, num_kv_heads, head_dim, dtype)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    positions = jnp.asarray([4, 8, 1, 0, 0, 0])
    cos, sin = rope_cos_sin(positions, rotary, 10_000.0, dtype)  # [rows, r]
    slots = np.asarray([case.page_tables[s, (n - 1) // 4] * 4 + (n - 1) % 4 for s, n in enumerate([5, 9, 2])])
    args = (normal(rows, num_q_heads * 2 * head_dim), normal(rows, num_kv_heads * head_dim),
            normal(rows, num_kv_heads * head_dim), cos, sin, normal(head_dim) * 0.1, normal(head_dim) * 0.1,
            jnp.asarray(slots, jnp.int32), case.k_pages, case.v_pages)
    return case, args


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_inputs_kernel(impl, dtype):
    """q/k norms, RoPE and the K/V write of one launch against the reference; other slots untouched."""
    case, args = _inputs_case(np.random.default_rng(8), dtype)
    kw = dict(num_q_heads=4, eps=1e-6)
    q_want, k_want, v_want = pa.decode_attention_inputs(*args, **kw, impl="reference")
    q_got, k_got, v_got = pa.decode_attention_inputs(*args, **kw, impl=impl)
    assert q_got.shape == (3, 4, 32) and q_got.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 2**-7  # bf16: a product or sum one rounding apart
    _assert_close(q_got, q_want, tol)
    for got, want, before in ((k_got, k_want, case.k_pages), (v_got, v_want, case.v_pages)):
        _assert_close(got, want, tol)
        changed = np.any(np.asarray(got != before), axis=(2, 3))  # [P, page_size]
        assert changed.sum() <= 3 and not changed[0].any()  # only the three slots (page 0 is the null page)


def test_decode_attention_inputs_reference_matches_layer():
    """The reference applies the model layer's q/k norms and RoPE to the layer's own projections."""
    config = preset("tiny")
    attn = GatedAttention(config, jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, config.hidden_size))
    positions = jnp.asarray([4, 8, 1])
    qg, k, v = XlaProjections().project(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    q_want, k_want, v_want, _ = attn.heads(qg, k, v, positions)  # [3, H, hd]
    cos, sin = rope_cos_sin(positions, attn.rotary_dim, attn.rope_theta, x.dtype)
    pages = jnp.zeros((4, 4, config.num_key_value_heads, config.head_dim))
    slots = jnp.asarray([5, 6, 13], jnp.int32)
    q, k_pages, v_pages = reference.decode_attention_inputs(
        qg, k, v, cos, sin, attn.q_norm.weight[...], attn.k_norm.weight[...], slots, pages, pages,
        num_q_heads=config.num_attention_heads, eps=config.rms_norm_eps)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q_want))
    np.testing.assert_array_equal(np.asarray(k_pages.reshape(16, *k_want.shape[1:])[slots]), np.asarray(k_want))
    np.testing.assert_array_equal(np.asarray(v_pages.reshape(16, *v_want.shape[1:])[slots]), np.asarray(v_want))


PREFILL_CASES = [  # q_lens, prefix_lens, group, Hkv, head_dim, page_size, dtype, tuning
    ([1, 63, 64, 65], [0, 0, 0, 0], 1, 2, 16, 16, jnp.float32, dict(block_q=32, block_kv=16)),
    ([1, 63, 64, 65], [0, 0, 0, 0], 2, 1, 16, 8, jnp.bfloat16, dict(block_q=16, block_kv=32)),
    ([5, 1, 0, 40], [37, 8, 0, 7], 4, 1, 16, 8, jnp.float32, dict(block_q=16, block_kv=16)),  # extend
    ([3, 17, 1], [21, 0, 64], 2, 2, 256, 16, jnp.float32, dict(block_q=16, block_kv=16)),
    ([3, 17, 1], [21, 0, 64], 4, 1, 256, 32, jnp.bfloat16, dict(block_q=32, block_kv=16)),
    ([9, 30], [0, 13], 6, 1, 16, 8, jnp.float32, dict(block_q=16, block_kv=16)),  # 27B's group
    # KV splits: a few new tokens over long cached prefixes, splits with no block, the split waves' choice
    ([4, 16], [150, 90], 4, 2, 16, 16, jnp.float32, dict(block_q=16, block_kv=16, num_splits=3)),
    ([1, 5, 0], [200, 0, 40], 2, 1, 256, 8, jnp.bfloat16, dict(block_q=16, block_kv=16, num_splits=8)),
    ([16], [300], 4, 1, 16, 16, jnp.float32, dict(block_q=16, block_kv=16)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("q_lens", "prefix_lens", "group", "num_kv_heads", "head_dim", "page_size", "dtype", "tuning"),
    PREFILL_CASES,
    ids=lambda x: getattr(x, "__name__", None),
)
def test_prefill_kernel(impl, q_lens, prefix_lens, group, num_kv_heads, head_dim, page_size, dtype, tuning):
    rng = np.random.default_rng(4)
    case, q, cu = _prefill_inputs(rng, q_lens, prefix_lens, page_size, group, num_kv_heads, head_dim, dtype, pad_rows=5)
    args = (q, *case.args(), jnp.asarray(cu), jnp.asarray(case.context_lens))
    scale = head_dim**-0.5
    want = pa.paged_prefill_attention(*args, scale=scale, impl="reference")
    got = pa.paged_prefill_attention(*args, scale=scale, impl=impl, **tuning)
    assert got.shape == q.shape and got.dtype == q.dtype
    _assert_close(got, want, TOL[dtype])
    np.testing.assert_array_equal(np.asarray(got[cu[-1] :].astype(jnp.float32)), 0.0)
    nan_args = (q, *case.nan_garbage_args(), *args[-2:])  # slots past the context may hold NaN
    np.testing.assert_array_equal(
        np.asarray(pa.paged_prefill_attention(*nan_args, scale=scale, impl=impl, **tuning)), np.asarray(got)
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_kernel_long_matches_dense(impl):
    """4097 new tokens (small heads): the kernel straight against float64 dense attention."""
    rng = np.random.default_rng(5)
    case, q, cu = _prefill_inputs(rng, [4097], [0], 64, 2, 1, 16, jnp.float32, pad_rows=2)
    scale = 0.25
    got = pa.paged_prefill_attention(
        q,
        *case.args(),
        jnp.asarray(cu),
        jnp.asarray(case.context_lens),
        scale=scale,
        impl=impl,
        block_q=64,
        block_kv=64,
    )
    _assert_close(got, _dense_prefill(case, q, cu, scale), DENSE_TOL[jnp.float32])


def test_dispatch():
    """auto falls back to the reference off GPU or on unsupported shapes; forcing the kernel there raises."""
    rng = np.random.default_rng(6)
    case, q = _decode_inputs(rng, [3, 9], 8, 2, 1, 24, jnp.float32)  # head_dim 24: no kernel
    args = (q, *case.args(), jnp.asarray(case.context_lens))
    want = reference.paged_decode_attention(*args, scale=0.2)
    np.testing.assert_array_equal(np.asarray(pa.paged_decode_attention(*args, scale=0.2)), np.asarray(want))
    with pytest.raises(ValueError, match="head_dim"):
        pa.paged_decode_attention(*args, scale=0.2, impl="interpret")
    with pytest.raises(ValueError, match="impl"):
        pa.paged_decode_attention(*args, scale=0.2, impl="triton")
