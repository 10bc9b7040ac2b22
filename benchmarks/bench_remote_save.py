"""Benchmark: saving into object storage (issue 30): ours straight into S3
vs the path a user takes today (save locally, then upload the files with
boto3's transfer manager) vs the store's own floor (the same bytes uploaded
from memory).

`--format huggingface` exports the Hugging Face format instead (ours into
the bucket, theirs into a local directory then uploaded). Side by side in one run, each case in a fresh subprocess on 8 simulated CPU
devices, mesh (1, 8), the probe loaded with `load_sharded_preset` first (not
timed). The store is moto's S3 server on loopback, in a process of its own
(so it shares no GIL with the client; it keeps objects in memory):

- `ours`: `save_sharded_preset(model, "s3://bench/ours-N")`;
- `local_upload`: `save_sharded_preset(model, LOCAL_DIR)` then, per file,
  boto3's `upload_file` (`TransferConfig`: 64 MiB parts, 10 threads), the
  local directory removed after (its bytes count as written to disk);
- `floor`: boto3's `upload_fileobj` of one in-memory buffer of the weights'
  size (64 MiB parts, 10 threads): what the store ingests at best.

With `--link-rate` the cases reach moto through the project's throttled
server (`tests/remote/servers.py`, a proxy in a process of its own) that
caps each client address at that many bytes/s, both ways, with `--latency`
before each response: the network, not this machine's CPU or moto's ingest,
is then what bounds an upload. With `--disk-rate` (root, cgroup v1 `blkio`)
the `local_upload` case runs in a cgroup whose writes to the work
directory's disk are capped at that rate, and its local save is
`durable=True`, so its bytes reach the disk before the upload starts; the
kernel's writeback is held off meanwhile (`vm.dirty_*`, restored after), so
every byte is written by that fsync, at the capped rate (cgroup v1 throttles
a process's own writes, not the flusher's). Without the fsync a 3.8 GB
preset stays in this 24 GB machine's page cache; on a host saving a share
larger than its dirty-page limit (20% of RAM by default) the kernel holds
the writer to the disk's rate the same way. What
`--link-rate R --disk-rate R` stands for: a host whose local disk writes no
faster than its link to the bucket (a TPU VM's network-attached boot disk
is slower than its NIC): the local path pays the disk and the link one after
the other, ours only the link.

Measured per case: wall of the save (or save + upload), CPU seconds, host
RSS growth (peak during the case over the RSS after the load), bytes the
process wrote to disk (`write_bytes` of /proc/self/io), bytes uploaded; with
`--memory` also per-device peak / final (the `MemorySampler`, every 2 ms).
For `ours`, where the time went: when the first part started, the parts'
window (first start to last end), the share of it with no part in flight,
the parts' rate over it, and the seconds of CompleteMultipartUpload (moto
joins the parts in memory: ~35 s for 3.8 GB, which the
boto3 upload of `local_upload` pays too).
For `local_upload`, the seconds of the local save.

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_remote_save.py --config width1 --repeats 3
    flock /tmp/khd-heavy.lock python benchmarks/bench_remote_save.py --config width1 --format huggingface \
        --cases ours,local_upload --repeats 1 --memory          # the Hugging Face export
    python benchmarks/bench_remote_save.py --config small --repeats 1   # smoke run
    flock /tmp/khd-heavy.lock python benchmarks/bench_remote_save.py --config small --cases ours,local_upload \
        --link-rate 20e6 --latency 0.02 --disk-rate 20e6 --repeats 3   # a link and a disk of 20 MB/s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path[:0] = [BENCH, REPO, os.path.join(REPO, "tests")]
from bench_load import CONFIGS, RESULT_TAG, _env, run_capped  # noqa: E402

CONFIGS = {
    **CONFIGS,
    # A smoke-run size: Gemma-7B's width cut to 1/8 (two 5 MiB parts).
    "small": dict(architecture="gemma_7b_en", dtype="float32",
                  overrides=dict(num_layers=1, vocabulary_size=8192, intermediate_dim=3072)),
}
CASES = ("ours", "local_upload", "floor")
PART_BYTES = 64 << 20


def _disk_written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))


def _serve() -> None:
    """The moto server (a process of its own): prints its endpoint, stops on EOF."""
    from remote.stores import MotoS3

    with MotoS3() as server:
        server.client().create_bucket(Bucket="bench")
        print(server.endpoint, flush=True)
        sys.stdin.read()


def _s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def probe(workdir: str, config_name: str) -> str:
    """The probe preset of `config_name` under `workdir`, written once."""
    import keras_hub_dist

    os.makedirs(workdir, exist_ok=True)
    config = CONFIGS[config_name]
    preset = os.path.join(workdir, f"probe-{config_name}")
    if not os.path.exists(os.path.join(preset, "config.json")):
        keras_hub_dist.write_synthetic_preset(preset, config["architecture"], dtype=config["dtype"],
                                              progress=False, **config["overrides"])
    return preset


def _empty_bucket(endpoint: str, prefix: str = "") -> None:
    client = _s3_client(endpoint)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket="bench", Delete={"Objects": keys})


def run_case(args) -> None:
    import resource

    import jax

    import keras_hub_dist
    from keras_hub_dist.measure import memory

    os.environ.update(AWS_ENDPOINT_URL=args.endpoint, AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    durable = False
    if args.cgroup and args.case == "local_upload":
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        durable = True
    model = None
    if args.case != "floor":
        model = keras_hub_dist.load_sharded_preset(args.preset, mesh=(1, 8), progress=False)
        jax.block_until_ready([v.value for v in model.weights])
    weights = sum(os.path.getsize(os.path.join(args.preset, f)) for f in os.listdir(args.preset)
                  if f.endswith(".h5"))
    buffer = bytearray(weights) if args.case == "floor" else None
    sampler = memory.MemorySampler(interval_s=0.002) if args.memory and model is not None else None
    memory.reset_host_peak_rss()
    rss0 = memory.current_rss_bytes()
    disk0 = _disk_written()
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if sampler is not None:
        sampler.__enter__()
    phases: dict = {}
    if args.case == "ours":
        with _timed_requests(phases):
            keras_hub_dist.save_sharded_preset(model, f"s3://bench/ours-{args.run}", format=args.format)
    elif args.case == "local_upload":
        from boto3.s3.transfer import TransferConfig

        local = os.path.join(args.workdir, f"local-{args.run}")
        keras_hub_dist.save_sharded_preset(model, local, format=args.format, durable=durable)
        phases["local_save_s"] = time.perf_counter() - start
        client = _s3_client(args.endpoint)
        config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=10)
        for root, _, names in os.walk(local):
            for name in names:
                path = os.path.join(root, name)
                client.upload_file(path, "bench", f"theirs-{args.run}/{os.path.relpath(path, local)}", Config=config)
        shutil.rmtree(local)
    else:
        import io

        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=10)
        _s3_client(args.endpoint).upload_fileobj(io.BytesIO(buffer), "bench", f"floor-{args.run}", Config=config)
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime,
        "weights_bytes": weights,
        "model_bytes": sum(v.value.nbytes for v in model.weights) if model is not None else weights,
        "rss_growth": max(memory.host_peak_rss_bytes(), memory.current_rss_bytes()) - rss0,
        "disk_written": _disk_written() - disk0,
        **_phase_summary(phases, start, start + wall),
    }
    if sampler is not None:
        sampler.sample()
        sampler.__exit__(None, None, None)
        start_per_device = sampler.start_per_device
        peaks = {d: p - start_per_device.get(d, 0) for d, p in sampler.peak_per_device.items()}
        finals = {d: f - start_per_device.get(d, 0) for d, f in sampler.final_per_device.items()}
        # Saving adds nothing that stays: peak over what the devices held.
        held = {d: start_per_device.get(d, 0) for d in peaks}
        result["device_peak_over_held"] = max((held[d] + peaks[d]) / held[d] for d in peaks if held[d])
        result["device_final_change"] = max(abs(f) for f in finals.values())
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)


@contextlib.contextmanager
def _timed_requests(phases: dict):
    """Records when each part upload and each completion of our S3 writer
    ran (`phases["parts"]`: (start, end, bytes); `phases["completes"]`:
    (start, end)): where a save's time goes, the link or the store."""
    from keras_hub_dist.storage import s3_writer

    parts, completes = phases.setdefault("parts", []), phases.setdefault("completes", [])
    upload_part, complete_upload = s3_writer.S3Writer.upload_part, s3_writer.S3Writer.complete_upload

    def timed_part(self, name, upload_id, number, data):
        t0 = time.perf_counter()
        token = upload_part(self, name, upload_id, number, data)
        parts.append((t0, time.perf_counter(), memoryview(data).nbytes))
        return token

    def timed_complete(self, name, upload_id, parts_list):
        t0 = time.perf_counter()
        complete_upload(self, name, upload_id, parts_list)
        completes.append((t0, time.perf_counter()))

    s3_writer.S3Writer.upload_part, s3_writer.S3Writer.complete_upload = timed_part, timed_complete
    try:
        yield
    finally:
        s3_writer.S3Writer.upload_part, s3_writer.S3Writer.complete_upload = upload_part, complete_upload


def _phase_summary(phases: dict, start: float, stop: float) -> dict:
    """From `_timed_requests`: seconds to the first part, the window from the
    first part's start to the last part's end, the share of that window with
    no part in flight (the link idle), the parts' rate over the window, and
    the seconds from the last part's end to the save's end, the completions'
    seconds."""
    out = {k: v for k, v in phases.items() if k not in ("parts", "completes")}
    parts = sorted(phases.get("parts", []))
    if parts:
        first, last = parts[0][0], max(end for _, end, _ in parts)
        idle, reach = 0.0, first
        for begin, end, _ in parts:
            idle += max(0.0, begin - reach)
            reach = max(reach, end)
        out.update(first_part_at_s=first - start, parts_window_s=last - first, link_idle_share=idle / (last - first),
                   parts_mb_per_s=sum(n for _, _, n in parts) / (last - first) / 1e6,
                   after_last_part_s=stop - last,
                   complete_s=sum(e - b for b, e in phases.get("completes", [])))
    return out


def _throttled_disk(workdir: str, rate: float) -> str:
    """A cgroup v1 `blkio` group whose writes to `workdir`'s disk are capped
    at `rate` bytes/s (its path; the caller removes it)."""
    root = "/sys/fs/cgroup/blkio"
    if os.geteuid() != 0 or not os.path.isdir(root):
        raise SystemExit(f"--disk-rate needs root and cgroup v1 blkio at {root}; received uid "
                         f"{os.geteuid()}, {root} {'present' if os.path.isdir(root) else 'absent'}")
    device = os.stat(workdir).st_dev
    group = os.path.join(root, f"keras_hub_dist_bench_{os.getpid()}")
    os.makedirs(group, exist_ok=True)
    with open(os.path.join(group, "blkio.throttle.write_bps_device"), "w") as f:
        f.write(f"{os.major(device)}:{os.minor(device)} {int(rate)}")
    return group


# The kernel's writeback, held off while `--disk-rate` runs: cgroup v1
# throttles only the writes a process issues itself (its fsync), not the
# flusher's, which by default writes back whatever passes 10% of RAM or 30 s
# of age. With these, the local save's bytes stay dirty until its fsync,
# which writes every one of them at the capped rate.
_HELD_WRITEBACK = {"dirty_background_ratio": "60", "dirty_ratio": "80", "dirty_expire_centisecs": "360000"}


@contextlib.contextmanager
def _writeback_held():
    saved = {}
    try:
        for name, value in _HELD_WRITEBACK.items():
            with open(f"/proc/sys/vm/{name}") as f:
                saved[name] = f.read().strip()
            with open(f"/proc/sys/vm/{name}", "w") as f:
                f.write(value)
        yield
    finally:
        for name, value in saved.items():
            with open(f"/proc/sys/vm/{name}", "w") as f:
                f.write(value)


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else sum(values[len(values) // 2 - 1:][:2]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="width1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="also a run of each save with the memory sampler")
    parser.add_argument("--format", choices=("keras", "huggingface"), default="keras")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    parser.add_argument("--workdir", default="/work/bench_tmp/bench_remote_save")
    parser.add_argument("--keep", action="store_true", help="keep the probe")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--link-rate", type=float, help="bytes/s per client address, through the throttled proxy")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each response (with --link-rate)")
    parser.add_argument("--disk-rate", type=float, help="bytes/s of local_upload's disk writes (root, cgroup v1)")
    parser.add_argument("--cgroup", help=argparse.SUPPRESS)
    parser.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return _serve()
    if args.case:
        return run_case(args)

    preset = probe(args.workdir, args.config)
    server = subprocess.Popen([sys.executable, __file__, "--serve"], env=_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    endpoint = upstream = server.stdout.readline().strip()
    proxy = group = None
    if args.link_rate:
        proxy = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "remote", "servers.py"), "--upstream", upstream,
             "--flavor", "s3", "--rate-per-address", str(args.link_rate), "--latency", str(args.latency)],
            env=_env(), stdout=subprocess.PIPE, text=True)
        endpoint = json.loads(proxy.stdout.readline())["endpoint"]
    extra = []
    if args.disk_rate:
        group = _throttled_disk(args.workdir, args.disk_rate)
        extra = ["--cgroup", group]
    cases = [c for c in args.cases.split(",") if c]
    results: dict[str, list[dict]] = {c: [] for c in cases}
    try:
        with _writeback_held() if args.disk_rate else contextlib.nullcontext():
            run = 0
            for repeat in range(args.repeats):
                for case in cases:
                    run += 1
                    command = [sys.executable, os.path.abspath(__file__), "--case", case, "--preset", preset,
                               "--endpoint", endpoint, "--workdir", args.workdir, "--run", str(run),
                               "--format", args.format, *extra]
                    result = run_capped(command, 0)
                    _empty_bucket(upstream)  # moto keeps objects in memory
                    results[case].append(result)
                    print(case, repeat, json.dumps({k: v for k, v in result.items() if k != "stderr_tail"}),
                          flush=True)
                    if result.get("failed"):
                        print(result.get("stderr_tail"), file=sys.stderr)
            if args.memory:
                for case in [c for c in ("ours", "local_upload") if c in cases]:
                    run += 1
                    command = [sys.executable, os.path.abspath(__file__), "--case", case, "--preset", preset,
                               "--endpoint", endpoint, "--workdir", args.workdir, "--run", str(run), "--memory",
                               "--format", args.format, *extra]
                    results[f"{case}_mem"] = [run_capped(command, 0)]
                    _empty_bucket(upstream)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        server.stdin.close()
        server.wait(30)
        if group is not None:
            os.rmdir(group)
        if not args.keep:
            shutil.rmtree(preset, ignore_errors=True)
    ok = {c: [r for r in rs if "wall_s" in r and not r.get("failed")] for c, rs in results.items()}
    wall = {c: _median([r["wall_s"] for r in rs]) for c, rs in ok.items() if rs}
    weights = ok["ours"][0]["weights_bytes"] if ok["ours"] else 0
    print(f"\nconfig {args.config}, format {args.format}: weights {weights / 1e9:.2f} GB, medians of {args.repeats}"
          + (f"; link {args.link_rate / 1e6:g} MB/s per client, latency {args.latency * 1e3:g} ms" if args.link_rate else "")
          + (f"; local_upload's disk {args.disk_rate / 1e6:g} MB/s, durable" if args.disk_rate else ""))
    print(f"{'case':<14}{'wall s':>9}{'vs ours':>9}{'MB/s':>8}{'cpu s':>8}{'RSS growth/model':>18}{'disk written':>14}")
    for case, rs in ok.items():
        if not rs or case.endswith("_mem"):
            continue
        w = wall[case]
        print(f"{case:<14}{w:>9.2f}{w / wall['ours']:>8.2f}x{weights / w / 1e6:>8.0f}"
              f"{_median([r['cpu_s'] for r in rs]):>8.1f}"
              f"{_median([r['rss_growth'] / r['model_bytes'] for r in rs]):>18.3f}"
              f"{_median([r['disk_written'] for r in rs]) / 1e6:>11.1f} MB")
    for case in ("ours_mem", "local_upload_mem"):
        for r in ok.get(case, []):
            print(f"{case}: device peak / held {r.get('device_peak_over_held', float('nan')):.3f}, "
                  f"final change {r.get('device_final_change', 0)} B")


if __name__ == "__main__":
    main()
