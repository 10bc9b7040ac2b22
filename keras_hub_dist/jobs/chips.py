"""Each target chip's peak figures, from its maker's published specification.

The step-time estimates (`jobs.step_time`) divide the compiler's FLOPs,
bytes and collective bytes by these. They are the datasheet peaks, not
measured rates: an estimate from them is a bound, labelled as such.

Example:

```python
from keras_hub_dist.jobs.chips import CHIPS

CHIPS["v5e"].peak_bf16_flops  # 1.97e14
```
"""

from __future__ import annotations

import dataclasses

__all__ = ["CHIPS", "Chip"]

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's published peaks (per chip, SI units).

    Attributes:
        name: The chip, e.g. `"TPU v5e"`.
        peak_bf16_flops: Dense bf16 FLOP/s.
        hbm_bytes: HBM capacity (bytes).
        hbm_bandwidth: HBM bytes/s.
        interconnect_bandwidth: Chip-to-chip bytes/s, bidirectional, all
            links together (ICI for a TPU, NVLink for a GPU).
        source: Where the figures are published.
    """

    name: str
    peak_bf16_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    interconnect_bandwidth: float
    source: str


CHIPS = {
    # https://cloud.google.com/tpu/docs/v5e ("Key chip specifications"):
    # 197 TFLOPs bf16, 16 GB HBM2 at 819 GBps, bidirectional ICI 400 GBps
    # per chip. libtpu's compiler offers 15.75 GiB of it to a program.
    "v5e": Chip("TPU v5e", 197e12, 16 * 2**30, 819 * _GB, 400 * _GB, "https://cloud.google.com/tpu/docs/v5e"),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 32 GB HBM at
    # 1638 GBps, bidirectional ICI 800 GBps per chip.
    "v6e": Chip("TPU v6e", 918e12, 32 * 2**30, 1638 * _GB, 800 * _GB, "https://cloud.google.com/tpu/docs/v6e"),
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, 32 GiB HBM2 at
    # 1200 GBps. The v4 page gives no per-chip ICI figure: 600 GB/s
    # bidirectional here is an ASSUMPTION (half of v5p's published 1200),
    # not a published figure; v4 comms estimates carry it.
    "v4": Chip("TPU v4", 275e12, 32 * 2**30, 1200 * _GB, 600 * _GB, "https://cloud.google.com/tpu/docs/v4"),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 95 GB HBM2e
    # at 2765 GBps, bidirectional ICI 1200 GBps per chip.
    "v5p": Chip("TPU v5p", 459e12, 95 * 2**30, 2765 * _GB, 1200 * _GB, "https://cloud.google.com/tpu/docs/v5p"),
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM): 989.5
    # TFLOPS dense bf16 (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s,
    # NVLink 900 GB/s bidirectional. The target config's device memory is
    # 84,929,347,584 bytes (79.1 GiB usable).
    "h100": Chip("NVIDIA H100 SXM", 989.5e12, 84_929_347_584, 3.35e12, 900 * _GB, "https://www.nvidia.com/en-us/data-center/h100/"),
}
