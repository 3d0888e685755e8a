"""Tiles of the GDN decode kernels, measured on the H200 (`scripts/bench_kernels.py --decode-sweep`: at batch 64,
the fused kernel's 128 columns on 4 warps move 65-69% of the H200's 4.3 TB/s of state traffic; 8 warps and
narrower tiles are slower). Keyed by (Hv, dk, dv); no heads have tiles of their own."""

import dataclasses

from pallas_kernels.tiles import H200, TileTable


@dataclasses.dataclass(frozen=True)
class GdnDecodeTiles:
    """dv columns of a program's state tile: the widest power of two from ``widest_block_v`` down to
    ``narrowest_block_v`` whose grid still gives ``waves`` programs per SM (64 columns of a 128-row fp32 tile:
    64 registers a thread at 4 warps)."""
    widest_block_v: int
    narrowest_block_v: int
    num_warps: int
    waves: int


DECODE: TileTable[GdnDecodeTiles] = TileTable(
    measured={H200: {}},
    default=GdnDecodeTiles(widest_block_v=64, narrowest_block_v=32, num_warps=4, waves=2),
)
FUSED: TileTable[GdnDecodeTiles] = TileTable(
    measured={H200: {}},
    default=GdnDecodeTiles(widest_block_v=128, narrowest_block_v=16, num_warps=4, waves=2),
)
