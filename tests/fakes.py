"""Stand-ins for JAX devices and meshes, for testing pure planning code."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FakeDevice:
    """A stand-in for a `jax.Device` in planning tests."""

    id: int
    process_index: int = 0


class FakeMesh:
    """A device grid with axis names, without devices: for planning tests.

    Args:
        axis_sizes: `{axis_name: size}` in mesh order.
        num_processes: Devices are split into this many processes in order
            (device `i` belongs to process `i * num_processes // n`), like
            hosts owning consecutive devices.
    """

    def __init__(self, axis_sizes: Mapping[str, int], num_processes: int = 1) -> None:
        self.axis_names = tuple(axis_sizes)
        shape = tuple(int(s) for s in axis_sizes.values())
        n = math.prod(shape)
        if num_processes < 1 or n % num_processes:
            raise ValueError(
                f"Expected num_processes to divide the {n} devices. "
                f"Received: num_processes={num_processes}."
            )
        devices = [FakeDevice(i, i * num_processes // n) for i in range(n)]
        self.devices = np.empty(n, dtype=object)
        self.devices[:] = devices
        self.devices = self.devices.reshape(shape)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self.devices.shape)
