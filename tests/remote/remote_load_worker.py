"""One process of a multi-process remote load (driven by
tests/remote/test_remote_multiprocess.py).

Usage: python remote_load_worker.py PROCESS_ID NUM_PROCESSES PORT
           LOCAL_DEVICES URL LOCAL_DIR MESH OUT_DIR

Joins a `jax.distributed` job on 127.0.0.1:PORT (gloo collectives), loads URL
sharded over the global mesh MESH ("BxM"), loads LOCAL_DIR (the same
checkpoint on disk) the same way, and writes `OUT_DIR/process_<id>.json`
saying whether every block this process holds is bitwise equal.
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import join_job  # noqa: E402


def main() -> None:
    process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
    url, local_dir, mesh_arg, out_dir = sys.argv[5:9]
    join_job(process_id, num_processes, port, local_devices)
    import jax
    import keras
    import numpy as np

    import keras_hub_dist

    batch, model = (int(x) for x in mesh_arg.split("x"))
    remote = keras_hub_dist.load_sharded_preset(url, mesh=(batch, model), progress=False)
    keras.distribution.set_distribution(None)
    local = keras_hub_dist.load_sharded_preset(local_dir, mesh=(batch, model), progress=False)
    unequal = []
    for ours, theirs in zip(remote.weights, local.weights):
        a, b = ours.value, theirs.value
        same = a.sharding.is_equivalent_to(b.sharding, a.ndim) and all(
            np.array_equal(np.asarray(x.data), np.asarray(y.data))
            for x, y in zip(a.addressable_shards, b.addressable_shards)
        )
        if not same:
            unequal.append(ours.path)
    with open(os.path.join(out_dir, f"process_{process_id}.json"), "w") as handle:
        json.dump({"process_index": jax.process_index(), "unequal": unequal,
                   "variables": len(remote.weights)}, handle)


if __name__ == "__main__":
    main()
