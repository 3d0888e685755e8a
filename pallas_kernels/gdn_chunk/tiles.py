"""Tiles of the chunked GDN prefill, measured on the H200 (`scripts/bench_kernels.py`, figures in docs/DESIGN.md:
8 warps in any pass, or 1 in prepare, are slower). Keyed by (Hk, Hv, dk, dv); no heads have tiles of their own."""

import dataclasses

from pallas_kernels.tiles import H200, TileTable


@dataclasses.dataclass(frozen=True)
class Launch:
    """One pass's launch settings."""
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class GdnChunkTiles:
    """The state pass's programs each carry ``state_block_v`` of the state's dv columns; the output pass's each
    write ``output_block_v`` columns of O, over ``output_block_k`` columns of dk at a time (powers of two >= 16,
    capped at dv and dk). One launch setting per pass."""
    state_block_v: int
    output_block_v: int
    output_block_k: int
    prepare: Launch
    state: Launch
    output: Launch


GDN_CHUNK: TileTable[GdnChunkTiles] = TileTable(
    measured={H200: {}},
    default=GdnChunkTiles(state_block_v=32, output_block_v=128, output_block_k=32, prepare=Launch(2, 1),
                          state=Launch(4, 4), output=Launch(2, 4)),
)
