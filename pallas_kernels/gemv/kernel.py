"""Pallas kernel for a few rows times one or more weight matrices (the decode step's projections), split over K.

Same signature and semantics as `reference.py` (plus tuning keywords). Written for Pallas' Triton lowering.

At decode, x has 1-64 rows and the time is that of streaming the weights from HBM once. XLA rewrites such
dots into reductions (the vector-matrix product becomes a multiply and a reduce, sometimes with the f32
product written out in between) that reach 0.3-1.4 TB/s at 0.8B shapes on the H200, and issues one
launch per projection. Here one launch serves all the projections that read the same x (q/k/v/gate,
gate/up, GDN's qkv/z/b/a): the grid's first axis runs over every weight's column blocks in turn. A
program owns a [K / splits, block_n] slab of one weight, walks it in [block_k, block_n] tiles (contiguous
along N, so loads coalesce) with Triton's software pipeline keeping several tiles in flight, and
multiplies each by the rows on the tensor cores (rows padded to a power of two >= 16, free beside the
weight traffic).
When the column blocks alone give too few programs to fill the GPU, K is split too: each split writes an
fp32 partial and XLA sums the few partials (fused into the consumer).

`gemv_swiglu` is the MLP's gate/up pair with the SwiGLU product in the epilogue: a program owns the same
column block of both weights, walks K whole (the product needs finished sums) and writes
silu(gate) * up, rounded as `reference.swiglu_product` rounds. It saves the product's launch and reads no
gate/up activations back; its tiles are tuned per shape (`tiles.SWIGLU`), and shapes with no measured win
take `gemv` and the product. `gemv_add` takes `gemv`'s tiles except where a shape measured faster with its own
(`tiles.ADD`: the 9B and 27B down projections, 64-row K tiles).

Why the Triton lowering: the loop is one load and one small dot per tile; Triton's pipelining of the
loads is what a bandwidth-bound GEMV needs, with no warp specialisation to write by hand.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import next_pow2
from pallas_kernels.gemv.tiles import ADD, GEMV, SWIGLU
from pallas_kernels.tiles import programs

F32 = jnp.float32
MIN_ROWS = 16  # tensor-core dot tiles need 16 rows (and Triton power-of-two shapes)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def plan(k: int, widths: tuple[int, ...], *, block_k: int, block_n: int,
         target_programs: int) -> tuple[int, tuple[int, ...], int]:
    """(block_k, block_n per weight, splits): power-of-two tiles dividing K and each N, and the K-splits that
    bring the grid nearest ``target_programs`` from below (at least 1)."""
    bk = _pow2_divisor(k, block_k)
    bns = tuple(_pow2_divisor(n, block_n) for n in widths)
    col_blocks = sum(n // bn for n, bn in zip(widths, bns, strict=True))
    k_blocks = k // bk
    splits = max([s for s in range(1, k_blocks + 1) if k_blocks % s == 0 and col_blocks * s <= target_programs],
                 default=1)
    return bk, bns, splits


def _split_product(x_ref, w_ref, cols, k0, steps: int, block_k: int) -> jax.Array:
    """x [Mp, K] times w's columns ``cols`` over rows k0 .. k0 + steps * block_k, in [block_k, bn] tiles
    -> [Mp, bn] fp32."""
    def body(i, acc):
        rows = pl.ds(k0 + i * block_k, block_k)
        return acc + jnp.dot(x_ref[:, rows], w_ref[rows, cols], preferred_element_type=F32)

    return jax.lax.fori_loop(0, steps, body, jnp.zeros((x_ref.shape[0], cols.size), F32))


def _row_scale(sums_ref, k: int, eps: float | None):
    """The RMS norm's deferred division, 1 / sqrt(mean square + eps) of each row [Mp, 1], from sums_ref [Jp, Mp]
    (partial sums of squares over K); 1 without a norm (sums_ref None)."""
    if sums_ref is None:
        return 1.0
    return jax.lax.rsqrt(jnp.sum(sums_ref[...], axis=0) / k + eps)[:, None]


def _gemv_kernel(x_ref, *refs, block_k: int, block_ns: tuple[int, ...], k_per_split: int, eps: float | None):
    # x_ref [Mp, K]; refs: (with eps: the norm's sums [Jp, Mp]), weights [K, N_i] ..., then outputs
    # [splits, Mp, N_i] ...: whole arrays.
    num = len(block_ns)
    sums_ref, refs = (refs[0], refs[1:]) if eps is not None else (None, refs)
    w_refs, o_refs = refs[:num], refs[num:]
    scale = _row_scale(sums_ref, x_ref.shape[1], eps)  # [Mp, 1], loaded before the weights stream
    j, s = pl.program_id(0), pl.program_id(1)
    k0 = s * k_per_split
    first = 0
    for w_ref, o_ref, bn in zip(w_refs, o_refs, block_ns, strict=True):
        blocks = w_ref.shape[1] // bn

        @pl.when((j >= first) & (j < first + blocks))
        def _(w_ref=w_ref, o_ref=o_ref, bn=bn, first=first):
            cols = pl.ds((j - first) * bn, bn)
            acc = _split_product(x_ref, w_ref, cols, k0, k_per_split // block_k, block_k)  # [Mp, bn]
            o_ref[s, :, cols] = (acc * scale).astype(o_ref.dtype)

        first += blocks


def _swiglu_kernel(x_ref, *refs, block_k: int, block_n: int, eps: float | None):
    # x_ref [Mp, K]; refs: (with eps: the norm's sums [Jp, Mp]), gate / up [K, N], out [Mp, N]: whole arrays;
    # program j owns columns j.
    sums_ref, (gate_ref, up_ref, o_ref) = (refs[0], refs[1:]) if eps is not None else (None, refs)
    scale = _row_scale(sums_ref, x_ref.shape[1], eps)  # [Mp, 1], loaded before the weights stream
    cols = pl.ds(pl.program_id(0) * block_n, block_n)

    def body(i, acc):
        gate, up = acc
        rows = pl.ds(i * block_k, block_k)
        x = x_ref[:, rows]
        return (gate + jnp.dot(x, gate_ref[rows, cols], preferred_element_type=F32),
                up + jnp.dot(x, up_ref[rows, cols], preferred_element_type=F32))

    zeros = jnp.zeros((x_ref.shape[0], block_n), F32)
    gate, up = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body, (zeros, zeros))  # [Mp, bn] fp32 each
    gate, up = gate * scale, up * scale
    dtype = o_ref.dtype  # `reference.swiglu_product`'s roundings as casts, which Triton keeps
    act = jax.nn.silu(gate.astype(dtype).astype(F32)).astype(dtype)
    o_ref[:, cols] = (act.astype(F32) * up.astype(dtype).astype(F32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "block_k", "block_n", "num_warps", "num_stages", "interpret"))
def gemv_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, sums: jax.Array | None = None,
                eps: float | None = None, *, block_k: int | None = None, block_n: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """silu(x w_gate) * (x w_up): x [M, K], w_gate / w_up [K, N] (one dtype) -> [M, N] in the weights' dtype.
    ``sums``, ``eps``: as `gemv`'s (the row scale applies to both projections before the product).

    Tiles left None take `tiles.SWIGLU`'s for this (K, N); block_k / block_n shrink to powers of two dividing
    K / N.
    """
    m, k = x.shape
    n = w_gate.shape[1]
    tiles = SWIGLU.get((k, n), block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    block_k, (block_n,), _ = plan(k, (n,), block_k=tiles.block_k, block_n=tiles.block_n, target_programs=1)
    padded = padded_rows(m)
    operands = _operands(x, w_gate.dtype, sums, padded)
    out = pl.pallas_call(
        functools.partial(_swiglu_kernel, block_k=block_k, block_n=block_n, eps=None if sums is None else eps),
        out_shape=jax.ShapeDtypeStruct((padded, n), w_gate.dtype),
        grid=(n // block_n,),
        in_specs=[pl.no_block_spec] * (2 + len(operands)),
        out_specs=pl.no_block_spec,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name="gemv_swiglu",
    )(*operands, w_gate, w_up)  # [Mp, N]
    return out[:m]


def padded_rows(m: int) -> int:
    """Rows the kernel multiplies for m rows of x: a power of two >= 16."""
    return max(MIN_ROWS, next_pow2(m))


def _operands(x: jax.Array, dtype, sums: jax.Array | None, padded: int) -> tuple[jax.Array, ...]:
    """x padded to ``padded`` rows in ``dtype`` and, under a norm, its sums [Jp, Mp] (padded with zeros to a power
    of two of blocks, a Triton load's shape). The pads are no-ops where the arrays come padded (`gemv_add`'s)."""
    xp = jnp.pad(x.astype(dtype), ((0, padded - x.shape[0]), (0, 0)))
    if sums is None:
        return (xp,)
    blocks = sums.shape[0]
    return xp, jnp.pad(sums, ((0, next_pow2(blocks) - blocks), (0, padded - sums.shape[1])))


@functools.partial(jax.jit, static_argnames=("out_dtype", "eps", "block_k", "block_n", "target_programs",
                                             "num_warps", "num_stages", "interpret"))
def gemv(x: jax.Array, weights: tuple[jax.Array, ...], out_dtype=None, sums: jax.Array | None = None,
         eps: float | None = None, *, block_k: int | None = None, block_n: int | None = None,
         target_programs: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
         interpret: bool = False) -> tuple[jax.Array, ...]:
    """x [M, K] times each w [K, N_i] (one dtype, K and every N multiples of 16) -> ([M, N_i], ...) in
    ``out_dtype`` (default: the weights' dtype).

    ``sums`` [J, M] fp32 (with ``eps``): x is an RMS norm's input times its weight (`NormedRows.scaled`) and
    ``sums`` the partial sums of squares of the norm's input rows; each output row is divided by its RMS,
    the norm's division deferred past the product (its own launch saved).

    block_k / block_n: most rows / columns of a weight tile per loop step; target_programs: the grid size the
    K-splits aim at. Those left None take `tiles.GEMV`'s for this (K, (N, ...)) (its target: ``waves`` programs
    per SM of the device).
    """
    m, k = x.shape
    widths = tuple(w.shape[1] for w in weights)
    tiles = GEMV.get((k, widths), block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    target_programs = programs(tiles.waves) if target_programs is None else target_programs
    dtype = weights[0].dtype
    out_dtype = jnp.dtype(out_dtype or dtype)
    block_k, block_ns, splits = plan(k, widths, block_k=tiles.block_k, block_n=tiles.block_n,
                                     target_programs=target_programs)
    padded = padded_rows(m)
    operands = _operands(x, dtype, sums, padded)
    partial_dtype = out_dtype if splits == 1 else F32
    kernel = functools.partial(_gemv_kernel, block_k=block_k, block_ns=block_ns, k_per_split=k // splits,
                               eps=None if sums is None else eps)
    col_blocks = sum(n // bn for n, bn in zip(widths, block_ns, strict=True))
    partials = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct((splits, padded, n), partial_dtype) for n in widths),
        grid=(col_blocks, splits),
        in_specs=[pl.no_block_spec] * (len(operands) + len(weights)),
        out_specs=(pl.no_block_spec,) * len(weights),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name="gemv",
    )(*operands, *weights)  # ([splits, Mp, N_i], ...)
    return tuple((p[0] if splits == 1 else jnp.sum(p, axis=0, dtype=F32))[:m].astype(out_dtype) for p in partials)


def _gemv_add_kernel(x_ref, w_ref, residual_ref, arrivals_in_ref, *refs, block_k: int, block_n: int,
                     k_per_split: int, splits: int, real_rows: int, y_dtype, normed: bool, interpret: bool):
    # x_ref [Mp, K], w_ref [K, N], residual_ref [Mp, N] f32, arrivals [>= N / block_n] i32 (zeros, aliased);
    # refs: (normed: the next norm's weight [N]), partial_ref [splits, Mp, N] f32, o_ref [Mp, N] f32,
    # (normed: scaled_ref [Mp, N], sums_ref [Jp, Mp] f32, J = N / block_n column blocks, Jp a power of two),
    # arrivals_ref: whole arrays. Program (j, s): split s of column block j.
    del arrivals_in_ref  # the same buffer as arrivals_ref
    if normed:
        norm_w_ref, partial_ref, o_ref, scaled_ref, sums_ref, arrivals_ref = refs
    else:
        partial_ref, o_ref, arrivals_ref = refs
    j, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * block_n, block_n)
    shape = (x_ref.shape[0], block_n)
    real = jnp.broadcast_to(jax.lax.broadcasted_iota(jnp.int32, shape, 0) < real_rows, shape)  # [Mp, bn]
    load = lambda view: plgpu.load(view, mask=real, other=jnp.zeros(shape, F32))  # padding rows: no traffic, zeros
    acc = _split_product(x_ref, w_ref, cols, s * k_per_split, k_per_split // block_k, block_k)  # [Mp, bn]

    def finish(y):  # y [Mp, bn]: the block's projection; rows past the real ones come out zero
        out = load(residual_ref.at[:, cols]) + jnp.where(real, y, 0.0).astype(y_dtype).astype(F32)  # rounded, added
        o_ref[:, cols] = out
        if not normed:
            return
        # The next norm's input times its weight, and this block's share of its rows' sums of squares.
        scaled_ref[:, cols] = (out * (1.0 + norm_w_ref[cols].astype(F32))[None, :]).astype(scaled_ref.dtype)
        sums_ref[j, :] = jnp.sum(out * out, axis=1)
        blocks = o_ref.shape[1] // block_n

        @pl.when(j < sums_ref.shape[0] - blocks)
        def _zero_padding_block():
            sums_ref[blocks + j, :] = jnp.zeros(shape[:1], F32)

    if splits == 1:
        finish(acc)
        return
    plgpu.store(partial_ref.at[s, :, cols], acc, mask=real)
    if not interpret:
        plgpu.debug_barrier()  # every thread's part of the partial is stored before the arrival is counted
    # Acquire-release at GPU scope: the partials stored before an arrival are visible to the last program.
    arrived = plgpu.atomic_add(arrivals_ref, j, jnp.int32(1))

    @pl.when(arrived == splits - 1)
    def _last_split_sums():  # in split order, whichever program arrives last: the result does not vary
        y = load(partial_ref.at[jnp.int32(0), :, cols])  # (an array index: interpret mode's masked load needs one)
        for t in range(1, splits):
            y = y + load(partial_ref.at[jnp.int32(t), :, cols])
        finish(y)
        arrivals_ref[j] = 0  # ready for the next launch that reads these counters


@functools.partial(jax.jit, static_argnames=("real_rows", "y_dtype", "block_k", "block_n", "target_programs",
                                             "num_warps", "num_stages", "interpret"))
def gemv_add(x: jax.Array, w: jax.Array, residual: jax.Array, arrivals: jax.Array, norm_weight: jax.Array | None = None,
             real_rows: int | None = None, y_dtype=None, *, block_k: int | None = None, block_n: int | None = None,
             target_programs: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
             interpret: bool = False):
    """residual + (x w rounded to ``y_dtype``, default w's): x [M, K], w [K, N], residual [M, N] fp32 -> (out
    [M, N] fp32, scaled, sums, arrivals), in one launch: the K-split that finishes a column block last sums the
    splits' partials and adds the residual, so no separate sum-and-add kernel runs (two a layer in the decode
    step).

    ``norm_weight`` [N]: the zero-centred RMS norm that reads out next; the launch also writes out * (1 +
    norm_weight) [M, N] in ``y_dtype`` (``scaled``) and the sums of squares of out's rows over each of the J
    column blocks, [Jp, M] fp32 with zero rows up to a power of two (``sums``): the norm with its division
    deferred to the projections that read it (`gemv`'s ``sums``). Both None without a weight.
    ``arrivals``: int32 zeros, at least N / 16 of them; returned zeroed again (pass it to the next call).
    ``real_rows``: only the first rows are read and written beyond the weights (the rest come out zero), so a
    batch padded to the tile's rows sums only its own partials; default all M. Tiles and splits as `gemv`'s, those
    left None from `tiles.ADD` for this (K, N).
    """
    m, k = x.shape
    n = w.shape[1]
    tiles = ADD.get((k, n), block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    target_programs = programs(tiles.waves) if target_programs is None else target_programs
    y_dtype = jnp.dtype(y_dtype or w.dtype)
    block_k, (block_n,), splits = plan(k, (n,), block_k=tiles.block_k, block_n=tiles.block_n,
                                       target_programs=target_programs)
    if arrivals.shape[0] < n // block_n:
        raise ValueError(f"arrivals: need at least {n // block_n} counters, got {arrivals.shape[0]}")
    padded = padded_rows(m)
    xp = jnp.pad(x.astype(w.dtype), ((0, padded - m), (0, 0)))  # no-op when x comes padded
    rp = jnp.pad(residual.astype(F32), ((0, padded - m), (0, 0)))
    normed = norm_weight is not None
    blocks = n // block_n
    kernel = functools.partial(_gemv_add_kernel, block_k=block_k, block_n=block_n, k_per_split=k // splits,
                               splits=splits, real_rows=min(m, real_rows or m), y_dtype=y_dtype, normed=normed,
                               interpret=interpret)
    shapes = [jax.ShapeDtypeStruct((splits, padded, n), F32), jax.ShapeDtypeStruct((padded, n), F32)]
    if normed:
        shapes += [jax.ShapeDtypeStruct((padded, n), y_dtype),
                   jax.ShapeDtypeStruct((next_pow2(blocks), padded), F32)]
    inputs = (xp, w, rp, arrivals) + ((norm_weight,) if normed else ())
    _, out, *norm_out, arrivals = pl.pallas_call(
        kernel,
        out_shape=(*shapes, jax.ShapeDtypeStruct(arrivals.shape, jnp.int32)),
        grid=(blocks, splits),
        in_specs=[pl.no_block_spec] * len(inputs),
        out_specs=(pl.no_block_spec,) * (len(shapes) + 1),
        input_output_aliases={3: len(shapes)},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name="gemv_add",
    )(*inputs)
    scaled, sums = (norm_out[0][:m], norm_out[1][:, :m]) if normed else (None, None)
    return out[:m], scaled, sums, arrivals
