"""The tile tables resolve by device kind and shape (a device or shape not measured takes the documented
default), keep the H200's measured tiles, and the grids they size follow the device's SM count."""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels.gemv.kernel as gemv_kernel
import pallas_kernels.tiles as tiles
from pallas_kernels.gdn_chunk.tiles import GDN_CHUNK
from pallas_kernels.gdn_decode import tiles as gdn_decode_tiles
from pallas_kernels.gdn_decode.kernel import pick_block_v
from pallas_kernels.gemv.tiles import ADD, GEMV, SWIGLU, GemvTiles, SwigluTiles
from pallas_kernels.paged_attention import tiles as attention_tiles

TABLES = {"gemv": GEMV, "gemv_add": ADD, "gemv_swiglu": SWIGLU, "gdn_chunk": GDN_CHUNK,
          "gdn_decode": gdn_decode_tiles.DECODE, "gdn_decode_fused": gdn_decode_tiles.FUSED,
          "paged_decode_attention": attention_tiles.DECODE, "paged_prefill_attention": attention_tiles.PREFILL}


@pytest.mark.parametrize("name", TABLES)
def test_every_table_holds_frozen_named_tiles_and_the_h200s(name):
    table = TABLES[name]
    assert dataclasses.is_dataclass(table.default) and dataclasses.fields(table.default)
    assert tiles.H200 in table.measured
    assert all(type(t) is type(table.default) for shapes in table.measured.values() for t in shapes.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(table.default, dataclasses.fields(table.default)[0].name, 1)


def test_tables_resolve_by_device_kind_and_shape():
    assert SWIGLU.get((5120, 17408), tiles.H200) == SwigluTiles(block_n=64, block_k=64, num_warps=4, num_stages=3)
    assert SWIGLU.get((5120, 17408), "NVIDIA B200") == SWIGLU.get((5120, 17408), tiles.H200)  # not measured there
    assert SWIGLU.get((1024, 3584), tiles.H200) == SWIGLU.default  # a shape not measured
    assert (1024, 3584) not in SWIGLU.on(tiles.H200) and SWIGLU.on("cpu") is SWIGLU.on(tiles.H200)
    assert ADD.get((17408, 5120), tiles.H200).waves == 4 and ADD.get((4096, 4096), tiles.H200) == GEMV.default
    given = ADD.get((17408, 5120), tiles.H200, block_n=32, block_k=None)  # None: the table's
    assert (given.block_n, given.block_k) == (32, 64)


def test_the_h200s_tiles():
    """The tiles the H200's sweeps chose (2 waves = 264 programs, 4 = 528)."""
    assert GEMV.default == GemvTiles(block_n=64, block_k=128, num_warps=4, num_stages=4, waves=2)
    assert ADD.on(tiles.H200) == {
        (12288, 4096): GemvTiles(block_n=64, block_k=64, num_warps=4, num_stages=4, waves=2),
        (17408, 5120): GemvTiles(block_n=64, block_k=64, num_warps=4, num_stages=4, waves=4)}
    assert set(SWIGLU.on(tiles.H200)) == {(2560, 9216), (4096, 12288), (5120, 17408)}
    assert attention_tiles.DECODE.default.block_kv == 64 and attention_tiles.PREFILL.default.block_q == 128


def test_sm_count_comes_from_the_device(monkeypatch):
    assert tiles.sm_count() == tiles.H200_SMS and tiles.programs(2) == 264  # the CPU: sized as for an H200
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(platform="gpu", core_count=78, device_kind="x")])
    assert (tiles.sm_count(), tiles.programs(2), tiles.device_kind()) == (78, 156, "x")
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(platform="gpu", device_kind="x")])
    assert tiles.sm_count() == tiles.H200_SMS


def test_grids_follow_the_sm_count(monkeypatch):
    """At 9B's heads and batch 1 the fused GDN decode narrows its tiles to 16 columns to give 132 SMs 2 waves;
    16 SMs get 2 waves from 128; `gemv`'s K-splits aim at 2 waves."""
    fused = gdn_decode_tiles.FUSED.default
    assert pick_block_v(1 * 32, 128, fused) == 16
    assert pick_block_v(64 * 32, 128, fused) == 128
    monkeypatch.setattr(tiles, "sm_count", lambda: 16)
    assert pick_block_v(1 * 32, 128, fused) == 128
    targets = []
    plan = gemv_kernel.plan
    monkeypatch.setattr(gemv_kernel, "plan", lambda *a, **kw: targets.append(kw["target_programs"]) or plan(*a, **kw))
    x, w = jax.ShapeDtypeStruct((3, 80), jnp.bfloat16), jax.ShapeDtypeStruct((80, 48), jnp.bfloat16)
    jax.eval_shape(functools.partial(gemv_kernel.gemv, interpret=True), x, (w,))
    assert targets == [2 * 16]
