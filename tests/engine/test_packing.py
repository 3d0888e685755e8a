"""A step's host inputs packed into one array: every leaf comes back with its shape, dtype and value."""

import jax
import numpy as np
import pytest

from hybrid_jax.engine.packing import Packed, pack, unpack


def _tree():
    return {"ids": np.arange(6, dtype=np.int32).reshape(2, 3), "scale": np.array([1.5, -0.0, np.inf], np.float32),
            "seed": np.array([2**32 - 1, 7], np.uint32), "mask": np.array([True, False, True]),
            "flag": np.bool_(True), "empty": np.zeros((0, 4), np.int32)}


def test_unpack_inside_a_program_gives_back_every_leaf_bit_for_bit():
    tree = _tree()
    packed = pack(tree)
    assert packed.words.dtype == np.int32 and packed.words.shape == (packed.layout.size,) == (15,)
    out = jax.jit(unpack)(packed)
    for name, want in tree.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def test_a_compiled_program_runs_on_packed_host_arrays_and_refuses_another_layout():
    tree = _tree()
    compiled = jax.jit(lambda p: unpack(p)["ids"].sum()).lower(pack(tree)).compile()
    assert int(compiled(pack(tree))) == 15
    other = dict(tree, ids=np.zeros((3, 2), np.int32))  # same word count, another layout
    with pytest.raises(TypeError):
        compiled(pack(other))


def test_pack_refuses_dtypes_it_cannot_hold():
    with pytest.raises(TypeError, match="int8"):
        pack({"x": np.zeros(3, np.int8)})
    assert isinstance(pack(()), Packed) and pack(()).words.shape == (0,)
