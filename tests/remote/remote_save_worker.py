"""One process of a multi-process save into object storage (driven by
tests/remote/test_remote_save_multiprocess.py).

Usage: python remote_save_worker.py PROCESS_ID NUM_PROCESSES PORT
           LOCAL_DEVICES PRESET MESH URL OUT_DIR [MODE]

Joins a `jax.distributed` job on 127.0.0.1:PORT (gloo collectives), loads
PRESET sharded over the global mesh MESH ("BxM"), saves it to URL (the
store's endpoint comes from the environment) and to OUT_DIR/local (a
directory both processes share here), and writes
`OUT_DIR/process_<id>.json` with what it uploaded and the error it raised,
if any, and `combine_extra`: the most bytes a device held beyond the
model's at the moment a mixed part's slice was summed (inputs and output
live). MODE `fail_part`: process 1's second part upload raises (in the store's
client, as a refused upload would). MODE `hf`: then also exports the model in
the Hugging Face format to URL + "-hf" and to OUT_DIR/local_hf (the same
job: each process starts Python, JAX and Keras once).
"""

import itertools
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import join_job  # noqa: E402


def main() -> None:
    process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
    preset, mesh_arg, url, out_dir = sys.argv[5:9]
    mode = sys.argv[9] if len(sys.argv) > 9 else ""
    join_job(process_id, num_processes, port, local_devices)
    import jax

    import keras_hub_dist
    from keras_hub_dist.formats import checksums
    from keras_hub_dist.storage import part_uploads

    checksums.CHUNK_BYTES = 5 << 20  # several parts of a small model (S3's minimum)
    from keras_hub_dist.storage import s3_writer

    uploaded = []
    started = itertools.count()  # parts upload concurrently: count the calls
    real = s3_writer.S3Writer.upload_part

    def counting(self, name, upload_id, number, data):
        if mode == "fail_part" and jax.process_index() == 1 and next(started) == 1:
            raise keras_hub_dist.SaveError("injected by the test")
        token = real(self, name, upload_id, number, data)
        uploaded.append((name, number, memoryview(data).nbytes))
        return token

    s3_writer.S3Writer.upload_part = counting
    combined = []
    real_combine = part_uploads.PartUploads.combine

    def counting_combine(self, path, number, reduce):
        combined.append(number)
        return real_combine(self, path, number, reduce)

    part_uploads.PartUploads.combine = counting_combine
    batch, model_axis = (int(x) for x in mesh_arg.split("x"))
    model = keras_hub_dist.load_sharded_preset(preset, mesh=(batch, model_axis), progress=False)

    # Device bytes beyond the model's, read at the event: right after a
    # slice's sum, while its inputs and output are both live.
    from keras_hub_dist import _processes
    from keras_hub_dist.measure.memory import live_bytes_per_device

    held = live_bytes_per_device(devices=jax.local_devices())
    combine_extra = []
    real_summer = _processes._word_summer

    def watched_summer(*args):
        mesh, summer = real_summer(*args)

        def run(words):
            out = jax.block_until_ready(summer(words))
            live = live_bytes_per_device(devices=jax.local_devices())
            combine_extra.append(max(live[d] - held[d] for d in live))
            return out

        return mesh, run

    _processes._word_summer = watched_summer
    error = None
    try:
        keras_hub_dist.save_sharded_preset(model, url)
    except keras_hub_dist.SaveError as e:
        error = str(e)
    if mode != "fail_part":
        keras_hub_dist.save_sharded_preset(model, os.path.join(out_dir, "local"))
    report = {"process_index": jax.process_index(), "uploaded": list(uploaded), "combined": list(combined),
              "error": error, "combine_extra": max(combine_extra, default=0)}
    if mode == "hf":
        del uploaded[:], combined[:]
        keras_hub_dist.save_sharded_preset(model, url.rstrip("/") + "-hf", format="huggingface")
        keras_hub_dist.save_sharded_preset(model, os.path.join(out_dir, "local_hf"), format="huggingface")
        report.update(uploaded_hf=uploaded, combined_hf=combined)
    with open(os.path.join(out_dir, f"process_{process_id}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
