"""Tiles of the paged attention kernels, measured on the H200 (`scripts/bench_kernels.py --attention-sweep`, 9B
heads, B=64, 4096-token contexts: decode reads K/V at ~4.2-4.3 TB/s; block_kv 32 or 128 and 8 warps are slower).
Keyed by heads (Hq, Hkv, hd); no heads have tiles of their own."""

import dataclasses

from pallas_kernels.tiles import H200, TileTable


@dataclasses.dataclass(frozen=True)
class DecodeAttentionTiles:
    """Keys per block (a power of two >= 16, any page size); the KV is split until B * Hkv * splits reaches
    ``waves`` programs per SM."""
    block_kv: int
    num_warps: int
    num_stages: int
    waves: int


@dataclasses.dataclass(frozen=True)
class PrefillAttentionTiles:
    """(token, q head) rows per program: ``block_q`` on ``num_warps`` when those tiles give ``waves`` programs per
    SM, else ``narrow_block_q`` on ``narrow_num_warps`` (the warps of any block_q below ``block_q``); the KV
    is split while the tiles with rows stay within ``split_waves`` programs per SM (`scripts/bench_kernels.py
    --prefill-sweep`; BENCHMARKS)."""
    block_q: int
    num_warps: int
    narrow_block_q: int
    narrow_num_warps: int
    block_kv: int
    num_stages: int
    waves: int
    split_waves: int


DECODE: TileTable[DecodeAttentionTiles] = TileTable(
    measured={H200: {}},
    default=DecodeAttentionTiles(block_kv=64, num_warps=4, num_stages=2, waves=2),
)
PREFILL: TileTable[PrefillAttentionTiles] = TileTable(
    measured={H200: {}},
    default=PrefillAttentionTiles(block_q=128, num_warps=8, narrow_block_q=64, narrow_num_warps=4, block_kv=64,
                                  num_stages=2, waves=2, split_waves=1),
)
