"""Benchmark: does a save into S3 (issue 30), and a load from it (issue
20), go faster with two processes, each with its own network link?

On this 2-core machine the CPU, not the network, bounds a loopback transfer,
so two processes cannot show their scaling against an open server. Here each
client address gets its own link instead: the test server
(`tests/remote/servers.py`, a proxy in front of moto, in a process of its
own) caps every client address at `--rate` bytes/s, both ways, and each
process of the job binds its own address (`KERAS_HUB_DIST_SOURCE_ADDRESS`:
127.0.0.2, 127.0.0.3). What it stands for: hosts of a pod, each with its
NIC, saving to / loading from a bucket whose bandwidth is not the limit.

Cases, each a fresh job (1 process x 8 simulated devices, or 2 processes x
4 over loopback with gloo), timing only the save or the load (the medians
of `--repeats`):

- `save1` / `save2`: the probe loaded from local disk on mesh (1, 8), then
  `save_sharded_preset(model, "s3://bench/...")`;
- `load1` / `load2` / `load2m`: `load_sharded_preset("s3://bench/probe",
  mesh=...)`, mesh (1, 8) for one process; for two, (2, 4) (`load2`: the
  batch axis across the processes, each holds a whole replica, reads half
  and gets the other half from the other process over gloo, issue 20) and
  (1, 8) (`load2m`: the model axis across the processes, each reads and
  holds only its half).

With `--memory`, one more `save1` and `save2` each run with the memory
sampler (every 2 ms, and a sample when the save returns) and report the
per-device peak over the bytes the devices held before the save, the
largest over the processes.

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_remote_scaling.py --config small --rate 20e6 --memory
    # The load where the link, not the 2 cores two JAX processes share, is the bottleneck:
    flock /tmp/khd-heavy.lock python benchmarks/bench_remote_scaling.py --config small --rate 2e6 --cases load
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path[:0] = [BENCH, REPO, os.path.join(REPO, "tests")]
from bench_load import RESULT_TAG, _env  # noqa: E402
from bench_remote_save import CONFIGS, _empty_bucket, _s3_client, probe  # noqa: E402


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker(args) -> None:
    os.environ["KERAS_HUB_DIST_SOURCE_ADDRESS"] = f"127.0.0.{2 + args.pid}"
    os.environ.update(AWS_ENDPOINT_URL=args.endpoint, AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    if args.nproc > 1:
        from multiprocess_jobs import join_job

        join_job(args.pid, args.nproc, args.port, 8 // args.nproc)
    import jax

    import keras_hub_dist
    from keras_hub_dist import _processes

    if args.case.startswith("save"):
        model = keras_hub_dist.load_sharded_preset(args.preset, mesh=(1, 8), progress=False)
        jax.block_until_ready([v.value for v in model.weights])
        sampler = None
        if args.memory:
            from keras_hub_dist.measure import memory

            sampler = memory.MemorySampler(interval_s=0.002).__enter__()
        _processes.check_all(None, RuntimeError, "ready")  # start together
        start = time.perf_counter()
        keras_hub_dist.save_sharded_preset(model, f"s3://bench/{args.case}-{args.run}")
        if sampler is not None:
            sampler.sample()
            sampler.__exit__(None, None, None)
            # Saving adds nothing that stays: peak over what the devices held.
            held = sampler.start_per_device
            peak_over_held = max(p / held[d] for d, p in sampler.peak_per_device.items() if held.get(d))
    else:
        _processes.check_all(None, RuntimeError, "ready")
        start = time.perf_counter()
        model = keras_hub_dist.load_sharded_preset(
            "s3://bench/probe", mesh=(2, 4) if args.case == "load2" else (1, 8), progress=False)
        jax.block_until_ready([v.value for v in model.weights])
    wall = time.perf_counter() - start
    walls = _processes.gather_strings(f"{wall}")
    result = {"wall_s": max(float(w) for w in walls)}
    if args.case.startswith("save") and args.memory:
        peaks = _processes.gather_strings(f"{peak_over_held}")
        result["device_peak_over_held"] = max(float(p) for p in peaks)
    if jax.process_index() == 0:
        sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
        sys.stdout.flush()
    os._exit(0)


def run_job(args, case: str, nproc: int, endpoint: str, preset: str, run: int, memory: bool = False) -> dict:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", "--case", case, "--pid", str(i), "--nproc", str(nproc),
             "--port", str(port), "--endpoint", endpoint, "--preset", preset, "--run", str(run),
             *(["--memory"] if memory else [])],
            env=_env() | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // nproc}"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(nproc)
    ]
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (out, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"{case}: a process failed ({p.returncode}):\n{err[-3000:]}")
    line = next(line for line in outs[0][0].splitlines() if line.startswith(RESULT_TAG))
    return json.loads(line[len(RESULT_TAG):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--rate", type=float, default=20e6, help="bytes/s per client address")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/work/bench_tmp/bench_remote_scaling")
    parser.add_argument("--cases", default="save,load", help="save, load or both (comma-separated)")
    parser.add_argument("--memory", action="store_true",
                        help="also one save per job size with the memory sampler (per-device peak / held)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("case", "endpoint", "preset"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    for name in ("pid", "nproc", "port", "run"):
        parser.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    preset = probe(args.workdir, args.config)
    moto = subprocess.Popen([sys.executable, os.path.join(BENCH, "bench_remote_save.py"), "--serve"],
                            env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    upstream = moto.stdout.readline().strip()
    client = _s3_client(upstream)
    for root, _, names in os.walk(preset):  # the load's checkpoint, straight into moto
        for name in names:
            client.upload_file(os.path.join(root, name), "bench", f"probe/{os.path.relpath(os.path.join(root, name), preset)}")
    proxy = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "remote", "servers.py"), "--upstream", upstream,
         "--flavor", "s3", "--rate-per-address", str(args.rate)],
        env=_env(), stdout=subprocess.PIPE, text=True)
    endpoint = json.loads(proxy.stdout.readline())["endpoint"]
    walls: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    try:
        run = 0
        for _ in range(args.repeats):
            for case, nproc in (("save1", 1), ("save2", 2), ("load1", 1), ("load2", 2), ("load2m", 2)):
                if case[:4] not in args.cases.split(","):
                    continue
                run += 1
                walls.setdefault(case, []).append(run_job(args, case, nproc, endpoint, preset, run)["wall_s"])
                print(case, f"{walls[case][-1]:.2f} s", flush=True)
                _empty_bucket(upstream, prefix=case)  # moto keeps objects in memory
        if args.memory and "save" in args.cases.split(","):
            for case, nproc in (("save1", 1), ("save2", 2)):
                run += 1
                peaks[case] = run_job(args, case, nproc, endpoint, preset, run, memory=True)["device_peak_over_held"]
                _empty_bucket(upstream, prefix=case)
    finally:
        proxy.terminate()
        proxy.wait(30)
        moto.stdin.close()
        moto.wait(30)
    shutil.rmtree(args.workdir, ignore_errors=True)
    median = {c: sorted(w)[len(w) // 2] for c, w in walls.items()}
    print(f"\nconfig {args.config}, {args.rate / 1e6:.0f} MB/s per client address, medians of {args.repeats}")
    for what, two_case in (("save", "save2"), ("load (2, 4)", "load2"), ("load (1, 8)", "load2m")):
        if two_case not in median:
            continue
        one, two = median[f"{what[:4]}1"], median[two_case]
        print(f"{what}: 1 process {one:.2f} s, 2 processes {two:.2f} s: {two / one:.2f}x")
    for case, peak in peaks.items():
        print(f"{case} (a run of its own, sampled every 2 ms): per-device peak / held {peak:.3f}, "
              "the largest over the processes")


if __name__ == "__main__":
    main()
