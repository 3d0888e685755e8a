"""Tile tables: each op's tiles measured per device kind and shape, and the device's SM count they scale with.

A table maps a device kind (`jax.Device.device_kind`: "NVIDIA H200" on an H200) to the shapes measured there and
their tiles. A shape the table lacks takes its default, the H200's best over its sweep; a device kind it lacks
(another GPU, the CPU of the interpret-mode tests) takes the H200's shapes. Grids sized to fill the GPU aim at a
number of waves (programs per SM) times the device's SM count.
"""

from __future__ import annotations

import dataclasses

import jax

H200 = "NVIDIA H200"
H200_SMS = 132


def device_kind() -> str:
    """The kind of the default backend's first device ("NVIDIA H200", "cpu", ...)."""
    return jax.devices()[0].device_kind


def sm_count() -> int:
    """SMs of the default backend's first device, a GPU's `core_count`; the H200's 132 where the device reports
    none (the CPU: interpret mode sizes its grids as for an H200)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or H200_SMS


def programs(waves: int) -> int:
    """Programs that give the device's SMs ``waves`` each."""
    return waves * sm_count()


@dataclasses.dataclass(frozen=True)
class TileTable[Tiles]:
    """One op's tiles: ``measured`` device kind -> {shape: tiles}, the H200's among them; ``default`` for a shape
    measured on no device."""
    measured: dict[str, dict[tuple, Tiles]]
    default: Tiles

    def on(self, kind: str | None = None) -> dict[tuple, Tiles]:
        """The shapes measured on ``kind`` (default: the default backend's device), the H200's for a kind absent."""
        return self.measured.get(device_kind() if kind is None else kind, self.measured[H200])

    def get(self, shape: tuple, kind: str | None = None, **given) -> Tiles:
        """The tiles of ``shape`` on ``kind``, else the default; fields ``given`` (not None) replace the table's."""
        tiles = self.on(kind).get(shape, self.default)
        return dataclasses.replace(tiles, **{name: value for name, value in given.items() if value is not None})
