"""MXFP4 expert weights (gpt-oss), dequantized block by block.

gpt-oss checkpoints store each expert matrix `(experts, out, in)` as
`*_blocks`, uint8 `(experts, out, in / 32, 16)` holding two 4-bit E2M1 values
per byte (low nibble first), and `*_scales`, uint8 `(experts, out, in / 32)`
holding one E8M0 power-of-two exponent per group of 32 values. KerasHub's
converter dequantizes the whole tensor to float32 and transposes it to
`(experts, in, out)`. Every value depends only on its own byte and its
group's scale, so a device's block needs only its experts, its output rows
and the 32-groups covering its input range.

The 16 E2M1 values are computed once with the converter's own formula, so a
table lookup times the scale gives the same float32 bits as its full-tensor
code (all products are exact: a power of two times a value with a 2-bit
significand).
"""

from __future__ import annotations

import numpy as np

from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import Index, StoredTensor, TensorSource

__all__ = ["GROUP", "Mxfp4Source", "e2m1_values"]

# Values per scale: 16 bytes of two nibbles each.
GROUP = 32


def e2m1_values() -> np.ndarray:
    """float32 value of each 4-bit code, by the converter's formula."""
    codes = np.arange(16, dtype=np.uint8)
    s, e, m = (codes >> 3) & 0x1, (codes >> 1) & 0x3, codes & 0x1
    sign = 1.0 - 2.0 * s
    values = np.empty(16, dtype=np.float32)
    normal = e != 0
    values[normal] = (
        sign[normal]
        * (2.0 ** (e[normal].astype(np.float32) - 1.0))
        * (1.0 + m[normal].astype(np.float32) / 2.0)
    )
    values[~normal] = sign[~normal] * (2.0 ** (1.0 - 1.0)) * (m[~normal].astype(np.float32) / 2.0)
    return values


_E2M1 = e2m1_values()


class Mxfp4Source(TensorSource):
    """`transpose(dequantize(blocks, scales), (0, 2, 1))`, block by block.

    Args:
        blocks: The stored `*_blocks` tensor, uint8 `(E, O, G, 16)`.
        scales: The stored `*_scales` tensor, uint8 `(E, O, G)`.
    """

    def __init__(self, blocks: StoredTensor, scales: StoredTensor) -> None:
        experts, out, groups, half = blocks.shape
        if half * 2 != GROUP or tuple(scales.shape) != (experts, out, groups):
            raise ValueError(
                f"Expected MXFP4 blocks (E, O, G, 16) with scales (E, O, G). "
                f"Received: blocks {blocks.shape}, scales {scales.shape}."
            )
        self.blocks, self.scales = blocks, scales
        self.shape = (experts, groups * GROUP, out)
        self.dtype = np.dtype(np.float32)
        self.description = f"MXFP4 tensors at bytes {blocks.offset} and {scales.offset} of {blocks.file!r}"

    def _stored_index(self, index: Index) -> tuple[Index, int]:
        (e0, e1), (k0, k1), (o0, o1) = index
        g0, g1 = k0 // GROUP, -(-k1 // GROUP)
        return ((e0, e1), (o0, o1), (g0, g1)), g0 * GROUP

    def read(self, index: Index) -> np.ndarray:
        stored, first = self._stored_index(index)
        (e0, e1), (o0, o1), (g0, g1) = stored
        packed = self.blocks.read(stored + ((0, GROUP // 2),))
        exponents = self.scales.read(stored)
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1)
        values = _E2M1[codes].reshape(e1 - e0, o1 - o0, g1 - g0, GROUP)
        # Scale 255 is inf, as in the converter; no warning for what it allows.
        with np.errstate(over="ignore", invalid="ignore"):
            scale = 2.0 ** (exponents.astype(np.float32) - 127.0)
            values *= scale[..., None]
        k0, k1 = index[1]
        values = values.reshape(e1 - e0, o1 - o0, (g1 - g0) * GROUP)[:, :, k0 - first : k1 - first]
        out = host_io.aligned_empty(tuple(b - a for a, b in index), self.dtype)
        out[...] = values.transpose(0, 2, 1)
        return out

    def read_nbytes(self, index: Index) -> int:
        stored, _ = self._stored_index(index)
        return (
            self.blocks.block_runs(stored + ((0, GROUP // 2),)).nbytes
            + self.scales.block_runs(stored).nbytes
        )
