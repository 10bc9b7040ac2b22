"""`LoadReport`: what one load cost, measured."""

from __future__ import annotations

import dataclasses

__all__ = ["LoadReport"]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """Time and memory of one `load_sharded_preset` call, measured until every
    weight was resident on its devices.

    Attributes:
        preset: What was loaded.
        axis_sizes: The mesh, `{axis name: size}`.
        wall_s: Seconds from the call to the last weight being resident.
        model_bytes: Bytes of all loaded variables (in their final dtype).
        bytes_read: Bytes this process read from the weights file(s).
        file_bytes: Bytes of the weights datasets on disk.
        read_calls: Read system calls (or h5py reads) made.
        expected_per_device: Bytes each device must hold when done (plan).
        peak_per_device / final_per_device: Measured bytes per device id
            (`keras_hub_dist.memory.MemorySampler`) added by this call: the
            sampled peak and the final bytes, minus what the device held
            when the call began.
        host_rss_start / host_rss_peak / host_rss_final: Process RSS, bytes.
        format: The checkpoint format (`"keras_h5"`, `"huggingface"`).
        fallbacks: Variables whose values could not be computed block by
            block, so their whole tensor was converted on the host (one
            tensor at a time), with the reason; empty for every family
            keras_hub_dist is tested with.
        host_bytes_reused: Bytes of host read buffers that were buffers of
            earlier blocks whose values had been consumed (transposed on
            their devices, or cast), taken again instead of fresh memory
            (`storage.host_io.BufferPool`).
    """

    preset: str
    axis_sizes: dict[str, int]
    wall_s: float
    model_bytes: int
    bytes_read: int
    file_bytes: int
    read_calls: int
    expected_per_device: dict[int, int]
    peak_per_device: dict[int, int]
    final_per_device: dict[int, int]
    host_rss_start: int
    host_rss_peak: int
    host_rss_final: int
    format: str = "keras_h5"
    fallbacks: tuple[str, ...] = ()
    host_bytes_reused: int = 0

    @property
    def peak_over_final(self) -> float:
        """The largest per-device peak / final ratio (1.0 = no spike)."""
        return max(
            (self.peak_per_device[d] / f for d, f in self.final_per_device.items() if f),
            default=1.0,
        )

    @property
    def host_growth_over_model(self) -> float:
        """Host peak RSS growth during the load / model bytes."""
        return (self.host_rss_peak - self.host_rss_start) / max(self.model_bytes, 1)

    def __str__(self) -> str:
        lines = [
            f"load_sharded_preset({self.preset!r}) on mesh {self.axis_sizes}: "
            f"{self.wall_s:.2f} s, {self.model_bytes / 1e9:.3f} GB of weights, "
            f"{self.bytes_read / 1e9:.3f} GB read in {self.read_calls} reads",
            f"  host RSS: start {self.host_rss_start / 1e9:.2f} GB, peak "
            f"{self.host_rss_peak / 1e9:.2f} GB, growth/model "
            f"{self.host_growth_over_model:.2f}",
            *(f"  host fallback: {reason}" for reason in self.fallbacks),
            f"  {'device':>6} {'expected':>12} {'final':>12} {'peak':>12} {'peak/final':>10}",
        ]
        for d in sorted(self.final_per_device):
            final = self.final_per_device[d]
            peak = self.peak_per_device.get(d, 0)
            lines.append(
                f"  {d:>6} {self.expected_per_device.get(d, 0):>12,} {final:>12,} "
                f"{peak:>12,} {peak / final if final else float('nan'):>10.3f}"
            )
        return "\n".join(lines)
