"""One process of a 2-process `jax.distributed` job that enables LoRA on a
tiny Qwen 3 and saves the adapter into a bucket and into a directory
(`tests/adapters/test_lora_remote.py`).

Run as `lora_remote_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES
HF_DIR MESH URL OUT_DIR [FAIL_URL]`; the store's endpoint comes from the
environment. With a FAIL_URL, the job first saves into FAIL_URL with process
1's writes into its part buffer raising (its report under `failed`), then
saves into URL and OUT_DIR.
Writes `OUT_DIR/process_<id>.json` with the parts it uploaded
(`[name, number, bytes]`), the parts it took part in combining and `error`.
The base is loaded without an adapter: a 2-process adapter load can hang
(tests/adapters/test_lora_multiprocess.py).
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
    hf_dir, mesh, url, out_dir = sys.argv[5:9]
    fail_url = sys.argv[9] if len(sys.argv) > 9 else None
    failing = False  # while set, process 1's writes into a part buffer raise
    # A stuck job says where it is stuck (the test shows this stderr).
    faulthandler.dump_traceback_later(int(os.environ.get("KHD_WORKER_STACKS_AFTER_S", "200")), exit=True)
    join_job(process_id, num_processes, port, local_devices)
    import keras_hub_dist
    from keras_hub_dist.storage import part_uploads, s3_writer

    uploaded, combined = [], []
    real_upload, real_combine = s3_writer.S3Writer.upload_part, part_uploads.PartUploads.combine

    def upload_part(self, name, upload_id, number, data):
        token = real_upload(self, name, upload_id, number, data)
        uploaded.append((name, number, memoryview(data).nbytes))
        return token

    def combine(self, path, number, reduce):
        combined.append(number)
        return real_combine(self, path, number, reduce)

    def pwritev(self, handle, buffers, offset):
        if failing and process_id == 1:
            raise OSError("injected by the test")
        return real_pwritev(self, handle, buffers, offset)

    real_pwritev = part_uploads.PartUploads.pwritev
    part_uploads.PartUploads.pwritev = pwritev
    s3_writer.S3Writer.upload_part = upload_part
    part_uploads.PartUploads.combine = combine
    shape = tuple(int(d) for d in mesh.split("x"))
    backbone = keras_hub_dist.load_sharded_preset(hf_dir, mesh=shape, progress=False)
    # No keras.utils.set_random_seed: enable_lora agrees on its seeds.
    keras_hub_dist.enable_lora(backbone, rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
    for variable in backbone.trainable_weights:  # lora_B starts at zero: make every byte count
        variable.assign(variable.value + 0.5)
    failed = None
    if fail_url:
        failing, error = True, None
        try:
            keras_hub_dist.save_lora_adapter(backbone, fail_url, progress=False)
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"{type(e).__name__}: {e}"
        failed = {"uploaded": uploaded[:], "combined": combined[:], "error": error}
        failing = False
        del uploaded[:], combined[:]
    error = None
    try:
        keras_hub_dist.save_lora_adapter(backbone, url, progress=False)
        keras_hub_dist.save_lora_adapter(backbone, os.path.join(out_dir, "local"), progress=False)
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    report = {"uploaded": uploaded, "combined": combined, "error": error, "failed": failed}
    pathlib.Path(out_dir, f"process_{process_id}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
