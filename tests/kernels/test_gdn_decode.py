"""One-token gated-delta-rule decode over state slots: the references against the token-scan oracle and the GDN
layer's own decode math, and the Pallas kernels (interpret mode on CPU, compiled when a GPU is present)
against the references.

Every input is random, the pools included: slot 0 (the null slot, named by padded rows) and unused slots hold
garbage. Real rows and slots are compared; slots that no real row names must come back bit-identical. The
references write the padded rows' garbage to slot 0; the kernels skip padded rows (zero output, slot 0
untouched), which is checked too.
Tolerance 1e-5 (rtol = atol) everywhere: the kernels upcast bf16 inputs exactly and compute in fp32 like the
references; only the order of the fp32 sums differs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.config import preset
from hybrid_jax.layers.gdn import GatedDeltaNet
from hybrid_jax.layers.projections import XlaProjections
from pallas_kernels import gdn_decode as gd
from pallas_kernels.gdn_decode import reference
from pallas_kernels.math.gated_delta import gated_delta_scan, gated_delta_step
from pallas_kernels.math.gdn import causal_conv

TOL = 1e-5

ON_GPU = jax.default_backend() == "gpu"
IMPLS = [  # on a GPU the compiled kernel replaces the interpreter
    pytest.param("interpret", marks=pytest.mark.skipif(ON_GPU, reason="CPU only: the GPU runs the kernel")),
    pytest.param("kernel", marks=pytest.mark.skipif(not ON_GPU, reason="needs a GPU")),
]
CONV_KERNEL = 4


def _l2(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


class Step:
    """Random decode inputs for `num_real` rows on distinct random slots, then `num_pad` padded rows on slot 0."""

    def __init__(self, seed, num_real, num_pad, num_k_heads, num_v_heads, dk, dv, dtype=jnp.float32, spare_slots=3):
        self.rng = rng = np.random.default_rng(seed)
        self.num_real = num_real
        batch = num_real + num_pad
        num_slots = 1 + num_real + spare_slots
        real = rng.permutation(np.arange(1, num_slots))[:num_real]
        self.slots = np.concatenate([real, np.zeros(num_pad, int)]).astype(np.int32)  # [B]
        # token positions: some before the conv ring first fills (< K), padded rows at 0
        self.positions = np.concatenate([rng.integers(0, 3 * CONV_KERNEL, num_real), np.zeros(num_pad, int)])
        self.heads = (num_k_heads, num_v_heads, dk, dv)
        self.dtype = dtype
        self.q = jnp.asarray(_l2(self.normal(batch, num_k_heads, dk)) * dk**-0.5, dtype)  # [B, Hk, dk]
        self.k = jnp.asarray(_l2(self.normal(batch, num_k_heads, dk)), dtype)  # [B, Hk, dk]
        self.v = jnp.asarray(self.normal(batch, num_v_heads, dv), dtype)  # [B, Hv, dv]
        self.g = jnp.asarray(-np.logaddexp(0, 2 * self.normal(batch, num_v_heads)))  # [B, Hv]
        self.beta = jnp.asarray(1 / (1 + np.exp(-2 * self.normal(batch, num_v_heads))))  # [B, Hv]
        self.state_pool = jnp.asarray(self.normal(num_slots, num_v_heads, dk, dv))  # [slots, Hv, dk, dv]

    def normal(self, *shape) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(np.float32)

    def args(self):
        return self.q, self.k, self.v, self.g, self.beta, jnp.asarray(self.slots), self.state_pool

    def fused_args(self):
        """Raw-projection inputs of the fused step (and a random conv ring pool), for the same rows and slots."""
        num_k_heads, num_v_heads, dk, dv = self.heads
        batch, channels = len(self.slots), 2 * num_k_heads * dk + num_v_heads * dv
        conv_pool = jnp.asarray(self.normal(self.state_pool.shape[0], CONV_KERNEL, channels), self.dtype)
        return (
            jnp.asarray(self.normal(batch, channels), self.dtype),  # mixed_qkv [B, C]
            jnp.asarray(self.normal(batch, num_v_heads), self.dtype),  # a [B, Hv]
            jnp.asarray(self.normal(batch, num_v_heads), self.dtype),  # b [B, Hv]
            jnp.asarray(self.normal(CONV_KERNEL, channels) * 0.5, self.dtype),  # conv_weight [K, C]
            jnp.asarray(np.log(self.rng.uniform(1, 16, num_v_heads)), jnp.float32),  # A_log [Hv]
            jnp.asarray(self.normal(num_v_heads), self.dtype),  # dt_bias [Hv]
            jnp.asarray(self.slots),
            jnp.asarray(self.positions, jnp.int32),
            conv_pool,
            self.state_pool,
        )

    def head_kwargs(self):
        num_k_heads, _, dk, dv = self.heads
        return dict(num_k_heads=num_k_heads, head_k_dim=dk, head_v_dim=dv)

    def check_pool(self, got, want, original):
        """Real rows' slots close; slots named by no real row (not the null slot) unchanged."""
        got, want, original = (np.asarray(x, np.float32) for x in (got, want, original))
        real = self.slots[: self.num_real]
        _assert_close(got[real], want[real])
        keep = np.ones(got.shape[0], bool)
        keep[real] = False
        keep[0] = False
        np.testing.assert_array_equal(got[keep], original[keep])


def _assert_padding_skipped(o, pools, num_real):
    """The kernels skip padded rows (slot 0, rows num_real on): zero output, the null slot untouched."""
    np.testing.assert_array_equal(np.asarray(o[num_real:]), 0)
    for got, original in pools:
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(original[0]))


def _assert_close(got, want, tol=TOL):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


# ---------------------------------------------------------------- the references


@pytest.mark.parametrize(
    ("num_k_heads", "num_v_heads", "dk", "dv"), [(2, 4, 16, 24), (1, 3, 16, 16)], ids=["group2-dk!=dv", "group3"]
)
def test_reference_matches_scan(num_k_heads, num_v_heads, dk, dv):
    """Three decode steps through the pool equal the oracle scan over the three tokens of each real row."""
    steps = [Step(seed, 3, 2, num_k_heads, num_v_heads, dk, dv) for seed in range(3)]
    slots, pool = jnp.asarray(steps[0].slots), steps[0].state_pool
    outs = []
    for step in steps:  # fresh tokens each step, the first step's slots
        o, pool = jax.jit(reference.gdn_decode)(*step.args()[:5], slots, pool)
        outs.append(o[:3])
    real = steps[0].slots[:3]
    tokens = [jnp.stack([getattr(s, name)[:3] for s in steps], axis=1) for name in ("q", "k", "v", "g", "beta")]
    o_want, final = gated_delta_scan(*tokens, steps[0].state_pool[real])  # [3, 3, Hv, dv], [3, Hv, dk, dv]
    _assert_close(jnp.stack(outs, axis=1), o_want)
    steps[0].check_pool(pool, steps[0].state_pool.at[real].set(final), steps[0].state_pool)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_reference_matches_layer(dtype):
    """The fused reference equals the layer's conv, heads and gates + gated_delta_step on its own projections."""
    config = preset("tiny").replace(linear_num_value_heads=6)  # Hk = 2, Hv = 6 (group 3), dk = dv = 16
    layer = GatedDeltaNet(config, dtype, rngs=nnx.Rngs(0))
    step = Step(1, 3, 2, config.linear_num_key_heads, 6, 16, 16, dtype)
    x = jnp.asarray(step.normal(5, 1, config.hidden_size), dtype)  # [B, 1, D]
    *_, conv_pool, state_pool = step.fused_args()
    slots = jnp.asarray(step.slots)
    mixed, _, b, a = layer.in_projections(x[:, 0], XlaProjections())  # fp32, as the engine hands them over
    # ring column of position t: t mod K; the window is the K-1 positions before the token's, then its own
    before = (step.positions[:, None] + np.arange(1 - CONV_KERNEL, 0)) % CONV_KERNEL  # [B, K-1]
    cached = np.asarray(conv_pool)[step.slots[:, None], before]  # [B, K-1, C]
    window = jnp.concatenate([jnp.asarray(cached), mixed[:, None]], axis=1)  # [B, K, C]
    q, k, v = layer.heads(causal_conv(window, layer.conv1d.weight[...])[:, 0])
    g, beta = layer.gates(b, a)
    o_want, state = gated_delta_step(q, k, v, g, beta, state_pool[slots])

    o, conv_out, state_out = reference.gdn_decode_fused(
        mixed,
        a,
        b,
        layer.conv1d.weight[...],
        layer.A_log[...],
        layer.dt_bias[...],
        slots,
        jnp.asarray(step.positions, jnp.int32),
        conv_pool,
        state_pool,
        **step.head_kwargs(),
    )
    _assert_close(o[:3], o_want[:3])
    step.check_pool(state_out, state_pool.at[slots].set(state), state_pool)
    conv_want = conv_pool.at[slots, step.positions % CONV_KERNEL].set(mixed.astype(conv_pool.dtype))
    step.check_pool(conv_out, conv_want, conv_pool)


# ---------------------------------------------------------------- the kernels against the references

CASES = [  # seed, Hk, Hv, dk, dv, dtype, tuning
    (2, 2, 4, 16, 32, jnp.float32, dict(block_v=16)),  # group 2, dk != dv, two dv blocks
    (3, 1, 3, 32, 16, jnp.bfloat16, {}),  # group 3, bf16 inputs
]
IDS = ["f32-group2", "bf16-group3"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("seed", "num_k_heads", "num_v_heads", "dk", "dv", "dtype", "tuning"), CASES, ids=IDS)
def test_decode_kernel(impl, seed, num_k_heads, num_v_heads, dk, dv, dtype, tuning):
    step = Step(seed, 4, 3, num_k_heads, num_v_heads, dk, dv, dtype)
    o_want, pool_want = reference.gdn_decode(*step.args())
    o, pool = gd.gdn_decode(*step.args(), impl=impl, **tuning)
    _assert_close(o[:4], o_want[:4])
    step.check_pool(pool, pool_want, step.state_pool)
    _assert_padding_skipped(o, [(pool, step.state_pool)], step.num_real)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("seed", "num_k_heads", "num_v_heads", "dk", "dv", "dtype", "tuning"), CASES, ids=IDS)
def test_fused_kernel(impl, seed, num_k_heads, num_v_heads, dk, dv, dtype, tuning):
    step = Step(seed, 4, 3, num_k_heads, num_v_heads, dk, dv, dtype)
    args = step.fused_args()
    o_want, conv_want, state_want = reference.gdn_decode_fused(*args, **step.head_kwargs())
    o, conv, state = gd.gdn_decode_fused(*args, **step.head_kwargs(), impl=impl, **tuning)
    _assert_close(o[:4], o_want[:4])
    step.check_pool(conv, conv_want, args[-2])
    step.check_pool(state, state_want, args[-1])
    _assert_padding_skipped(o, [(conv, args[-2]), (state, args[-1])], step.num_real)


def _snapshot_args(step: Step, conv_pool=None, num_snapshots: int = 6):
    """Snapshot ids [B] (rows 0 and 2 name snapshots 4 and 1; the rest, padding included, none) and random
    snapshot pools shaped as the slot pools."""
    ids = np.zeros(len(step.slots), np.int32)
    ids[[0, 2]] = [4, 1]
    state = jnp.asarray(step.normal(num_snapshots, *step.state_pool.shape[1:]))
    if conv_pool is None:
        return jnp.asarray(ids), state
    conv = jnp.asarray(step.normal(num_snapshots, *conv_pool.shape[1:]), conv_pool.dtype)
    return jnp.asarray(ids), conv, state


def _check_snapshots(step: Step, ids, got_pools, original_pools, slot_pools):
    """Each named snapshot holds its row's slot as the step left it (bit for bit); the others are unchanged."""
    ids = np.asarray(ids)
    named = ids[ids > 0]
    for got, original, slots in zip(got_pools, original_pools, slot_pools, strict=True):
        got, original, slots = (np.asarray(x, np.float32) for x in (got, original, slots))
        np.testing.assert_array_equal(got[named], slots[step.slots[ids > 0]])
        keep = np.ones(got.shape[0], bool)
        keep[named] = False
        np.testing.assert_array_equal(got[keep], original[keep])


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
@pytest.mark.parametrize(("seed", "num_k_heads", "num_v_heads", "dk", "dv", "dtype", "tuning"), CASES, ids=IDS)
def test_decode_snapshots(impl, seed, num_k_heads, num_v_heads, dk, dv, dtype, tuning):
    """With snapshot ids: the same output and slots as without (to fp32 rounding), and each named snapshot gets
    its row's new state."""
    step = Step(seed, 4, 3, num_k_heads, num_v_heads, dk, dv, dtype)
    ids, snapshots = _snapshot_args(step)
    tuning = tuning if impl != "reference" else {}
    o_want, pool_want = gd.gdn_decode(*step.args(), impl=impl, **tuning)
    o, pool, snap = gd.gdn_decode(*step.args(), ids, snapshots, impl=impl, **tuning)
    _assert_close(o[:4], o_want[:4])
    _assert_close(pool[1:], pool_want[1:])
    _check_snapshots(step, ids, [snap], [snapshots], [pool])


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
@pytest.mark.parametrize(("seed", "num_k_heads", "num_v_heads", "dk", "dv", "dtype", "tuning"), CASES, ids=IDS)
def test_fused_snapshots(impl, seed, num_k_heads, num_v_heads, dk, dv, dtype, tuning):
    """The fused step with snapshot ids: the same output and slots as without, and each named snapshot gets its
    row's ring (the K columns up to its token, as the slot's ring after the step) and new state, bit for bit."""
    step = Step(seed, 4, 3, num_k_heads, num_v_heads, dk, dv, dtype)
    args = step.fused_args()
    extra = _snapshot_args(step, args[-2])
    tuning = tuning if impl != "reference" else {}
    want = gd.gdn_decode_fused(*args, **step.head_kwargs(), impl=impl, **tuning)
    o, conv, state, snap_conv, snap_state = gd.gdn_decode_fused(*args, *extra, **step.head_kwargs(), impl=impl,
                                                                **tuning)
    for got, w in zip((o[:4], conv[1:], state[1:]), (want[0][:4], want[1][1:], want[2][1:]), strict=True):
        _assert_close(got, w)
    _check_snapshots(step, extra[0], [snap_conv, snap_state], extra[1:], [conv, state])


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
def test_fused_snapshot_ring_of_a_stacked_pool(impl):
    """With a snapshot conv pool stacking three layers' rings [snapshots, 3 K, C], snapshot_layer=1 writes the
    named snapshots' middle K rows, as the one-layer pool's would be written, and nothing else."""
    step = Step(3, 4, 3, 2, 4, 16, 32, jnp.bfloat16)
    args = step.fused_args()
    ids, conv, state = _snapshot_args(step, args[-2])
    width = conv.shape[1]
    stacked = jnp.asarray(step.normal(conv.shape[0], 3 * width, conv.shape[2]), conv.dtype)
    _, _, _, want_conv, want_state = gd.gdn_decode_fused(*args, ids, conv, state, **step.head_kwargs(), impl=impl)
    *_, got_conv, got_state = gd.gdn_decode_fused(*args, ids, stacked, state, **step.head_kwargs(), impl=impl,
                                                  snapshot_layer=1)
    want = np.asarray(stacked, np.float32)
    named = np.asarray(ids)[np.asarray(ids) > 0]
    want[named, width: 2 * width] = np.asarray(want_conv, np.float32)[named]
    np.testing.assert_array_equal(np.asarray(got_conv, np.float32), want)
    np.testing.assert_array_equal(np.asarray(got_state), np.asarray(want_state))


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_kernel_ignores_projection_rows_past_the_batch(impl):
    """The engine hands over its projections padded to the few-row kernel's rows: those past the batch (random
    here) are never read."""
    step = Step(5, 4, 3, 2, 4, 16, 32, jnp.bfloat16)
    args = step.fused_args()
    heads = step.head_kwargs()
    want = gd.gdn_decode_fused(*args, **heads, impl=impl)
    extra = jax.random.normal(jax.random.key(1), (9, args[0].shape[1] + 2 * args[1].shape[1]), jnp.float32)
    mixed, a, b = (jnp.concatenate([t, e.astype(t.dtype)]) for t, e in zip(
        args[:3], jnp.split(extra, [args[0].shape[1], args[0].shape[1] + args[1].shape[1]], axis=1), strict=True))
    got = gd.gdn_decode_fused(mixed, a, b, *args[3:], **heads, impl=impl)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("impl", [*IMPLS, "reference"])
def test_fused_output_rows_padded(impl):
    """out_rows = 16 for a batch of 7 (the few-row projections' padding): the same o on the batch's rows, zeros
    after them (the kernel's output buffer starts as garbage), the same pools but for the null slot 0 (the
    reference's padding rows scatter into it, in no fixed order on a GPU)."""
    step = Step(6, 4, 3, 2, 4, 16, 32, jnp.bfloat16)
    args = step.fused_args()
    want = gd.gdn_decode_fused(*args, **step.head_kwargs(), impl=impl)
    got = gd.gdn_decode_fused(*args, **step.head_kwargs(), out_rows=16, impl=impl)
    assert got[0].shape == (16, *want[0].shape[1:])
    np.testing.assert_array_equal(np.asarray(got[0][:7]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[0][7:]), 0.0)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(g[1:], np.float32), np.asarray(w[1:], np.float32))
    with pytest.raises(ValueError, match="out_rows 6 < batch 7"):
        gd.gdn_decode_fused(*args, **step.head_kwargs(), out_rows=6, impl=impl)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("num_v_heads", [16, 32, 48])
def test_kernels_real_shapes_in_place_gpu(num_v_heads):
    """Qwen3.5 head shapes, bf16, 61 real rows + 3 padded: matches the reference, and a donated pool is
    updated in its own buffer."""
    step = Step(8, 61, 3, 16, num_v_heads, 128, 128, jnp.bfloat16)
    o_want, pool_want = reference.gdn_decode(*step.args())
    pool_in = jnp.array(step.state_pool, copy=True)
    pointer = pool_in.unsafe_buffer_pointer()
    decode = jax.jit(lambda *a: gd.gdn_decode(*a, impl="kernel"), donate_argnums=6)
    o, pool = decode(*step.args()[:-1], pool_in)
    assert pool.unsafe_buffer_pointer() == pointer
    _assert_close(o[:61], o_want[:61])
    step.check_pool(pool, pool_want, step.state_pool)

    args = step.fused_args()
    want = reference.gdn_decode_fused(*args, **step.head_kwargs())
    got = jax.jit(lambda *a: gd.gdn_decode_fused(*a, **step.head_kwargs(), impl="kernel"), donate_argnums=(8, 9))(
        *args[:-2], jnp.array(args[-2], copy=True), jnp.array(args[-1], copy=True)
    )
    _assert_close(got[0][:61], want[0][:61])
    step.check_pool(got[1], want[1], args[-2])
    step.check_pool(got[2], want[2], args[-1])


def test_dispatch():
    step = Step(9, 2, 1, 1, 2, 16, 24)  # dv = 24: not a power of two, the kernels can't take it
    with pytest.raises(ValueError, match="dv 24"):
        gd.gdn_decode(*step.args(), impl="kernel")
    with pytest.raises(ValueError, match="dv 24"):
        gd.gdn_decode_fused(*step.fused_args(), **step.head_kwargs(), impl="kernel")
    o, pool = gd.gdn_decode(*step.args())  # auto: the reference
    o_want, pool_want = reference.gdn_decode(*step.args())
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_want))
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(pool_want))
