"""The engine's settings and the shape buckets they imply (plain Python: the scheduler reads them too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 8  # concurrent requests (state slots)
    max_model_len: int = 4096  # prompt + output tokens per request
    page_size: int = 16
    prefill_chunk: int = 256  # token budget of one prefill step
    max_prefill_seqs: int = 4  # sequences packed into one prefill step
    memory_utilization: float = 0.9  # share of free device memory for slots + KV pages
    num_pages: int | None = None  # KV pages (incl. the null page); None: sized from memory
    max_waiting: int = 4096  # waiting requests before submit raises QueueFullError
    tensor_parallel_size: int = 1  # shards of the model over the first devices
    prefill_sizes: tuple[int, ...] | None = None  # token buckets of the prefill step (default: powers of two)
    decode_steps: int = 1  # decode steps per greedy call when nothing waits for prefill (hides the host round
    # trip); a request's last tokens, fewer than that, take a step per call
    decode_sizes: tuple[int, ...] | None = None  # batch buckets of the decode step (default: powers of two)
    compile_threads: int = 8  # warm-up programs compiled at once (tracing holds the GIL; XLA's compile does
    # not): fewer bounds the autotuner's scratch memory and the warm-up's CPU load
    background_compile: bool = False  # build only the programs that serve any request before start returns (the
    # largest decode and prefill buckets), the rest in a background thread after it
    enable_prefix_caching: bool = True  # share the KV pages and GDN state of cached prompt prefixes (exact)
    prefix_block: int = 64  # tokens of a cached block: a multiple of page_size and of the GDN chunk (64)
    snapshot_stride: int = 4  # a GDN state snapshot every this many blocks (and at a prompt's last boundaries)
    snapshot_share: float = 0.1  # share of the KV pool's memory given to state snapshots (device memory known)
    num_snapshots: int | None = None  # state snapshots (incl. the null one); None: from snapshot_share, or
    # 4 * max_batch without a device memory figure (CPU)
    kv_offloading_size: float = 0.0  # GiB of host memory the prefix cache's evicted blocks move to (0: none)

    def __post_init__(self):
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: must be at least 1 token, got {self.prefill_chunk}")
        if self.max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs: must be at least 1, got {self.max_prefill_seqs}")
        if self.prefill_sizes and not all(1 <= s <= self.prefill_chunk for s in self.prefill_sizes):
            raise ValueError(f"prefill_sizes: each must be in [1, prefill_chunk={self.prefill_chunk}], got "
                             f"{self.prefill_sizes}")
        if self.decode_sizes and not all(1 <= s <= self.max_batch for s in self.decode_sizes):
            raise ValueError(f"decode_sizes: each must be in [1, max_batch={self.max_batch}], got {self.decode_sizes}")
        if self.compile_threads < 1:
            raise ValueError(f"compile_threads: must be at least 1, got {self.compile_threads}")
        if self.prefix_block % self.page_size or self.prefix_block % 64:
            raise ValueError(f"prefix_block: must be a multiple of page_size={self.page_size} and of the GDN chunk "
                             f"64, got {self.prefix_block}")
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size: must be at least 0 GiB, got {self.kv_offloading_size}")
        if self.snapshot_stride < 1:
            raise ValueError(f"snapshot_stride: must be at least 1, got {self.snapshot_stride}")
        if not 0 < self.snapshot_share < 1:
            raise ValueError(f"snapshot_share: must be between 0 and 1, got {self.snapshot_share}")

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Batch sizes a decode program is compiled for; a batch runs in the smallest that holds it."""
        if self.decode_sizes:
            return tuple(sorted({*self.decode_sizes, self.max_batch}))
        sizes = [1 << i for i in range(self.max_batch.bit_length()) if 1 << i < self.max_batch]
        return (*sizes, self.max_batch)

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """Token counts a prefill program is compiled for, ``prefill_chunk`` always among them; a step runs in the
        smallest that holds its chunks."""
        if self.prefill_sizes:
            return tuple(sorted({*self.prefill_sizes, self.prefill_chunk}))
        sizes = [s for s in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if s < self.prefill_chunk]
        return (*sizes, self.prefill_chunk)
