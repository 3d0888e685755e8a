"""The steps' inputs built on the host (numpy): a decode batch and a packed prefill batch, each with its rows'
sampling settings."""

from __future__ import annotations

import numpy as np

from hybrid_jax.engine.cache import page_table_row
from hybrid_jax.engine.constraints import constraint_rows
from hybrid_jax.engine.prefix_cache import GDN_CHUNK
from hybrid_jax.engine.requests import Request
from hybrid_jax.engine.sampler import SamplingRows
from hybrid_jax.engine.steps import DecodeBatch, PrefillBatch


def sampling_rows(requests: list[Request], size: int, valid_vocab: int,
                  ahead: np.ndarray | None = None) -> tuple[SamplingRows, np.bool_]:
    """The rows' sampling settings and whether some row wants top logprobs; ``ahead`` [len(requests)] (a decode
    batch): tokens each has sampled that the host has not read yet (its input token, taken on the device)."""
    cols = {name: np.zeros(size, np.float32) for name in ("temperature", "top_p", "min_p", "presence_penalty",
                                                           "frequency_penalty", "repetition_penalty")}
    cols["top_p"][:] = 1.0
    cols["repetition_penalty"][:] = 1.0
    top_k = np.zeros(size, np.int32)
    seed = np.zeros(size, np.uint32)
    step = np.zeros(size, np.int32)
    for i, r in enumerate(requests):
        p = r.params
        for name in cols:
            cols[name][i] = getattr(p, name)
        top_k[i] = min(max(p.top_k, 0), valid_vocab)  # any k >= the vocabulary means no top-k
        seed[i] = r.seed
        step[i] = len(r.output_ids) + (0 if ahead is None else ahead[i])
    want_top = any(r.params.logprobs for r in requests)
    constraints = constraint_rows(requests, size, None if ahead is None else ahead == 0)
    return SamplingRows(top_k=top_k, seed=seed, step=step, constraints=constraints, **cols), np.bool_(want_top)


def decode_batch(requests: list[Request], size: int, width: int, valid_vocab: int,
                 source: np.ndarray) -> DecodeBatch:
    """The decode step's inputs for ``requests`` padded to ``size`` rows (``width`` pages a row); rows whose
    ``source`` [size] is >= 0 take their token from prefill's samples on the device (token 0 here)."""
    tokens = np.zeros(size, np.int32)
    positions = np.zeros(size, np.int32)
    slot_ids = np.zeros(size, np.int32)
    page_tables = np.zeros((size, width), np.int32)
    ahead = (source[: len(requests)] >= 0).astype(np.int32)
    for i, r in enumerate(requests):
        tokens[i] = r.output_ids[-1] if not ahead[i] else 0
        positions[i] = len(r.prompt_ids) + len(r.output_ids) + ahead[i] - 1
        slot_ids[i] = r.slot
        page_tables[i] = page_table_row(r.pages, width)
    rows, want_top = sampling_rows(requests, size, valid_vocab, ahead)
    return DecodeBatch(tokens, positions, slot_ids, page_tables, rows, want_top)


def prefill_batch(chunks: list[tuple[Request, int]], size: int, num_seqs: int, width: int,
                  valid_vocab: int) -> PrefillBatch:
    """``n`` more prompt tokens of each (request, n), packed and padded to ``size`` tokens and ``num_seqs``
    sequences, with the snapshots each request's ``snapshot_plan`` names at the GDN chunks ending there and the
    one it starts from (``restore_from``)."""
    tokens = np.zeros(size, np.int32)
    positions = np.zeros(size, np.int32)
    seq_index = np.zeros(size, np.int32)
    valid = np.zeros(size, np.bool_)
    cu = np.zeros(num_seqs + 1, np.int32)
    slot_ids = np.zeros(num_seqs, np.int32)
    page_tables = np.zeros((num_seqs, width), np.int32)
    context_lens = np.zeros(num_seqs, np.int32)
    is_first = np.zeros(num_seqs, np.bool_)
    is_last = np.zeros(num_seqs, np.bool_)
    snapshot_ids = np.zeros((num_seqs, -(-size // GDN_CHUNK)), np.int32)
    restore_ids = np.zeros(num_seqs, np.int32)
    offset = 0
    for s, (r, n) in enumerate(chunks):
        start = r.num_prefilled
        tokens[offset: offset + n] = r.prompt_ids[start: start + n]
        positions[offset: offset + n] = np.arange(start, start + n)
        seq_index[offset: offset + n] = s
        valid[offset: offset + n] = True
        offset += n
        cu[s + 1] = offset
        slot_ids[s] = r.slot
        page_tables[s] = page_table_row(r.pages, width)
        context_lens[s] = start + n
        is_first[s] = start == 0
        is_last[s] = start + n == len(r.prompt_ids)
        restore_ids[s] = r.restore_from
        for boundary, snapshot in r.snapshot_plan:
            snapshot_ids[s, -(-(boundary - start) // GDN_CHUNK) - 1] = snapshot  # the GDN chunk ending there
    cu[len(chunks) + 1:] = offset
    rows, want_top = sampling_rows([r for r, _ in chunks], num_seqs, valid_vocab)
    return PrefillBatch(tokens, positions, seq_index, valid, cu, slot_ids, page_tables, context_lens,
                        is_first, is_last, snapshot_ids, restore_ids, rows, want_top)
