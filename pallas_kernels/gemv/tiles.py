"""Tiles of `gemv`, `gemv_add` and `gemv_swiglu`, measured on the H200 (`scripts/bench_gemv.py --sweep`, with
``--add`` and ``--swiglu``; batch 1; figures in docs/DESIGN.md)."""

import dataclasses

from pallas_kernels.tiles import H200, TileTable


@dataclasses.dataclass(frozen=True)
class GemvTiles:
    """A program walks a [K / splits, block_n] slab of a weight in [block_k, block_n] tiles; K splits until the
    grid nears ``waves`` programs per SM. block_k and block_n shrink to powers of two dividing K and each N."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    waves: int


@dataclasses.dataclass(frozen=True)
class SwigluTiles:
    """A program walks K whole over one [K, block_n] column block of gate and up, in [block_k, block_n] tiles."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# `gemv`: (K, (N, ...)) of a set of projections sharing x. None has tiles of its own: the default, the best over
# the 9B and 27B projection sets on the geometric mean, is 1-2% behind each set's own best (128-column tiles: 8%).
GEMV: TileTable[GemvTiles] = TileTable(
    measured={H200: {}},
    default=GemvTiles(block_n=64, block_k=128, num_warps=4, num_stages=4, waves=2),
)

# `gemv_add`: (K, N) of a projection added to the residual stream, where tiles of its own beat `GEMV`'s default (the
# plain `gemv` sweep found the same tiles best for these weights).
ADD: TileTable[GemvTiles] = TileTable(
    measured={H200: {
        (12288, 4096): GemvTiles(block_n=64, block_k=64, num_warps=4, num_stages=4, waves=2),  # 9B down
        (17408, 5120): GemvTiles(block_n=64, block_k=64, num_warps=4, num_stages=4, waves=4),  # 27B down
    }},
    default=GEMV.default,
)

# `gemv_swiglu`: (K, N) of a gate/up pair where the fused kernel beat `gemv` and the product. "auto" fuses only the
# shapes measured on the device (0.8B and 2B are absent: the fused kernel is no faster there).
SWIGLU: TileTable[SwigluTiles] = TileTable(
    measured={H200: {
        (2560, 9216): SwigluTiles(block_n=128, block_k=128, num_warps=4, num_stages=3),  # 4B
        (4096, 12288): SwigluTiles(block_n=128, block_k=128, num_warps=4, num_stages=3),  # 9B
        (5120, 17408): SwigluTiles(block_n=64, block_k=64, num_warps=4, num_stages=3),  # 27B
    }},
    default=SwigluTiles(block_n=128, block_k=128, num_warps=4, num_stages=3),
)
SWIGLU_MAX_ROWS = 16  # measured at 1 and 8 rows; at 64, 128-column tiles overflow shared memory
