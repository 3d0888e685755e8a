"""The few-row matmul kernel against its reference: interpret mode on CPU, compiled when a GPU is present.

Random bf16 inputs; row counts 1, 5, 16, 33 (padding to the 16/64-row tile); one weight and several of
different widths sharing x; K-splits and column blocks that do and do not fill the grid. `gemv_add` (the
projection added to a residual, its K-splits summed in the launch) against its reference. Tolerance: fp32
accumulation in both, only the summation order differs (rtol 1e-5, atol 1e-5 x the largest output); the
bf16 output case within one bf16 ulp. The gate/up kernel with the SwiGLU product (`gemv_swiglu`) against
the two projections and `swiglu_product`, which rounds as HF's bf16 MLP does. Both with an RMS norm's division
deferred to their products' rows (`NormedRows`) against the product of the norm's output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.gemv as gemv_dispatch
import pallas_kernels.gemv.kernel as gemv_kernel
import pallas_kernels.gemv.tiles as gemv_tiles
from pallas_kernels.gemv import MAX_ROWS, NormedRows, gemv, gemv_add, gemv_swiglu
from pallas_kernels.gemv import reference as gemv_reference
from pallas_kernels.gemv.kernel import plan
from pallas_kernels.gemv.reference import swiglu_product

ON_GPU = jax.default_backend() == "gpu"
IMPL = "kernel" if ON_GPU else "interpret"


def _inputs(seed, rows, k, widths):
    keys = jax.random.split(jax.random.key(seed), 1 + len(widths))
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    weights = tuple(jax.random.normal(kw, (k, n), jnp.bfloat16) * k**-0.5
                    for kw, n in zip(keys[1:], widths, strict=True))
    return x, weights


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("k, widths, tuning", [
    (256, (96,), dict(block_k=32, block_n=32, target_programs=12)),  # 3 column blocks x 4 K-splits
    (192, (64,), dict(block_k=64, block_n=64, target_programs=1)),  # one program, no split
    (512, (48,), dict(block_k=128, block_n=64, target_programs=8)),  # block_n halves to 16 to divide N
    (256, (96, 32, 16, 16), dict(block_k=64, block_n=32, target_programs=30)),  # qkv/z/b/a-like: 6 blocks x 4
])
def test_matches_reference(rows, k, widths, tuning):
    x, weights = _inputs(rows * 7 + k, rows, k, widths)
    got = gemv(x, weights, jnp.float32, impl=IMPL, **tuning)
    want = gemv(x, weights, jnp.float32, impl="reference")
    assert len(got) == len(widths)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (rows, w.shape[1])
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_bf16_output_and_leading_axes():
    x, weights = _inputs(3, 6, 128, (64,))
    x = x.reshape(2, 3, 128)
    (got,) = gemv(x, weights, impl=IMPL, block_k=32, block_n=32, target_programs=16)
    (want,) = gemv(x, weights, impl="reference")
    assert got.shape == (2, 3, 64) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("k, n, tuning", [
    (256, 96, dict(block_k=32, block_n=32, target_programs=12)),  # 3 column blocks x 4 K-splits
    (192, 64, dict(block_k=64, block_n=64, target_programs=1)),  # one program, no split
    (512, 48, dict(block_k=64, block_n=64, target_programs=64)),  # 3 blocks of 16 columns x 8 splits
])
def test_add_matches_reference(rows, k, n, tuning):
    """residual + x w with the K-splits summed by the last program of each column block, twice in a row on
    the same counters (each call must leave them zeroed for the next), with and without the next norm."""
    x, (w,) = _inputs(rows + k, rows, k, (n,))
    residual = jax.random.normal(jax.random.key(rows), (rows, n), jnp.float32)
    norm = ((jax.random.normal(jax.random.key(k), (n,)) * 0.1).astype(jnp.bfloat16), 1e-6)
    arrivals = jnp.zeros(n // 16, jnp.int32)
    want, *want_normed = gemv_reference.gemv_add(x, w, residual, norm[0])
    want_normed = NormedRows(*want_normed, norm[1])
    scale = float(jnp.max(jnp.abs(want - residual)))  # the projection's size: one bf16 ulp of it may differ
    for next_norm in (None, norm):
        got, normed, arrivals = gemv_add(x, w, residual, arrivals, norm=next_norm, impl=IMPL, **tuning)
        assert got.shape == (rows, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=2**-7 * scale)
        np.testing.assert_array_equal(arrivals, 0)
        if next_norm is None:
            assert normed is None
        else:
            np.testing.assert_allclose(normed.normalized(jnp.float32), want_normed.normalized(jnp.float32),
                                       rtol=2**-7, atol=2**-7 * scale)


def test_add_computes_only_the_real_rows():
    """A batch of 5 padded to the tile's 16 rows: the 5 as the reference, the padding rows zero. 96 columns in
    32-column blocks: the next norm's sums of squares come in 3 blocks padded with a zero one to 4."""
    x, (w,) = _inputs(9, 16, 256, (96,))
    residual = jax.random.normal(jax.random.key(9), (16, 96), jnp.float32)
    norm = (jnp.zeros(96, jnp.bfloat16), 1e-6)
    arrivals = jnp.zeros(96 // 16, jnp.int32)
    want, _, want_sums = gemv_reference.gemv_add(x, w, residual, norm[0])
    for tuning in (dict(block_k=32, block_n=32, target_programs=12), dict(block_n=32, target_programs=1)):
        got, normed, arrivals = gemv_add(x, w, residual, arrivals, norm=norm, real_rows=5, impl=IMPL, **tuning)
        np.testing.assert_allclose(got[:5], want[:5], rtol=0, atol=2**-7 * float(jnp.max(jnp.abs(want - residual))))
        np.testing.assert_array_equal(got[5:], 0)
        assert normed.sums.shape == (4, 16)
        np.testing.assert_allclose(jnp.sum(normed.sums[:, :5], axis=0), want_sums[0, :5], rtol=2**-7)
        np.testing.assert_array_equal(normed.sums[:, 5:], 0)
        np.testing.assert_array_equal(normed.sums[3], 0)
        np.testing.assert_array_equal(normed.scaled[5:], 0)
        np.testing.assert_array_equal(arrivals, 0)


def _normed_rows(seed, rows, k, blocks):
    """A residual stream x [rows, K] fp32 through a zero-centred RMS norm (weight near zero), as `NormedRows`
    with its sums of squares over ``blocks`` column blocks, and the norm's output in bf16 as HF computes it."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, k), jnp.float32) * 3
    weight = (jax.random.normal(kw, (k,), jnp.float32) * 0.1).astype(jnp.bfloat16)
    sums = jnp.sum((x * x).reshape(rows, blocks, k // blocks), axis=-1).T  # [J, rows]
    scaled = (x * (1 + weight.astype(jnp.float32))).astype(jnp.bfloat16)
    xf = np.asarray(x, np.float64)
    want = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * (1 + np.asarray(weight, np.float64))
    return NormedRows(scaled, sums, 1e-6), jnp.asarray(want, jnp.float32).astype(jnp.bfloat16)


def test_normed_rows_normalize_as_the_model():
    normed, want = _normed_rows(0, 5, 256, 4)
    got = normed.normalized(jnp.bfloat16)  # rounded twice: within two bf16 ulps
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-7)


@pytest.mark.parametrize("rows, blocks", [(1, 3), (5, 4), (33, 5)])  # 3 and 5 blocks: padded to 4 and 8
def test_gemv_divides_by_the_deferred_rms(rows, blocks):
    """The product of `NormedRows` against the product of the norm's output (bf16 as HF's): they differ in
    where h is rounded, a bf16 ulp of h at most."""
    normed, h = _normed_rows(rows, rows, 240, blocks)
    _, weights = _inputs(rows, rows, 240, (96, 32))
    got = gemv(normed, weights, jnp.float32, impl=IMPL, block_k=16, block_n=32, target_programs=24)
    want = gemv(h, weights, jnp.float32, impl="reference")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=2**-6 * float(jnp.max(jnp.abs(w))))
    for g, w in zip(got, gemv(normed, weights, jnp.float32, impl="reference"), strict=True):  # kernel = reference
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_swiglu_divides_by_the_deferred_rms():
    normed, h = _normed_rows(7, 5, 240, 3)
    _, (w_gate, w_up) = _inputs(7, 5, 240, (64, 64))
    got = gemv_swiglu(normed, w_gate, w_up, impl=IMPL, block_k=64, block_n=32)
    want = gemv_swiglu(h, w_gate, w_up, impl="reference")
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-5,
                               atol=2**-6 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_plan_divides_and_fills():
    assert plan(3584, (1024,), block_k=128, block_n=128, target_programs=264) == (128, (128,), 28)
    bk, bns, splits = plan(4096, (12288, 12288), block_k=128, block_n=128, target_programs=264)
    assert (bk, bns) == (128, (128, 128)) and 2 * 12288 // 128 * splits <= 264 and (4096 // bk) % splits == 0
    assert plan(1024, (6144, 2048, 16, 16), block_k=128, block_n=128, target_programs=264)[1] == (128, 128, 16, 16)


def test_auto_falls_back_beyond_its_shapes():
    x, weights = _inputs(0, MAX_ROWS + 1, 64, (32,))
    np.testing.assert_array_equal(gemv(x, weights)[0], gemv(x, weights, impl="reference")[0])
    with pytest.raises(ValueError, match="rows"):
        gemv(x, weights, impl="interpret")
    with pytest.raises(ValueError, match="multiples of 16"):
        gemv(x[:2, :60], (weights[0][:60],), impl="interpret")


def test_auto_runs_the_kernel_for_the_weights_that_suit_it(monkeypatch):
    """A set with a narrow member (8 columns: a shard's slice of a small projection): one kernel launch for
    the others, XLA's dot for it, results in the caller's order."""
    import pallas_kernels.gemv as dispatch

    launched = []
    kernel_gemv = dispatch.kernel.gemv

    def spy(rows, weights, *args, **kw):
        launched.append([w.shape[1] for w in weights])
        return kernel_gemv(rows, weights, *args, **kw)

    monkeypatch.setattr(dispatch, "kernel_mode", lambda op, impl, reason: True if reason is None else None)
    monkeypatch.setattr(dispatch.kernel, "gemv", spy)
    x, weights = _inputs(3, 2, 64, (32, 8, 48))
    got = gemv(x, weights)
    assert launched == [[32, 48]]
    for g, w in zip(got, gemv(x, weights, impl="reference"), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("k, n, tuning", [
    (256, 96, dict(block_k=64, block_n=32)),  # 3 column blocks, 4 K steps
    (192, 64, dict(block_k=64, block_n=64, num_stages=2)),  # one program
    (512, 48, dict(block_k=128, block_n=64)),  # block_n halves to 16 to divide N
])
def test_swiglu_matches_reference(rows, k, n, tuning):
    x, (w_gate, w_up) = _inputs(rows + k, rows, k, (n, n))
    got = gemv_swiglu(x, w_gate, w_up, impl=IMPL, **tuning)
    want = gemv_swiglu(x, w_gate, w_up, impl="reference")
    assert got.shape == want.shape == (rows, n) and got.dtype == jnp.bfloat16
    # The sums differ in order only; a sum that lands on the other side of a bf16 rounding boundary moves
    # the product by about one bf16 ulp of each factor.
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2**-6,
                               atol=2**-7 * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


def test_swiglu_product_rounds_each_step():
    # Pairs where rounding the SiLU first changes the bf16 product (numpy arrays of ml_dtypes' bfloat16).
    gate = np.asarray([0.640625, -0.53515625, -2.328125, -0.21875, -1.2421875]).astype(jnp.bfloat16)
    up = np.asarray([-2.578125, -5.03125, -1.03125, -0.51953125, -4.40625]).astype(jnp.bfloat16)
    g = gate.astype(np.float64)
    act = (g / (1 + np.exp(-g))).astype(jnp.bfloat16)  # the SiLU rounded, then the product rounded
    want = (act.astype(np.float64) * up.astype(np.float64)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(swiglu_product(jnp.asarray(gate), jnp.asarray(up))), want)


def test_swiglu_auto_falls_back_for_untuned_shapes(monkeypatch):
    """The "auto" dispatch fuses only shapes with a measured tuning and at most SWIGLU_MAX_ROWS rows; the others
    take gemv and the product. The reasons it hands to kernel_mode are what is checked."""
    reasons = []

    def record(op, impl, reason):
        if op == "gemv_swiglu":
            reasons.append(reason)
        return None  # the reference either way

    monkeypatch.setattr(gemv_dispatch, "kernel_mode", record)
    x, (w_gate, w_up) = _inputs(0, 2, 128, (64, 64))
    got = gemv_swiglu(x, w_gate, w_up)
    want = swiglu_product(*gemv(x, (w_gate, w_up), impl="reference"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    monkeypatch.setitem(gemv_tiles.SWIGLU.on(), (128, 64), gemv_tiles.SWIGLU.default)
    gemv_swiglu(x, w_gate, w_up)
    x_many, _ = _inputs(1, gemv_tiles.SWIGLU_MAX_ROWS + 1, 128, (64,))
    gemv_swiglu(x_many, w_gate, w_up)
    assert "no measured tuning" in reasons[0] and reasons[1] is None and "rows >" in reasons[2]


def test_add_takes_its_shapes_tuning_unless_given(monkeypatch):
    """`gemv_add`'s tiles come from `tiles.ADD` for its (K, N), and a keyword given overrides them: with the
    table's 16-column blocks the launch needs one counter per 16 columns, with 32 given half as many."""
    x, (w,) = _inputs(3, 1, 128, (96,))
    residual = jnp.zeros((1, 96), jnp.float32)
    monkeypatch.setitem(gemv_tiles.ADD.on(), (128, 96),
                        gemv_tiles.GemvTiles(block_n=16, block_k=64, num_warps=4, num_stages=3, waves=1))
    few = jnp.zeros(96 // 32, jnp.int32)  # 3 counters: enough for 32-column blocks, not for 16
    with pytest.raises(ValueError, match="need at least 6 counters"):
        gemv_kernel.gemv_add(x, w, residual, few, interpret=True)
    got, _, _, arrivals = gemv_kernel.gemv_add(x, w, residual, few, block_n=32, interpret=True)
    want, _, _ = gemv_reference.gemv_add(x, w, residual)
    np.testing.assert_allclose(got, want, rtol=0, atol=2**-7 * float(jnp.max(jnp.abs(want))))
    np.testing.assert_array_equal(arrivals, 0)
