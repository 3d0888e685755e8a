"""A step's host-built inputs as one array: a tree of small numpy arrays packed into one int32 array on the host
and unpacked inside the program, so the call makes one host-to-device copy instead of one per array (each costs
the host's dispatch ~40 us on a GPU: BENCHMARKS, prefix caching)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np


class Layout(NamedTuple):
    """How a packed tree is rebuilt: its structure and each leaf's shape and dtype (static, hashable)."""

    tree: Any  # jax PyTreeDef
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) of each leaf, in flattening order

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.leaves)


@jax.tree_util.register_pytree_node_class
class Packed:
    """A tree of 4-byte and bool arrays held as ``words`` [layout.size] i32; the layout is the node's static part,
    so a program compiled for one layout is called only with that layout."""

    def __init__(self, words, layout: Layout):
        self.words, self.layout = words, layout

    def tree_flatten(self):
        return (self.words,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children) -> Packed:
        return cls(children[0], layout)

    def __repr__(self) -> str:
        return f"Packed({self.layout.size} words, {len(self.layout.leaves)} arrays)"


def pack(tree) -> Packed:
    """``tree``'s leaves (numpy arrays or scalars of 4-byte dtypes or bool) in one int32 array (host side)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    for a in arrays:
        if a.dtype != np.bool_ and a.dtype.itemsize != 4:
            raise TypeError(f"pack: {a.dtype} arrays are not packed (4-byte dtypes and bool only)")
    words = [a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32) for a in arrays]
    layout = Layout(treedef, tuple((a.shape, a.dtype.name) for a in arrays))
    return Packed(np.concatenate([w.reshape(-1) for w in words]) if words else np.zeros(0, np.int32), layout)


def unpack(packed: Packed):
    """The tree `pack` packed, as arrays of their own dtypes (inside a program: slices of ``packed.words``)."""
    leaves, offset = [], 0
    for shape, name in packed.layout.leaves:
        n = math.prod(shape)
        words = packed.words[offset: offset + n].reshape(shape)
        offset += n
        dtype = np.dtype(name)
        if dtype == np.bool_:
            leaves.append(words != 0)
        elif dtype == np.int32:
            leaves.append(words)
        else:
            leaves.append(jax.lax.bitcast_convert_type(words, dtype))
    return jax.tree.unflatten(packed.layout.tree, leaves)

