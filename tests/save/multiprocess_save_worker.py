"""One process of a multi-process save (driven by tests/save/test_save_multiprocess.py
and tests/save/test_hf_export_multiprocess.py).

Usage: python multiprocess_save_worker.py PROCESS_ID NUM_PROCESSES PORT
           LOCAL_DEVICES PRESET_DIR MESH OUT_DIR SAVES_JSON

Joins a `jax.distributed` job on 127.0.0.1:PORT with LOCAL_DEVICES simulated
CPU devices (gloo), loads PRESET_DIR sharded over MESH ("BxM"), then runs
each save of SAVES_JSON in order, a list of `{"target", "mode",
"format"}` (one save per mode): `save_sharded_preset(model, target, overwrite=True,
format=format)` ("keras", or "huggingface" in 100KB shards), recording every
byte range this process writes. One job runs several saves of one loaded
model (each process starts Python, JAX, Keras and KerasHub once, ~10 s),
failures after the plain saves. `mode`:

- `ok`: a plain save;
- `durable`: a save with `durable=True`, recording every path it fsyncs;
- `fail_write`: process 1's second positioned write raises `OSError`;
- `different_target`: process 1 passes `target` + "_other".

Writes `OUT_DIR/process_<id>.json`: the blocks its devices hold (`held`)
and, per save mode, the writes, the paths fsynced and the error raised, if
any (`saves`). Exits with 77 when the platform cannot run a multi-process
JAX job.
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import join_job  # noqa: E402


def _save(keras_hub_dist, backbone, process_id, target, mode, save_format):
    writes: list[tuple[str, int, int]] = []
    original_pwritev = os.pwritev

    def recording_pwritev(fd, buffers, offset, *args):
        if mode == "fail_write" and process_id == 1 and len(writes) >= 1:
            raise OSError(28, "No space left on device (injected by the test)")
        n = original_pwritev(fd, buffers, offset, *args)
        writes.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, n))
        return n

    fsynced: list[str] = []
    original_fsync = os.fsync

    def recording_fsync(fd):
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return original_fsync(fd)

    if mode == "different_target" and process_id == 1:
        target = target + "_other"
    os.pwritev, os.fsync = recording_pwritev, recording_fsync
    error = None
    try:
        extra = {"max_shard_size": "100KB"} if save_format == "huggingface" else {}
        keras_hub_dist.save_sharded_preset(
            backbone, target, overwrite=True, progress=False, format=save_format,
            durable=mode == "durable", **extra
        )
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        os.pwritev, os.fsync = original_pwritev, original_fsync
    return {"writes": writes, "fsynced": fsynced, "error": error}


def main() -> None:
    process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
    preset, mesh_arg, out_dir, saves = sys.argv[5:9]
    join_job(process_id, num_processes, port, local_devices)
    import jax

    import keras_hub_dist

    batch, model_axis = (int(x) for x in mesh_arg.split("x"))
    backbone = keras_hub_dist.load_sharded_preset(preset, mesh=(batch, model_axis), progress=False)
    reports = {
        save["mode"]: _save(keras_hub_dist, backbone, process_id, save["target"],
                            save["mode"], save.get("format", "keras"))
        for save in json.loads(saves)
    }

    held = {}
    for variable in backbone.weights:
        value = variable.value
        held[variable.path] = sorted(
            {
                tuple(
                    (s.start or 0, s.stop if s.stop is not None else dim)
                    for s, dim in zip(index, value.shape)
                )
                for index in value.sharding.addressable_devices_indices_map(value.shape).values()
            }
        )
    with open(os.path.join(out_dir, f"process_{process_id}.json"), "w") as handle:
        json.dump({"held": held, "saves": reports}, handle)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
