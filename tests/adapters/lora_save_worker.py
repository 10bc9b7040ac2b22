"""One process of a 2-process `jax.distributed` job that loads a Qwen 3
checkpoint with a LoRA adapter and saves the adapter back
(`tests/adapters/test_lora_multiprocess.py`), recording every positioned
write it makes.

Run as `lora_save_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES
HF_DIR ADAPTER MESH OUT_DIR`; writes `OUT_DIR/process_<id>.json` with
`writes` ([file, offset, bytes]), the `held` bytes of the LoRA factors on
its devices and `error`.
"""

import faulthandler
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import join_job  # noqa: E402


def main() -> None:
    process_id, num_processes, port, local_devices = (int(a) for a in sys.argv[1:5])
    hf_dir, adapter, mesh, out_dir = sys.argv[5:9]
    # A stuck job says where it is stuck (the test shows this stderr).
    faulthandler.dump_traceback_later(int(os.environ.get("KHD_WORKER_STACKS_AFTER_S", "200")), exit=True)
    join_job(process_id, num_processes, port, local_devices)
    import keras_hub_dist

    shape = tuple(int(d) for d in mesh.split("x"))
    backbone = keras_hub_dist.load_sharded_preset(hf_dir, mesh=shape, progress=False, lora_adapter=adapter)
    held = sum(
        s.data.nbytes for v in backbone.weights if "lora_kernel" in v.path for s in v.value.addressable_shards
    )
    writes = []
    original = os.pwritev

    def recording(fd, buffers, offset, *args):
        n = original(fd, buffers, offset, *args)
        writes.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, n))
        return n

    os.pwritev = recording
    error = None
    try:
        keras_hub_dist.save_lora_adapter(backbone, os.path.join(out_dir, "saved"), progress=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    finally:
        os.pwritev = original
    report = {"writes": writes, "held": held, "error": error}
    pathlib.Path(out_dir, f"process_{process_id}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
