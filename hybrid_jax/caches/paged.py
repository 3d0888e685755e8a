"""The engine's caches over the pools (`pools.pool_specs`): a packed prefill chunk, a decode batch, and the
fused single-device decode.

The stream is packed: N tokens [N, ...] (prefill: chunks of up to S sequences, `cu_seqlens` apart; decode: one
token per row), padded to the rows the few-row kernel multiplies (`padded_rows`) so its projections pad
nothing. Attention writes the new K/V into the pages and attends through the paged kernels; GDN layers run
the conv over each slot's ring and the delta rule over its recurrent state. The kernels run per shard inside
shard_map under a mesh (`PagedKernels`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybrid_jax.caches.base import Cache
from hybrid_jax.caches.pools import KV_PAGES, STATE, WHOLE, gdn_ordinals
from hybrid_jax.config import Qwen35Config
from hybrid_jax.layers.projections import FewRowProjections, ShardedProjections
from hybrid_jax.sharding import TP, expand_kv_heads, linear_splits
from pallas_kernels.gdn_chunk import gdn_chunk
from pallas_kernels.gdn_decode import gdn_decode, gdn_decode_fused
from pallas_kernels.gdn_decode.reference import ring_of_window, store_rings
from pallas_kernels.gemv import padded_rows
from pallas_kernels.math.gdn import conv_ring_columns
from pallas_kernels.math.rope import rope_cos_sin
from pallas_kernels.paged_attention import (
    decode_attention_inputs,
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

F32 = jnp.float32
HEADS3 = P(None, TP, None)  # [tokens, heads, dim]
HEADS2 = P(None, TP)  # [tokens, heads]
UNNAMED = 1 << 30  # a snapshot id past any pool (a negative one would count from the end)


class PagedKernels:
    """The kernels' dispatch functions, each run per shard inside shard_map when there is a mesh."""

    def __init__(self, config: Qwen35Config, mesh: Mesh | None):
        self.mesh, self.config = mesh, config
        self.tp = 1 if mesh is None else mesh.shape[TP]
        self.replicated = None if mesh is None else NamedSharding(mesh, P())  # whole on every device
        wrap = self._wrap
        self.gdn_chunk = wrap(gdn_chunk, (HEADS3, HEADS3, HEADS3, HEADS2, HEADS2, WHOLE, WHOLE, STATE), (HEADS3, STATE))
        self.gdn_chunk_snapshots = wrap(gdn_chunk, (HEADS3, HEADS3, HEADS3, HEADS2, HEADS2, WHOLE, WHOLE, STATE, WHOLE,
                                                    STATE), (HEADS3, STATE, STATE))
        self.gdn_decode = wrap(gdn_decode, (HEADS3, HEADS3, HEADS3, HEADS2, HEADS2, WHOLE, STATE), (HEADS3, STATE))
        self.gdn_decode_snapshots = wrap(gdn_decode, (HEADS3, HEADS3, HEADS3, HEADS2, HEADS2, WHOLE, STATE, WHOLE,
                                                      STATE), (HEADS3, STATE, STATE))
        self.write_kv = wrap(write_kv, (KV_PAGES, KV_PAGES, HEADS3, HEADS3, WHOLE), (KV_PAGES, KV_PAGES))
        self.decode_attention = wrap(paged_decode_attention, (HEADS3, KV_PAGES, KV_PAGES, WHOLE, WHOLE), HEADS3)
        self.prefill_attention = wrap(paged_prefill_attention, (HEADS3, KV_PAGES, KV_PAGES, WHOLE, WHOLE, WHOLE),
                                      HEADS3)

    def _wrap(self, fn, in_specs, out_specs):
        if self.mesh is None:
            return fn

        def call(*args, **kw):
            per_shard = lambda *a: fn(*a, **kw)
            return jax.shard_map(per_shard, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=False)(*args)
        return call

    def kv_heads(self, x):
        """[T, Hkv, hd] -> the KV heads the pool stores (one per shard when Hkv < tp)."""
        return x if self.mesh is None else expand_kv_heads(x, self.config, self.tp)

    def projections(self, model, *, defer_norms: bool = False):
        """The projections of a step over ``model`` (the traced one): the few-row kernels on one device, per
        shard under a mesh. ``defer_norms`` (one device): the adds write the norms that follow them."""
        if self.mesh is None:
            return FewRowProjections(defer_norms)
        return ShardedProjections(self.mesh, linear_splits(model, self.tp))


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    """a [N, ...] -> [rows, ...] with zero rows after the N."""
    return a if a.shape[0] == rows else jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def start_rows(pool, slot_ids, reset, snapshots=None, restore_ids=None):
    """The pool with the rows of slots whose request starts now zeroed and, with ``snapshots`` [snapshots, ...],
    those of slots that resume from a snapshot (a prefix cache hit's first chunk) set to it. pool [slots, ...];
    slot_ids [S] i32; reset [S] bool; restore_ids [S] i32 (0: none)."""
    rows = pool[slot_ids]
    mask = lambda m: m.reshape(m.shape + (1,) * (rows.ndim - 1))
    rows = jnp.where(mask(reset), jnp.zeros_like(rows), rows)
    if snapshots is not None:
        rows = jnp.where(mask(restore_ids > 0), snapshots[restore_ids].astype(rows.dtype), rows)
    return pool.at[slot_ids].set(rows)


def slot_mapping(page_tables, seq_rows, positions, valid, page_size: int):
    """Flat KV slot (page * page_size + offset) of each token; padding writes slot 0 of the null page."""
    pages = jnp.take_along_axis(page_tables[seq_rows], (positions // page_size)[:, None], axis=1)[:, 0]
    return jnp.where(valid, pages * page_size + positions % page_size, 0)


class _Paged(Cache):
    """Shared by the prefill and decode caches: the per-layer pools, padding, the unfused attention."""

    def __init__(self, layers: list[dict], kernels: PagedKernels, proj, num_tokens: int, slot_ids, page_tables,
                 slot_map):
        self.layers, self.updated = layers, list(layers)
        self.kernels, self.proj = kernels, proj
        self.real_rows, self.rows = num_tokens, padded_rows(num_tokens)
        self.slot_ids, self.page_tables, self.slot_map = slot_ids, page_tables, slot_map

    def pad(self, x):
        return _pad_rows(x, self.rows)

    def unpad(self, x):
        return x[: self.real_rows]

    def attention(self, index, attn, qg, k, v, positions):
        n, pool = self.real_rows, self.layers[index]
        q, k, v, gate = (t[:n] for t in attn.heads(qg, k, v, positions))  # [N, H, hd]
        k, v = (self.kernels.kv_heads(t.astype(pool["k"].dtype)) for t in (k, v))
        k_pages, v_pages = self.kernels.write_kv(pool["k"], pool["v"], k, v, self.slot_map)
        self.updated[index] = {"k": k_pages, "v": v_pages}
        o = self.attend(q.astype(k_pages.dtype), k_pages, v_pages, attn.scale)
        return attn.gated(o.astype(gate.dtype), gate)

    def attend(self, q, k_pages, v_pages, scale):  # q [N, Hq, hd] -> [N, Hq, hd]
        raise NotImplementedError


def snapshot_entries(snapshot_ids, cu_seqlens):
    """The snapshots a prefill step writes, as fixed-size lists: snapshot_ids [S, N] (sequence s's state after its
    GDN chunk c, its first min((c + 1) 64, tokens) tokens, into snapshot ids[s, c] where > 0) -> (sequence [N],
    tokens into the chunk [N], snapshot [N]), entries past the last named one at distinct snapshots from
    ``UNNAMED`` on (past any pool: dropped by the scatters, whose indices stay unique). N entries suffice: each but
    a sequence's last takes 64 of the step's tokens."""
    num_chunks = snapshot_ids.shape[1]
    flat = snapshot_ids.reshape(-1)  # [S N]
    (index,) = jnp.nonzero(flat > 0, size=num_chunks, fill_value=flat.shape[0])
    named = index < flat.shape[0]
    seq, chunk = jnp.where(named, index // num_chunks, 0), index % num_chunks
    tokens = jnp.minimum((chunk + 1) * 64, cu_seqlens[seq + 1] - cu_seqlens[seq])
    snapshot = jnp.where(named, flat[jnp.minimum(index, flat.shape[0] - 1)], UNNAMED + jnp.arange(num_chunks))
    return seq, tokens, snapshot


class PrefillCache(_Paged):
    """T packed tokens of up to S sequences; each sequence's first chunk (``is_first``) resets its slot. With
    ``snapshots`` (the snapshot pool: its "layers" and "conv" are read), a sequence whose ``restore_ids`` [S] is
    > 0 starts from that snapshot's GDN state (its first chunk after a prefix cache hit), and with
    ``snapshot_ids`` [S, ceil(T / 64)] (see `snapshot_entries`) each GDN layer also writes its recurrent state at
    those boundaries, and their conv rings, all layers' in one scatter, go to `updated_snapshots`."""

    def __init__(self, layers, kernels, proj, *, page_size: int, positions, seq_index, valid, cu_seqlens, slot_ids,
                 page_tables, context_lens, is_first, snapshots: dict | None = None, snapshot_ids=None,
                 restore_ids=None):
        super().__init__(layers, kernels, proj, positions.shape[0], slot_ids, page_tables,
                         slot_mapping(page_tables, seq_index, positions, valid, page_size))
        self.seq_index, self.cu_seqlens = seq_index, cu_seqlens
        self.context_lens, self.is_first = context_lens, is_first
        self.snapshots, self.snapshot_ids, self.restore_ids = snapshots, snapshot_ids, restore_ids
        if snapshots is not None:
            self.snapshot_states = list(snapshots["layers"])  # each GDN layer's {"state"}, written
            self.gdn_rank = gdn_ordinals(snapshots["layers"])
            self.entries = snapshot_entries(snapshot_ids, cu_seqlens)  # (sequence, tokens, snapshot) [M] each
            self.ring_columns: dict = {}  # GDN rank -> that layer's raw columns before the boundaries [M, K, C]

    def attend(self, q, k_pages, v_pages, scale):
        return self.kernels.prefill_attention(q, k_pages, v_pages, self.page_tables, self.cu_seqlens,
                                              self.context_lens, scale=scale)

    def linear_attention(self, index, gdn, mixed, b, a):
        n, pool = self.real_rows, self.layers[index]
        snap = {}
        if self.snapshots is not None:
            first = self.gdn_rank[index] * gdn.kernel
            snap = {"conv": self.snapshots["conv"][:, first: first + gdn.kernel],
                    "state": self.snapshots["layers"][index]["state"]}
        conv_pool, state_pool = (start_rows(pool[k], self.slot_ids, self.is_first, snap.get(k), self.restore_ids)
                                 for k in ("conv", "state"))
        mixed, b, a = mixed[:n], b[:n], a[:n]
        new_tokens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]  # [S]
        ring = conv_pool[self.slot_ids]  # [S, K, C]
        before = conv_ring_columns(self.context_lens - new_tokens, gdn.kernel)  # [S, K-1]: the cached columns
        conv_out, new_conv, ext = self._packed_conv(gdn, mixed, jnp.take_along_axis(ring, before[..., None], axis=1))
        q, k, v = (t.astype(gdn.out_proj.kernel.dtype) for t in gdn.heads(conv_out))  # the kernel's fast path: bf16
        g, beta = gdn.gates(b, a)
        args = (q, k, v, g, beta, self.cu_seqlens, self.slot_ids, state_pool)
        if self.snapshots is None:
            o, state_pool = self.kernels.gdn_chunk(*args)
        else:
            o, state_pool, snap_state = self.kernels.gdn_chunk_snapshots(*args, self.snapshot_ids, snap["state"])
            self.snapshot_states[index] = {"state": snap_state}
            self.ring_columns[self.gdn_rank[index]] = self._snapshot_columns(ext, gdn.kernel)
        after = conv_ring_columns(self.context_lens, gdn.kernel)  # [S, K-1]: where the last K-1 columns go
        seqs = jnp.arange(new_tokens.shape[0])[:, None]  # [S, 1]
        new_ring = ring.at[seqs, after].set(new_conv.astype(ring.dtype))
        conv_pool = conv_pool.at[self.slot_ids].set(jnp.where((new_tokens > 0)[:, None, None], new_ring, ring))
        self.updated[index] = {"conv": conv_pool, "state": state_pool}
        return _pad_rows(o, self.rows)

    def _snapshot_columns(self, ext, kernel: int):
        """The K raw columns before each snapshot boundary of the step [M, K, C] (from the slot's cached columns
        where the chunk has fewer), in time order. ext: `_packed_conv`'s cached + new columns."""
        seq, tokens, _ = self.entries
        offsets = tokens[:, None] - kernel + jnp.arange(kernel)[None, :]  # [M, K] within the chunk (may be < 0)
        # Gathered now, into a buffer of their own: fused into the step's last scatter instead, the gather would
        # keep every layer's ext ([T, C] each) alive until then.
        return jax.lax.optimization_barrier(ext[self._ext_row(seq[:, None], offsets, kernel)])

    def updated_snapshots(self) -> dict:
        """The snapshot pool's {"layers", "conv"} after the step (once every GDN layer has run): each layer's
        states, and every layer's rings written by one scatter, position t of a layer's ring at its column t mod
        K; (snapshot, row) pairs are distinct, so the writes need no atomics."""
        pool = self.snapshots["conv"]  # [snapshots, L K, C]
        if not self.ring_columns:
            return {"layers": self.snapshot_states, "conv": pool}
        seq, tokens, snapshot = self.entries
        columns = jnp.stack([self.ring_columns[rank] for rank in range(len(self.gdn_rank))], axis=1)  # [M, L, K, C]
        kernel = columns.shape[2]
        new_tokens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]  # [S]
        positions = (self.context_lens - new_tokens)[seq][:, None] + tokens[:, None] - kernel + jnp.arange(kernel)
        layers = jnp.arange(columns.shape[1])[None, :, None] * kernel  # [1, L, 1]
        rows = layers + (positions % kernel)[:, None, :]  # [M, L, K]: each layer's ring, position t at column t mod K
        conv = pool.at[snapshot[:, None, None], rows].set(columns.astype(pool.dtype), mode="drop", unique_indices=True)
        return {"layers": self.snapshot_states, "conv": conv}

    def _ext_row(self, seq, offset, kernel: int):
        """The row of `_packed_conv`'s ext holding time ``offset`` (may be down to -(K-1): a cached column) of
        sequence ``seq``."""
        num_seqs = self.slot_ids.shape[0]
        from_cache = seq * (kernel - 1) + (kernel - 1) + offset
        from_new = num_seqs * (kernel - 1) + self.cu_seqlens[seq] + offset
        return jnp.where(offset >= 0, from_new, from_cache)

    def _packed_conv(self, gdn, mixed, conv_prev):
        """Causal conv over packed sequences, each continuing from its cached columns.

        mixed [T, C] raw projections; conv_prev [S, K-1, C]. Returns conv output [T, C] fp32, the new conv
        state [S, K-1, C] (the last K-1 raw columns of each sequence, cache first) and ext [S (K-1) + T, C], the
        cached columns then the new ones (rows by `_ext_row`).
        """
        kernel = gdn.kernel
        num_seqs = conv_prev.shape[0]
        cached = conv_prev.reshape(num_seqs * (kernel - 1), -1).astype(mixed.dtype)
        ext = jnp.concatenate([cached, mixed], axis=0)  # [S (K-1) + T, C]
        starts = self.cu_seqlens[:-1]  # [S]
        t = jnp.arange(mixed.shape[0])
        seq = self.seq_index
        offset = t - starts[seq]
        w = gdn.conv1d.weight[...].astype(F32)  # [K, C]
        conv = sum(ext[self._ext_row(seq, offset - (kernel - 1) + j, kernel)].astype(F32) * w[j]
                   for j in range(kernel))
        lengths = self.cu_seqlens[1:] - starts  # [S]
        seqs = jnp.arange(num_seqs)[:, None]
        tail = lengths[:, None] - (kernel - 1) + jnp.arange(kernel - 1)[None, :]  # [S, K-1]
        return conv, ext[self._ext_row(seqs, tail, kernel)], ext


class DecodeCache(_Paged):
    """One new token for each of B rows (padding rows: slot 0, page 0, context 0); attention and GDN unfused.
    With ``snapshots`` (the snapshot pool: its "layers" and "conv" are read) and ``snapshot_ids`` [B] (0: none),
    each GDN layer also writes a row's ring and state after its token at its snapshot (`updated_snapshots`)."""

    def __init__(self, layers, kernels, proj, *, page_size: int, positions, slot_ids, page_tables,
                 snapshots: dict | None = None, snapshot_ids=None):
        real = slot_ids > 0
        super().__init__(layers, kernels, proj, positions.shape[0], slot_ids, page_tables,
                         slot_mapping(page_tables, jnp.arange(positions.shape[0]), positions, real, page_size))
        self.positions = positions  # [B]
        self.context_lens = jnp.where(real, positions + 1, 0)
        self.snapshots, self.snapshot_ids = snapshots, snapshot_ids
        if snapshots is not None:
            self.snapshot_states, self.snapshot_conv = list(snapshots["layers"]), snapshots["conv"]
            self.gdn_rank = gdn_ordinals(snapshots["layers"])

    def updated_snapshots(self) -> dict:
        """The snapshot pool's {"layers", "conv"} after the step."""
        return {"layers": self.snapshot_states, "conv": self.snapshot_conv}

    def attend(self, q, k_pages, v_pages, scale):
        return self.kernels.decode_attention(q, k_pages, v_pages, self.page_tables, self.context_lens, scale=scale)

    def linear_attention(self, index, gdn, mixed, b, a):
        n, pool = self.real_rows, self.layers[index]
        mixed, b, a = mixed[:n], b[:n], a[:n]
        conv_pool = pool["conv"]  # [slots, K, C] ring
        before = conv_ring_columns(self.positions, gdn.kernel)[..., None]  # [B, K-1, 1]
        cached = jnp.take_along_axis(conv_pool[self.slot_ids], before, axis=1)  # [B, K-1, C]
        window = jnp.concatenate([cached.astype(F32), mixed[:, None]], axis=1)  # the new column unrounded
        conv = jnp.einsum("bkc,kc->bc", window, gdn.conv1d.weight[...].astype(F32))  # [B, C]
        q, k, v = gdn.heads(conv)
        g, beta = gdn.gates(b, a)
        args = (q, k, v, g, beta, self.slot_ids, pool["state"])
        if self.snapshots is None:
            o, state_pool = self.kernels.gdn_decode(*args)
        else:
            o, state_pool, snap_state = self.kernels.gdn_decode_snapshots(
                *args, self.snapshot_ids, self.snapshots["layers"][index]["state"])
            raw = jnp.concatenate([cached, mixed[:, None].astype(cached.dtype)], axis=1)  # [B, K, C] as stored
            self.snapshot_conv = store_rings(self.snapshot_conv, self.snapshot_ids, ring_of_window(raw, self.positions),
                                             self.gdn_rank[index])
            self.snapshot_states[index] = {"state": snap_state}
        conv_pool = conv_pool.at[self.slot_ids, self.positions % gdn.kernel].set(mixed.astype(conv_pool.dtype))
        self.updated[index] = {"conv": conv_pool, "state": state_pool}
        return _pad_rows(o, self.rows)


class FusedDecodeCache(DecodeCache):
    """Decode on one device: after the projections, one launch for the q/k norms, RoPE and the K/V write, the
    attention, then one for its split combine and the gate written as the output projection's padded rows; GDN
    in one kernel (conv over the ring, norms, gates, state update, snapshots). Projections with the norms
    deferred."""

    def attention(self, index, attn, qg, k, v, positions):
        pool = self.layers[index]
        cos, sin = rope_cos_sin(positions, attn.rotary_dim, attn.rope_theta, qg.dtype)  # [rows, r]
        q, k_pages, v_pages = decode_attention_inputs(
            qg, k, v, cos, sin, attn.q_norm.weight[...], attn.k_norm.weight[...], self.slot_map, pool["k"],
            pool["v"], num_q_heads=attn.num_heads, eps=attn.q_norm.eps)  # q [B, Hq, hd]; both norms' eps: the config's
        self.updated[index] = {"k": k_pages, "v": v_pages}
        return paged_decode_attention(q, k_pages, v_pages, self.page_tables, self.context_lens, scale=attn.scale,
                                      gate=qg, out_rows=qg.shape[0])  # [rows, Hq * hd], zeros past B

    def linear_attention(self, index, gdn, mixed, b, a):
        pool = self.layers[index]
        snapshot, rank = (), 0
        if self.snapshots is not None:
            snapshot = (self.snapshot_ids, self.snapshot_conv, self.snapshots["layers"][index]["state"])
            rank = self.gdn_rank[index]
        o, conv_pool, state_pool, *snapshot = gdn_decode_fused(  # o [rows, Hv, dv], zero past the B
            mixed, a, b, gdn.conv1d.weight[...], gdn.A_log[...], gdn.dt_bias[...], self.slot_ids, self.positions,
            pool["conv"], pool["state"], *snapshot, num_k_heads=gdn.num_k_heads, head_k_dim=gdn.k_dim,
            head_v_dim=gdn.v_dim, out_rows=mixed.shape[0], snapshot_layer=rank)
        self.updated[index] = {"conv": conv_pool, "state": state_pool}
        if snapshot:
            self.snapshot_conv, self.snapshot_states[index] = snapshot[0], {"state": snapshot[1]}
        return o
