"""One process of a 2-process job that loses process 1 mid-operation
(driven by tests/remote/test_lost_process.py and
benchmarks/bench_lost_host.py).

Usage: python lost_process_worker.py PROCESS_ID NUM_PROCESSES PORT
           LOCAL_DEVICES PRESET PHASE TARGET OUT_DIR [HEARTBEAT_S] [VICTIM]
           [KILL_AT]

Joins the job with `keras_hub_dist.initialize` (heartbeat HEARTBEAT_S,
default 5; 0: `jax.distributed.initialize` with JAX's defaults, the setup
before issue 40) and runs PHASE: `load` (PRESET on the mesh (1, 8)); after
loading PRESET so: `save` (into the directory
TARGET), `s3` (into the URL TARGET), `restore` (the weights-only Orbax
checkpoint TARGET). Process
VICTIM (default 1) stops at a known point of that phase (its third variable
read, third positioned write, first part upload, first checkpoint read),
writes OUT_DIR/ready.json (its pid and the time) and waits to be SIGKILLed.
With KILL_AT ("OPERATION.EVENT:K", the package's test hook
`KERAS_HUB_DIST_TEST_KILL_AT`, set on the victim alone) the victim instead
SIGKILLs itself at that event; PHASE may then also be `hf` (a save in the
Hugging Face format), `convert` (PRESET converted to TARGET),
`adapter-save` (LoRA factors of PRESET saved to TARGET), `adapter-load`
(PRESET, an HF checkpoint, loaded with the adapter TARGET), `stuck-native`
/ `stuck-python` (a load-like operation whose survivor waits where the
package does not watch: in JAX's key-value store, in a Python loop).
The survivor writes OUT_DIR/process_<id>.json when the operation raises
(the time, the error's classes and message, its `lost` and `phase`) and
lets the error end the process, as a user's script would.
"""

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.multiprocess_jobs import UNSUPPORTED, simulate_cpu_devices  # noqa: E402


def main() -> None:
    process_id, num_processes, port, local_devices = map(int, sys.argv[1:5])
    preset, phase, target, out_dir = sys.argv[5:9]
    heartbeat = int(sys.argv[9]) if len(sys.argv) > 9 else 5
    victim = int(sys.argv[10]) if len(sys.argv) > 10 else 1
    kill_at = sys.argv[11] if len(sys.argv) > 11 else ""
    if kill_at and process_id == victim:
        os.environ["KERAS_HUB_DIST_TEST_KILL_AT"] = kill_at
    simulate_cpu_devices(local_devices)
    import keras_hub_dist

    try:
        if heartbeat:
            keras_hub_dist.initialize(f"127.0.0.1:{port}", num_processes, process_id,
                                      heartbeat_timeout_s=heartbeat, initialization_timeout_s=120)
        else:
            import jax

            jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    except Exception as error:  # noqa: BLE001 - reported to the test as a skip
        print(f"cannot start a multi-process JAX job here: {error!r}", file=sys.stderr)
        sys.exit(UNSUPPORTED)
    out = pathlib.Path(out_dir)
    import faulthandler
    import signal

    stacks = open(out / f"stacks_{process_id}.txt", "w")  # SIGUSR1: every thread's stack, for a hang
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    def stop_here():
        (out / "ready.tmp").write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
        os.replace(out / "ready.tmp", out / "ready.json")
        time.sleep(600)  # until killed

    def stop_at(owner, name, call):
        real, calls = getattr(owner, name), []

        def stopping(*args, **kwargs):
            calls.append(1)
            if len(calls) == call and process_id == victim:
                stop_here()
            return real(*args, **kwargs)

        setattr(owner, name, stopping)

    if phase not in ("load", "convert", "adapter-load"):
        model = keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8), progress=False)
    if kill_at:  # the victim's test hook kills it: no stop points
        stop_at = lambda *_: None  # noqa: E731
    if phase == "load":
        from keras_hub_dist.load import execute

        stop_at(execute, "_host_blocks", 3)
        operation = lambda: keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8), progress=False)  # noqa: E731
    elif phase == "save":
        stop_at(os, "pwritev", 3)
        operation = lambda: keras_hub_dist.save_sharded_preset(model, target, progress=False)  # noqa: E731
    elif phase == "s3":
        from keras_hub_dist.formats import checksums
        from keras_hub_dist.storage import s3_writer

        checksums.CHUNK_BYTES = 5 << 20  # parts of S3's least size: each process uploads some

        stop_at(s3_writer.S3Writer, "upload_part", 1)
        operation = lambda: keras_hub_dist.save_sharded_preset(model, target, progress=False)  # noqa: E731
    elif phase == "restore":
        from keras_hub_dist.load import orbax_checkpoint

        stop_at(orbax_checkpoint, "read_arrays", 1)
        operation = lambda: keras_hub_dist.restore_checkpoint(model, target, progress=False)  # noqa: E731
    elif phase == "hf":
        operation = lambda: keras_hub_dist.save_sharded_preset(  # noqa: E731
            model, target, format="huggingface", progress=False)
    elif phase == "convert":
        operation = lambda: keras_hub_dist.convert_checkpoint(  # noqa: E731
            preset, target, to="huggingface", progress=False)
    elif phase == "adapter-save":
        model.enable_lora(2)
        operation = lambda: keras_hub_dist.save_lora_adapter(model, target, progress=False)  # noqa: E731
    elif phase == "adapter-load":
        operation = lambda: keras_hub_dist.load_sharded_preset(  # noqa: E731
            preset, mesh=(1, 8), lora_adapter=target, progress=False)
    elif phase in ("stuck-native", "stuck-python"):
        from keras_hub_dist import PresetError, _compat, _processes

        def stuck():
            _processes.check_all(None, PresetError, "Agreeing")  # load.step:1
            _processes.reached("step")  # load.step:2: the victim dies once both agreed
            if phase == "stuck-native":
                _compat.distributed_client().blocking_key_value_get("never set", 120_000)
            while True:
                time.sleep(0.05)

        operation = _processes.raises_process_lost(PresetError, "the load", _processes.LOAD_LEFT)(stuck)
    else:
        sys.exit(f"unknown phase {phase!r}")
    try:
        operation()
    except Exception as error:
        report = {
            "caught": time.time(),
            "classes": [c.__name__ for c in type(error).__mro__],
            "message": str(error),
            "lost": list(getattr(error, "lost", ())),
            "phase": getattr(error, "phase", None),
        }
        (out / f"process_{process_id}.json").write_text(json.dumps(report))
        raise
    (out / f"process_{process_id}.json").write_text(json.dumps({"caught": None}))


if __name__ == "__main__":
    main()
