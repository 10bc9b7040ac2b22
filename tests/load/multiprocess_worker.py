"""One process of a multi-process load (driven by tests/load/test_multiprocess.py).

Usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT
           LOCAL_DEVICES PRESET_DIR MESH OUT_DIR

Joins a `jax.distributed` job on 127.0.0.1:PORT with LOCAL_DEVICES simulated
CPU devices (gloo collectives), loads PRESET_DIR sharded over the global mesh
MESH ("BxM"), records every byte range this process reads from the weights
file, runs a jitted forward pass and writes `OUT_DIR/process_<id>.json` plus
`OUT_DIR/logits_<id>.npy`. Exits with 77 when the platform cannot run a
multi-process JAX job (the test then skips with the message).
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import join_job  # noqa: E402


def main() -> None:
    process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
    preset, mesh_arg, out_dir = sys.argv[5:8]
    join_job(process_id, num_processes, port, local_devices)
    import jax

    import keras
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import keras_hub_dist
    from keras_hub_dist.load import block_plan

    # Tests of small models may ask large-block paths to be taken anyway.
    if os.environ.get("KHD_DEVICE_TRANSPOSE_MIN_BYTES"):
        block_plan.DEVICE_TRANSPOSE_MIN_BYTES = int(os.environ["KHD_DEVICE_TRANSPOSE_MIN_BYTES"])

    # KerasHub's model.weights.h5, or a Hugging Face checkpoint's shards.
    weights_files = {
        os.path.realpath(os.path.join(preset, name))
        for name in os.listdir(preset)
        if name.endswith((".weights.h5", ".safetensors"))
    }
    # Where each safetensors file's tensors begin: reads before that are of
    # its header, recorded apart from the weights' bytes.
    data_start = {}
    for path in weights_files:
        if path.endswith(".safetensors"):
            with open(path, "rb") as f:
                data_start[path] = 8 + int.from_bytes(f.read(8), "little")
    reads: list[tuple[int, int]] = []
    header_reads: list[tuple[int, int]] = []
    original_preadv = os.preadv
    original_pread = os.pread

    def record(fd: int, offset: int, n: int) -> None:
        path = os.path.realpath(f"/proc/self/fd/{fd}")
        if path in weights_files and n > 0:
            (header_reads if offset < data_start.get(path, 0) else reads).append((offset, n))

    def recording_preadv(fd, buffers, offset, *args):
        n = original_preadv(fd, buffers, offset, *args)
        record(fd, offset, n)
        return n

    def recording_pread(fd, length, offset):
        data = original_pread(fd, length, offset)
        record(fd, offset, len(data))
        return data

    os.preadv, os.pread = recording_preadv, recording_pread
    batch, model = (int(x) for x in mesh_arg.split("x"))
    try:
        backbone = keras_hub_dist.load_sharded_preset(
            preset, mesh=(batch, model), progress=False
        )
    finally:
        os.preadv, os.pread = original_preadv, original_pread

    # Which blocks this process's devices hold, straight from the arrays.
    held = {}
    for variable in backbone.weights:
        value = variable.value
        held[variable.path] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "blocks": sorted(
                {
                    tuple(
                        (s.start or 0, s.stop if s.stop is not None else dim)
                        for s, dim in zip(index, value.shape)
                    )
                    for index in value.sharding.addressable_devices_indices_map(
                        value.shape
                    ).values()
                }
            ),
        }

    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    replicated = NamedSharding(mesh, PartitionSpec())

    def to_global(x):
        return jax.make_array_from_callback(x.shape, replicated, lambda i: x[i])

    token_ids = (np.arange(16, dtype="int32").reshape(2, 8) * 7) % 256
    inputs = {
        "token_ids": to_global(token_ids),
        "padding_mask": to_global(np.ones_like(token_ids)),
    }
    forward = jax.jit(
        lambda trainable, non_trainable, x: backbone.stateless_call(
            trainable, non_trainable, x
        )[0],
        out_shardings=replicated,
    )
    outputs = forward(
        [v.value for v in backbone.trainable_variables],
        [v.value for v in backbone.non_trainable_variables],
        inputs,
    )
    np.save(
        os.path.join(out_dir, f"logits_{process_id}.npy"),
        np.asarray(outputs.addressable_data(0)),
    )

    # The distributed initializer under the same job: each process draws only
    # its own devices' blocks of the table.
    initializer = keras_hub_dist.DistributedVarianceScaling(
        seed=5, path="token_embedding/embeddings"
    )
    table = initializer((256, 64))
    drawn = {
        ",".join(f"{i.start or 0}:{i.stop if i.stop is not None else dim}"
                 for i, dim in zip(shard.index, table.shape)):
            np.asarray(shard.data).tolist()
        for shard in table.addressable_shards
    }
    # The same preset quantized to int8 on load: row-split kernels need
    # statistics from both processes (one collective); each process reports
    # a digest of every block its devices hold, and the bytes it read.
    import hashlib

    quantized_reads: list[tuple[int, int]] = []
    reads, all_reads = quantized_reads, reads
    header_reads, all_header_reads = [], header_reads
    os.preadv, os.pread = recording_preadv, recording_pread
    try:
        quantized = keras_hub_dist.load_sharded_preset(
            preset, mesh=(batch, model), progress=False, quantize="int8"
        )
    finally:
        os.preadv, os.pread = original_preadv, original_pread
    reads, header_reads = all_reads, all_header_reads
    digests = {
        variable.path: {
            ",".join(f"{i.start or 0}:{i.stop if i.stop is not None else dim}"
                     for i, dim in zip(shard.index, variable.shape)):
                hashlib.sha256(np.asarray(shard.data).tobytes()).hexdigest()
            for shard in variable.value.addressable_shards
        }
        for variable in quantized.weights
    }
    with open(os.path.join(out_dir, f"process_{process_id}.json"), "w") as handle:
        json.dump(
            {
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
                "device_count": jax.device_count(),
                "local_device_ids": [d.id for d in jax.local_devices()],
                "reads": reads,
                "header_reads": header_reads,
                "held": held,
                "table_sharding": str(table.sharding.spec),
                "table_blocks": drawn,
                "quantized_digests": digests,
                "quantized_read_bytes": sum(n for _, n in quantized_reads),
            },
            handle,
        )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
