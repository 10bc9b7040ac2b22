"""One process of a multi-process restore (driven by
tests/load/test_restore_multiprocess.py).

Usage: python restore_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES
           PRESET_DIR CHECKPOINT_DIR MESH OUT_DIR

Joins a `jax.distributed` job on 127.0.0.1:PORT with LOCAL_DEVICES simulated
CPU devices (gloo collectives), loads PRESET_DIR as a causal LM over the
global mesh MESH ("BxM"), compiles it with Adam, restores CHECKPOINT_DIR
with `restore_checkpoint` (sampling this process's devices after every
placement) and writes `OUT_DIR/process_<id>.json`: the step, the
iterations, the SHA-256 of every block its devices hold (model variables by
path, optimizer variables without the optimizer's name) and its devices'
peak and final bytes. Exits with 77 when the platform cannot run a
multi-process JAX job.
"""

import hashlib
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import join_job  # noqa: E402


def main() -> None:
    process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
    preset, checkpoint, mesh_arg, out_dir = sys.argv[5:9]
    join_job(process_id, num_processes, port, local_devices)
    import jax
    import keras
    import numpy as np

    import keras_hub_dist
    from keras_hub_dist.measure import memory
    from keras_hub_dist.measure.event_samples import sampling_after_calls

    batch, model = (int(x) for x in mesh_arg.split("x"))
    # KerasHub's task compiles with a sampler whose seed generator is drawn
    # at random: the same seed on every process, or device_put refuses it.
    keras.utils.set_random_seed(0)
    lm = keras_hub_dist.load_sharded_preset(
        preset, mesh=(batch, model), task="causal_lm", progress=False
    )
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    with memory.MemorySampler(interval_s=1.0) as sampler, \
            sampling_after_calls(sampler, jax, "device_put") as samples:
        step = keras_hub_dist.restore_checkpoint(lm, checkpoint)
    final = sampler.final_per_device
    peak = {d: max([s[d] for s in samples] + [final[d]]) for d in final}

    blocks = {}
    named = [(v.path, v) for v in lm.trainable_variables + lm.non_trainable_variables]
    named += [("optimizer/" + v.path.split("/", 1)[1], v) for v in lm.optimizer.variables]
    for name, variable in named:
        value = variable.value
        for shard in value.addressable_shards:
            index = ",".join(
                f"{s.start or 0}:{s.stop if s.stop is not None else n}"
                for s, n in zip(shard.index, value.shape)
            )
            data = np.ascontiguousarray(np.asarray(shard.data))
            blocks.setdefault(name, {})[index] = hashlib.sha256(data.tobytes()).hexdigest()
    report = {
        "process_index": jax.process_index(),
        "step": step,
        "iterations": int(np.asarray(lm.optimizer.iterations.value.addressable_data(0))),
        "blocks": blocks,
        "peak": {str(d): int(b) for d, b in peak.items()},
        "final": {str(d): int(b) for d, b in final.items()},
    }
    with open(os.path.join(out_dir, f"process_{process_id}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
