"""Per-device and host memory measurement: the public name of `keras_hub_dist.measure.memory`.

Kept at the package root so `keras_hub_dist.memory.X` and
`from keras_hub_dist.memory import X` keep working; the code lives in
`keras_hub_dist/measure/memory.py`.
"""

from keras_hub_dist.measure.memory import (  # noqa: F401
    MemorySampler,
    compiled_memory,
    current_rss_bytes,
    device_memory_stats,
    host_peak_rss_bytes,
    live_bytes_per_device,
    reset_host_peak_rss,
)

__all__ = [
    "MemorySampler",
    "compiled_memory",
    "current_rss_bytes",
    "device_memory_stats",
    "host_peak_rss_bytes",
    "live_bytes_per_device",
    "reset_host_peak_rss",
]
