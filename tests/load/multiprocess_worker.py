"""One process of a multi-process load (driven by tests/load/test_multiprocess.py).

Usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT
           LOCAL_DEVICES MESH OUT_DIR LOADS_JSON

Joins a `jax.distributed` job on 127.0.0.1:PORT with LOCAL_DEVICES simulated
CPU devices (gloo collectives), then runs each load of LOADS_JSON in order,
a list of `{"name", "preset", "device_transpose_min_bytes", "extras"}` (one
job, several loads: each process starts Python, JAX, Keras and KerasHub
once, ~10 s). Each load reads `preset` (KerasHub's model.weights.h5 or a
Hugging Face checkpoint's shards) sharded over the global mesh MESH ("BxM"),
recording every byte range this process reads from the weights files, and
runs a jitted forward pass (`OUT_DIR/logits_<name>_<id>.npy`). With
`device_transpose_min_bytes` set, blocks of that size or more are
transposed on the devices (tests of small models take the large-block path
anyway). A load with `extras` then draws a table with the distributed
initializer and loads the preset again, quantized to int8. Writes
`OUT_DIR/process_<id>.json`. Exits with 77 when the platform cannot run a
multi-process JAX job (the test then skips with the message).
"""

import hashlib
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import join_job  # noqa: E402


class _ReadRecorder:
    """Records the byte ranges `os.pread` / `os.preadv` read from a
    preset's weights files while active: reads before a safetensors file's
    tensors begin are of its header, kept apart."""

    def __init__(self, preset):
        self.files = {
            os.path.realpath(os.path.join(preset, name))
            for name in os.listdir(preset)
            if name.endswith((".weights.h5", ".safetensors"))
        }
        self.data_start = {}
        for path in self.files:
            if path.endswith(".safetensors"):
                with open(path, "rb") as f:
                    self.data_start[path] = 8 + int.from_bytes(f.read(8), "little")
        self.reads: list[tuple[int, int]] = []
        self.header_reads: list[tuple[int, int]] = []

    def _record(self, fd, offset, n):
        path = os.path.realpath(f"/proc/self/fd/{fd}")
        if path in self.files and n > 0:
            target = self.header_reads if offset < self.data_start.get(path, 0) else self.reads
            target.append((offset, n))

    def __enter__(self):
        self.original = os.preadv, os.pread
        original_preadv, original_pread = self.original

        def recording_preadv(fd, buffers, offset, *args):
            n = original_preadv(fd, buffers, offset, *args)
            self._record(fd, offset, n)
            return n

        def recording_pread(fd, length, offset):
            data = original_pread(fd, length, offset)
            self._record(fd, offset, len(data))
            return data

        os.preadv, os.pread = recording_preadv, recording_pread
        return self

    def __exit__(self, *exc):
        os.preadv, os.pread = self.original


def _block(index, shape):
    return ",".join(f"{i.start or 0}:{i.stop if i.stop is not None else dim}"
                    for i, dim in zip(index, shape))


def main() -> None:
    process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
    mesh_arg, out_dir, loads = sys.argv[5:8]
    join_job(process_id, num_processes, port, local_devices)
    import jax

    import keras
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import keras_hub_dist
    from keras_hub_dist.load import block_plan

    batch, model = (int(x) for x in mesh_arg.split("x"))
    report = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_ids": [d.id for d in jax.local_devices()],
        "loads": {},
    }
    default_transpose_min_bytes = block_plan.DEVICE_TRANSPOSE_MIN_BYTES
    for load in json.loads(loads):
        name, preset = load["name"], load["preset"]
        block_plan.DEVICE_TRANSPOSE_MIN_BYTES = (
            default_transpose_min_bytes if load.get("device_transpose_min_bytes") is None
            else load["device_transpose_min_bytes"]
        )
        with _ReadRecorder(preset) as recorded:
            backbone = keras_hub_dist.load_sharded_preset(
                preset, mesh=(batch, model), progress=False
            )
        block_plan.DEVICE_TRANSPOSE_MIN_BYTES = default_transpose_min_bytes

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
        report["loads"][name] = {
            "reads": recorded.reads, "header_reads": recorded.header_reads, "held": held,
        }

        mesh = keras.distribution.distribution().device_mesh.backend_mesh
        replicated = NamedSharding(mesh, PartitionSpec())

        def to_global(x, replicated=replicated):
            return jax.make_array_from_callback(x.shape, replicated, lambda i: x[i])

        token_ids = (np.arange(16, dtype="int32").reshape(2, 8) * 7) % 64  # every vocabulary here
        inputs = {
            "token_ids": to_global(token_ids),
            "padding_mask": to_global(np.ones_like(token_ids)),
        }
        forward = jax.jit(
            lambda trainable, non_trainable, x, backbone=backbone: backbone.stateless_call(
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
            os.path.join(out_dir, f"logits_{name}_{process_id}.npy"),
            np.asarray(outputs.addressable_data(0)),
        )
        if not load.get("extras"):
            continue

        # The distributed initializer under the same job: each process draws
        # only its own devices' blocks of the table.
        initializer = keras_hub_dist.DistributedVarianceScaling(
            seed=5, path="token_embedding/embeddings"
        )
        table = initializer((256, 64))
        report["table_sharding"] = str(table.sharding.spec)
        report["table_blocks"] = {
            _block(shard.index, table.shape): np.asarray(shard.data).tolist()
            for shard in table.addressable_shards
        }
        # The same preset quantized to int8 on load: row-split kernels need
        # statistics from both processes (one collective); each process
        # reports a digest of every block its devices hold, and the bytes it
        # read.
        with _ReadRecorder(preset) as quantized_reads:
            quantized = keras_hub_dist.load_sharded_preset(
                preset, mesh=(batch, model), progress=False, quantize="int8"
            )
        report["quantized_digests"] = {
            variable.path: {
                _block(shard.index, variable.shape):
                    hashlib.sha256(np.asarray(shard.data).tobytes()).hexdigest()
                for shard in variable.value.addressable_shards
            }
            for variable in quantized.weights
        }
        report["quantized_read_bytes"] = sum(n for _, n in quantized_reads.reads)
    with open(os.path.join(out_dir, f"process_{process_id}.json"), "w") as handle:
        json.dump(report, handle)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
