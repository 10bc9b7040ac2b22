"""Runs a `jax.distributed` job of several local processes (loopback, gloo),
for the multi-process load and save tests."""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests import worker_zygote

TIME_LIMIT_S = 240
# A worker exits with this when the platform cannot run a multi-process job.
UNSUPPORTED = 77


_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S+")


def child_env(**extra):
    """The environment for a test's subprocess that sets its own device
    count: this one's, with the test flags of XLA_FLAGS (tests/conftest.py)
    kept and the device count dropped."""
    env = dict(os.environ, **extra)
    env["XLA_FLAGS"] = _DEVICE_COUNT.sub("", env.get("XLA_FLAGS", "")).strip()
    return env


def command_env():
    """`child_env()` for a command the test runs whole (the validation
    command and the case processes it starts), with TensorFlow hidden from
    every one of its processes (tests/without_tensorflow/sitecustomize.py)."""
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "without_tensorflow")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    return env


def simulate_cpu_devices(local_devices):
    """In a worker, before anything imports JAX: `local_devices` simulated
    CPU devices and the JAX backend of Keras, TensorFlow hidden, and JAX
    imported with the suite's compilation cache writing each entry
    atomically (tests/compile_cache.py: a worker killed mid-write, as
    tests/save/killed_save_worker.py is, leaves no half entry behind).

    `import keras_hub` imports TensorFlow and tensorflow_text when they are
    installed (for its tf.data preprocessing): 3.2 of the 6.2 CPU-seconds a
    worker spends importing, for ~40 workers a run. No worker runs a
    preprocessor; KerasHub takes the hidden TensorFlow as not installed, as
    on a machine without it (the test processes themselves keep it)."""
    flags = _DEVICE_COUNT.sub("", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_devices}".strip()
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.modules.setdefault("tensorflow", None)  # `import tensorflow` raises ImportError
    # Keras imports matplotlib.pyplot when it is installed (0.6-0.9 s a start).
    sys.modules.setdefault("matplotlib", None)

    from tests.compile_cache import write_entries_atomically

    write_entries_atomically()


def join_job(process_id, num_processes, port, local_devices):
    """In a worker, before anything imports JAX: simulate `local_devices` CPU
    devices and join the job over loopback (gloo). Exits with `UNSUPPORTED`
    when the platform cannot run a multi-process JAX job."""
    simulate_cpu_devices(local_devices)
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=120,
        )
    except Exception as error:  # noqa: BLE001 - reported to the test as a skip
        print(f"cannot start a multi-process JAX job here: {error!r}", file=sys.stderr)
        sys.exit(UNSUPPORTED)


def leave() -> None:
    """In a worker whose script returned (tests/worker_zygote.py calls it for
    every worker): run the `atexit` handlers (JAX's distributed shutdown,
    logging's flush), flush the standard streams and exit 0 without the
    interpreter's teardown. That teardown garbage-collects and frees every
    object of JAX, Keras and KerasHub, ~3.6 s of a core per process, after
    the report is written: a job's processes each paid it before the test
    could go on. An exception or `sys.exit` in the script still leaves as a
    fresh interpreter would."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_job(worker, num_processes, local_devices, args, out_dir):
    """Runs `worker PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES *args` per
    process; returns each process's `out_dir/process_<id>.json`."""
    port = free_port()
    env = child_env()
    procs = [
        worker_zygote.spawn(
            [sys.executable, str(worker), str(i), str(num_processes), str(port),
             str(local_devices), *map(str, args)],
            env=env,
        )
        for i in range(num_processes)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIME_LIMIT_S))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {num_processes}-process job did not finish in {TIME_LIMIT_S} s")
    finally:
        for proc in procs:  # never leave a process behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if UNSUPPORTED in codes:
        pytest.skip(outputs[codes.index(UNSUPPORTED)][1].strip().splitlines()[-1])
    # Every process's end: a job stuck in a collective shows where each was.
    assert codes == [0] * num_processes, "\n".join(
        f"--- process {i} exited {code}:\n{err[-2500:]}" for i, (code, (_, err)) in enumerate(zip(codes, outputs))
    )
    return [
        json.loads((out_dir / f"process_{i}.json").read_text())
        for i in range(num_processes)
    ]


def digest(folder):
    """`{file name: sha256}` of a folder's files."""
    return {
        name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
        for name in sorted(os.listdir(folder))
    }


def run_save_jobs(worker, preset, root, jobs, save_format="keras", existing=()):
    """Runs each job `{mesh: [mode, ...]}` of the save worker
    (tests/save/multiprocess_save_worker.py): 2 processes x 4 devices load
    `preset` on `mesh` once, then save into `root/<mesh>_<mode>/saved` in
    order (each process starts Python, JAX, Keras and KerasHub once per job,
    not once per save). The saves whose mode is in `existing` overwrite a
    copy of `preset`. Returns `{(mesh, mode): (parent, reports, digest
    before)}`, per process its `held` blocks with that save's `writes`,
    `fsynced` and `error`."""
    out = {}
    for mesh, saves in jobs.items():
        spec = []
        for mode in saves:
            parent = root / f"{mesh}_{mode}"
            parent.mkdir()
            target = parent / "saved"
            before = None
            if mode in existing:
                shutil.copytree(preset, target)  # an existing preset, to be overwritten
                before = digest(target)
            spec.append({"target": str(target), "mode": mode, "format": save_format})
            out[mesh, mode] = [parent, None, before]
        reports_dir = root / f"{mesh}_reports"
        reports_dir.mkdir()
        reports = run_job(worker, 2, 4, [preset, mesh, reports_dir, json.dumps(spec)], reports_dir)
        for mode in saves:
            out[mesh, mode][1] = [{"held": r["held"], **r["saves"][mode]} for r in reports]
    return {key: tuple(value) for key, value in out.items()}


def merge_ranges(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def block_byte_ranges(dataset, block):
    """File byte ranges of a row-major block of a contiguous dataset."""
    shape, itemsize = dataset.shape, dataset.dtype.itemsize
    flat = np.arange(int(np.prod(shape)) or 1).reshape(shape or ())
    elements = flat[tuple(slice(a, b) for a, b in block)].reshape(-1)
    return merge_ranges((dataset.offset + e * itemsize, dataset.offset + (e + 1) * itemsize)
                  for e in elements)


def lost_process_presets(root):
    """The presets of the lost-process jobs (tests/remote/test_lost_process.py,
    benchmarks/bench_lost_host.py), written under `root`: a tiny Llama with
    its tokenizer, and a one-block Llama 3 of over 20 MiB (S3 parts of
    5 MiB, some uploaded by each process). Returns their paths."""
    import keras_hub

    from keras_hub_dist import write_synthetic_preset

    tiny = write_synthetic_preset(
        str(root / "tiny"), keras_hub.models.LlamaBackbone, dtype="float32", tokenizer=True, seed=3,
        vocabulary_size=256, num_layers=2, num_query_heads=8, num_key_value_heads=8, hidden_dim=64,
        intermediate_dim=128)
    parts = write_synthetic_preset(
        str(root / "parts"), keras_hub.models.Llama3Backbone, dtype="float32", seed=7,
        vocabulary_size=40_000, num_layers=1, num_query_heads=8, num_key_value_heads=8, hidden_dim=128,
        intermediate_dim=256)
    return tiny, parts


def weights_only_checkpoint(root, preset):
    """A weights-only Orbax checkpoint of `preset` in `root/checkpoint`,
    written by `keras.callbacks.OrbaxCheckpoint` as at the end of an epoch
    (no fit), for the lost-process restores. Returns its path."""
    import keras

    import keras_hub_dist

    directory = root / "checkpoint"
    keras.distribution.set_distribution(None)
    backbone = keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8), progress=False)
    backbone.compile(optimizer=keras.optimizers.SGD())  # its state is not saved (weights only)
    callback = keras.callbacks.OrbaxCheckpoint(str(directory), save_weights_only=True, save_on_background=False)
    callback.set_model(backbone)
    callback.on_epoch_end(0)
    callback.on_train_end()
    keras.distribution.set_distribution(None)
    return str(directory)


def run_lost_process_job(worker, args, out_dir, victim=1, heartbeat_s=5, limit_s=TIME_LIMIT_S, kill_at=""):
    """Runs the 2-process x 4-device job of `worker`
    (tests/remote/lost_process_worker.py) with `args` (PRESET PHASE TARGET),
    SIGKILLs process `victim` once it writes `out_dir/ready.json` (at its
    phase's known point) and waits for the survivor to end. Returns the
    figures at the events: `kill_to_error_s` (the SIGKILL to the survivor
    catching its error, by its own clock), `kill_to_exit_s`, the survivor's
    `exit` status, its report (`process_<id>.json`) and stderr.

    With `kill_at` ("OPERATION.EVENT:K"), the victim's test hook
    (`KERAS_HUB_DIST_TEST_KILL_AT`) kills it at that event instead: the
    kill's time is the one the hook writes on its stderr; `reached` is
    False (and the times None) when the victim finished without reaching
    it."""
    import time

    port = free_port()
    procs = [
        worker_zygote.spawn(
            [sys.executable, str(worker), str(i), "2", str(port), "4", *map(str, args), str(out_dir),
             str(heartbeat_s), str(victim), kill_at],
            env=child_env(),
        )
        for i in range(2)
    ]
    survivor = procs[1 - victim]
    ready = out_dir / "ready.json"
    try:
        deadline = time.monotonic() + limit_s
        if kill_at:
            return _await_kill_at(procs, victim, out_dir, deadline, limit_s)
        while not ready.exists():  # the victim writes it, then waits to be killed
            if any(p.poll() is not None for p in procs):
                codes = [p.poll() for p in procs]
                errs = [p.stderr.read()[-3000:] if p.poll() is not None else "" for p in procs]
                if UNSUPPORTED in codes:
                    pytest.skip(errs[codes.index(UNSUPPORTED)].strip().splitlines()[-1])
                pytest.fail(f"a process ended before the kill point: {codes}\n" + "\n---\n".join(errs))
            if time.monotonic() > deadline:
                pytest.fail(f"the kill point was not reached in {limit_s} s")
            time.sleep(0.02)
        os.kill(json.loads(ready.read_text())["pid"], signal.SIGKILL)
        killed = time.time()
        try:
            _, err = survivor.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the survivor did not exit within {limit_s} s of the kill")
        exited = time.time()
    finally:
        for proc in procs:  # never leave a process behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report_path = out_dir / f"process_{1 - victim}.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    caught = report.get("caught")
    return {
        "kill_to_error_s": None if caught is None else caught - killed,
        "kill_to_exit_s": exited - killed,
        "exit": survivor.returncode,
        "report": report,
        "stderr": err,
    }


def _await_kill_at(procs, victim, out_dir, deadline, limit_s):
    """`run_lost_process_job`'s end when the victim's test hook kills it."""
    import time

    victim_proc, survivor = procs[victim], procs[1 - victim]
    try:
        victim_proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the victim neither reached its kill point nor ended in {limit_s} s")
    hook = re.search(r"test hook: SIGKILL at \S+ t=([\d.]+)", victim_proc.stderr.read())
    if hook is None:  # it finished (or failed) without reaching the event
        survivor.wait(timeout=limit_s)
        return {"reached": False, "exit": survivor.returncode, "victim_exit": victim_proc.returncode,
                "kill_to_error_s": None, "kill_to_exit_s": None, "report": {}, "stderr": survivor.stderr.read()}
    killed = float(hook.group(1))
    try:
        _, err = survivor.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the survivor did not exit within {limit_s} s of the kill")
    exited = time.time()
    path = out_dir / f"process_{1 - victim}.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    caught = report.get("caught")
    return {
        "reached": True,
        "kill_to_error_s": None if caught is None else caught - killed,
        "kill_to_exit_s": exited - killed,
        "exit": survivor.returncode,
        "report": report,
        "stderr": err,
    }


def lost_process_hf_and_adapter(root):
    """For the lost-process jobs of the Hugging Face format: a tiny Llama 3
    preset (`root/tiny3`, 2 blocks, width 64), it saved in the Hugging Face
    format (`root/tiny_hf`), and a LoRA adapter of it (rank 2, nonzero
    factors, `root/adapter`). Returns their paths."""
    import keras
    import keras_hub
    import numpy as np

    import keras_hub_dist

    tiny = keras_hub_dist.write_synthetic_preset(
        str(root / "tiny3"), keras_hub.models.Llama3Backbone, dtype="float32", seed=5,
        vocabulary_size=256, num_layers=2, num_query_heads=8, num_key_value_heads=8, hidden_dim=64,
        intermediate_dim=128)
    keras.distribution.set_distribution(None)
    model = keras_hub_dist.load_sharded_preset(tiny, mesh=(1, 8), progress=False)
    keras_hub_dist.save_sharded_preset(model, str(root / "tiny_hf"), format="huggingface", progress=False)
    model.enable_lora(2)
    for variable in model.trainable_variables:
        variable.assign(np.full(variable.shape, 0.01, variable.dtype))
    keras_hub_dist.save_lora_adapter(model, str(root / "adapter"), progress=False)
    keras.distribution.set_distribution(None)
    return tiny, str(root / "tiny_hf"), str(root / "adapter")
