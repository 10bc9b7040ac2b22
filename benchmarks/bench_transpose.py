"""Benchmark: rearranging one bfloat16 tile on the host, three ways.

A conversion (`keras-hub-dist convert`) transposes nearly every kernel byte
(Keras stores `(in, out)`, Transformers `(out, in)`). This measures, for one
tile of a Gemma-7B MLP kernel (`--rows` x 3072, bfloat16: 64 MiB by
default), the CPU-seconds per GB of:

- `numpy_tiles`: `save.piece_write._tiled_copy` (NumPy's strided copy in
  256 x 256 tiles; what `PieceWriter` does without a transpose device);
- `xla_whole`: one XLA transpose of the whole tile on a CPU device;
- `xla_slabs`: `PieceWriter`'s path with a transpose device: XLA transposes
  of `--slab_mib` slabs of the tile's leading axis, each copied into one
  reused output buffer.

Every result is checked against `np.ascontiguousarray(tile.T)`.

Usage:

    python benchmarks/bench_transpose.py
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from keras_hub_dist.storage.host_io import aligned_empty  # noqa: E402
from keras_hub_dist.save import piece_write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10922)
    parser.add_argument("--cols", type=int, default=3072)
    parser.add_argument("--slab_mib", type=int, default=piece_write.XLA_SLAB_BYTES >> 20)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    device = jax.local_devices(backend="cpu")[0]
    tile = aligned_empty((args.rows, args.cols), ml_dtypes.bfloat16)
    tile.view(np.uint16)[...] = np.random.default_rng(0).integers(0, 1 << 16, tile.shape, dtype=np.uint16)
    expected = np.ascontiguousarray(tile.T)
    out = aligned_empty(expected.shape, ml_dtypes.bfloat16)
    transpose = piece_write._transposer((1, 0))
    step = max(1, (args.slab_mib << 20) // (args.cols * 2))

    def numpy_tiles() -> np.ndarray:
        piece_write._tiled_copy(out, tile.T)
        return out

    def xla_whole() -> np.ndarray:
        return np.asarray(transpose(jax.device_put(tile, device)))

    def xla_slabs() -> np.ndarray:
        for first in range(0, args.rows, step):
            slab = transpose(jax.device_put(tile[first : first + step], device))
            np.copyto(out[:, first : first + step], np.asarray(slab))
            slab.delete()
        return out

    print(f"tile {args.rows} x {args.cols} bfloat16 ({tile.nbytes / 2**20:.0f} MiB), "
          f"slabs of {step} rows, {args.repeats} repeats, {os.cpu_count()} cores")
    print("| way | GB per CPU-second | GB per second (wall) |\n|---|---|---|")
    for name, run in (("numpy_tiles", numpy_tiles), ("xla_whole", xla_whole), ("xla_slabs", xla_slabs)):
        assert np.array_equal(run().view(np.uint16), expected.view(np.uint16)), name
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.repeats):
            run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        total = args.repeats * tile.nbytes / 1e9
        print(f"| {name} | {total / cpu:.2f} | {total / wall:.2f} |")


if __name__ == "__main__":
    main()
