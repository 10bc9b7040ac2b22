"""Benchmark: remote checkpoints (issue 20): `load_sharded_preset("hf://...")`
vs one sequential download vs stock KerasHub's `hf://` path.

The probe (`--config width1`: Gemma-7B width, 1 block, float32, 3.8 GB) is
written once in each format (KerasHub `model.weights.h5`; Hugging Face
safetensors, 2 GB shards + index) and served on loopback by
`tests/remote_servers.RangeServer`, run in a process of its own (so it shares
no GIL with any client; its CPU time is reported per case), as plain HTTP
and as a Hugging Face Hub repo. Stages: `throttled` (20 ms before each
response, 50 MB/s per connection: object-store-like) and `open` (no latency,
no cap: the overhead). Every case runs in a fresh subprocess, on 8 simulated
CPU devices:

- `download`: one connection, a GET of each file of the checkpoint whole
  into one preallocated buffer (`http.client` `readinto`): what a single
  stream costs; at 50 MB/s the floor for 3.8 GB is ~76 s.
- `ours`: `load_sharded_preset("hf://bench/<probe>", mesh=(1, 8))`.
- `ours2`: the same call in two processes x 4 devices on a (2, 4) mesh
  (`jax.distributed` over loopback) with the default layout map (KerasHub's
  Gemma map): it splits the weights on the batch axis too, so no block is
  held by both processes and there is nothing to exchange: each process
  reads its own half, which in a row-major tensor split on its last axis is
  a strided run per row (one range request each).
- `ours2x`: the same call with that map minus the batch axis (weights
  replicated across the processes: data parallelism across hosts): every
  block is held by both processes, so the loader's read-once-per-job path
  (on by default, `load.block_plan.Exchange`) has each process read half
  and the devices gather the rest, in rounds.
- `stock`: `keras_hub.models.Backbone.from_preset("hf://bench/<probe>")`
  inside the same `ModelParallel` (1, 8), huggingface_hub pointed at the
  server with a fresh `HF_HOME`: it downloads, then loads.
- `<case>_mem`: the case again with the memory sampler (every 2 ms);
  `stock_mem` reuses the cache `stock` downloaded (its load phase only).

Measured per case: wall (until every shard is resident), client and server
CPU seconds, bytes and requests per process from the server's log (by
`X-Khd-Process`), host RSS growth over the bytes the process's devices hold,
bytes written to disk (the process's `write_bytes` in /proc/self/io during
the load, and what is left in its HOME-like directories: TMPDIR, HF_HOME,
KERAS_HOME), and per-device peak / final from the sampler.

`--clients` compares range clients instead: the probe's model.weights.h5
fetched whole as 16 MiB ranges, 16 in flight where the API allows, into one
preallocated aligned buffer, from the same server (both stages): our
`RangeClient` (also with urllib3's `readinto`, which copies every byte
once more: how it read bodies before); fsspec's HTTPFileSystem `cat_ranges`
(aiohttp); obstore's `HTTPStore` with `get_ranges` and with
`get_range_async` (16 in flight). A client that is not installed is
reported as such. The bytes are checked against the file (64 sampled MiB).

Usage (heavy: run under the machine's heavy-job lock, in an environment with
`pip install -e .[test] "fsspec[http]" obstore`):

    flock /tmp/khd-heavy.lock python benchmarks/bench_remote.py
    flock /tmp/khd-heavy.lock python benchmarks/bench_remote.py --clients
    python benchmarks/bench_remote.py --config small --formats keras   # smoke run
    python benchmarks/bench_remote.py --render run.json [run2.json run.log ...]

`--json` writes the records after every case; `--render` prints the table of
saved records (a log's brief lines lack the per-device peak / final).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
TESTS = os.path.join(REPO, "tests")
sys.path[:0] = [BENCH, REPO]
from bench_load import (  # noqa: E402
    CONFIGS, RESULT_TAG, _case_load, _cpu_seconds, _env, _max_ratio, _median, _weights_bytes,
    _write, run_capped,
)

# A 0.55 GB probe of the same shape family, for smoke runs only.
CONFIGS.setdefault("small", dict(architecture="gemma_7b_en", dtype="float32", overrides=dict(
    num_layers=1, vocabulary_size=16384, intermediate_dim=8192)))
STAGES = {"throttled": (0.02, 50e6), "open": (0.0, None)}
CASES = "download,ours,ours2x,ours,ours2x,ours,ours2x,ours_mem,ours2x_mem,ours2,stock,stock_mem"
CLIENTS = ("ranged_http", "ranged_http_urllib3_read", "fsspec_cat_ranges", "obstore_get_ranges",
           "obstore_get_range_async")
FORMATS = {"keras": "keras", "huggingface": "hf"}
# Copies of each byte in user space between the socket and the buffer, from
# the code (Python 3.11, urllib3 2.x; recv_into the buffer = 0): urllib3's
# readinto gets a new `bytes` from http.client's read(n) (filled from the
# socket) and copies it; aiohttp's read() joins the received chunks, then our
# copy; every bytes-returning API needs our copy.
COPIES = {"ranged_http": "0", "ranged_http_urllib3_read": "1", "fsspec_cat_ranges": "2",
          "obstore_get_ranges": ">= 1", "obstore_get_range_async": ">= 1"}
MIB = 1 << 20


# --- the server (a process of its own) ---------------------------------------


def serve(args) -> None:
    """Serves every probe dir as plain HTTP (/<fmt>/...) and as the Hub repo
    bench/<probe>-<fmt>; answers JSON commands on stdin (set, clear, stats)."""
    sys.path.insert(0, TESTS)
    from remote.servers import RangeServer, walk_files

    server = RangeServer()
    for spec in args.serve:
        prefix, path, repo = spec.split("=", 2)
        server.put_dir(path, prefix)
        server.add_hub_repo(repo, {rel: full for full, rel in walk_files(path)})
    with server:
        print(json.dumps({"endpoint": server.url}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "set":
                server.latency_s = command["latency"]
                server.bytes_per_second_per_connection = command["rate"]
            elif command["op"] == "clear":
                server.clear()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            by_process: dict[str, list[int]] = {}
            for r in server.log:
                entry = by_process.setdefault(str(r.process), [0, 0])
                entry[0] += 1
                entry[1] += r.bytes_sent if r.status < 300 else 0
            errors = sum(1 for r in server.log if r.status >= 400)
            print(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime,
                              "by_process": by_process, "errors": errors}), flush=True)


class Server:
    """The parent's handle of the server process."""

    def __init__(self, probes: dict[str, str], config: str) -> None:
        specs = [f"{FORMATS[fmt]}={path}=bench/{config}-{FORMATS[fmt]}" for fmt, path in probes.items()]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *[f"--serve={s}" for s in specs]],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        self.endpoint = json.loads(self.proc.stdout.readline())["endpoint"]

    def command(self, op: str, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


# --- cases (each in a fresh subprocess) --------------------------------------


def _written() -> int:
    """Bytes this process has written to storage so far (dirtied pages)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["write_bytes"])


def case_download(args) -> dict:
    """One connection; each file whole, in order, into one buffer."""
    import http.client
    import urllib.parse

    import numpy as np

    from keras_hub_dist.storage.host_io import aligned_empty
    from keras_hub_dist.measure import memory

    files = sorted(f for f in os.listdir(args.preset) if os.path.isfile(os.path.join(args.preset, f)))
    sizes = [os.path.getsize(os.path.join(args.preset, f)) for f in files]
    buffer = aligned_empty((sum(sizes),), np.uint8)
    view = memoryview(buffer)
    url = urllib.parse.urlsplit(args.url)
    memory.reset_host_peak_rss()
    rss0, cpu0, written0 = memory.current_rss_bytes(), _cpu_seconds(), _written()
    start = time.perf_counter()
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    done = 0
    for name, size in zip(files, sizes):
        connection.request("GET", f"{url.path}/{name}", headers={"X-Khd-Process": "0"})
        response = connection.getresponse()
        if response.status != 200 or response.length != size:
            raise RuntimeError(f"GET {name}: HTTP {response.status}, {response.length} bytes")
        end = done + size
        while done < end:
            n = response.readinto(view[done:min(end, done + 16 * MIB)])
            if not n:
                raise RuntimeError(f"{name} ended early")
            done += n
    connection.close()
    checksum = int(buffer[::4096].sum())
    return {"wall_s": time.perf_counter() - start, "cpu_s": _cpu_seconds() - cpu0,
            "held_bytes": done, "host_rss_start": rss0, "checksum": checksum,
            "host_rss_peak": memory.host_peak_rss_bytes(), "written": _written() - written0}


def _model_axis_only(device_mesh):
    """KerasHub's Gemma layout map with the batch axis dropped."""
    import keras

    import keras_hub_dist

    base = keras_hub_dist.get_layout_map(CONFIGS["width1"]["architecture"], device_mesh)
    layout_map = keras.distribution.LayoutMap(device_mesh)
    for key in base:
        layout_map[key] = tuple(None if a == "batch" else a for a in base[key].axes)
    return layout_map


def case_load(args) -> dict:
    """`ours`, `ours2`/`ours2x` (one process of the two) or `stock`, via
    bench_load."""
    mesh_shape = (1, 8)
    if args.case.startswith("ours2"):
        from tests.multiprocess_jobs import join_job

        join_job(args.process_id, 2, args.port, 4)
        mesh_shape = (2, 4)
    import jax
    import keras  # noqa: F401 - imported before the start line, as in one process
    import keras_hub  # noqa: F401

    import keras_hub_dist  # noqa: F401

    sync = None
    if jax.process_count() > 1:
        from jax.experimental.multihost_utils import sync_global_devices as sync

        sync("start")  # both processes start the clock together
    which = "stock" if args.case.startswith("stock") else "ours"
    written0 = _written()
    extra = {"layout_map": _model_axis_only} if args.case.startswith("ours2x") else {}
    result = _case_load(args, which, args.case.endswith("_mem"), mesh_shape, **extra)
    result["written"] = _written() - written0
    result["process_index"] = jax.process_index()
    if sync is not None:
        sync("done")  # neither leaves the job while the other still loads
    return result


def case_client(args) -> dict:
    """Fetches `args.name` whole as `args.chunk`-byte ranges with one client."""
    import numpy as np

    from keras_hub_dist.storage.host_io import aligned_empty
    from keras_hub_dist.measure import memory

    size = os.path.getsize(args.preset)
    chunk, url, name = args.chunk, args.url, os.path.basename(args.preset)
    starts = list(range(0, size, chunk))
    ends = [min(size, s + chunk) for s in starts]
    window = max(1, (1 << 30) // chunk)  # ranges per call of a batch API: 1 GiB
    try:  # imports outside the clock; a client that is missing is reported
        if args.client == "fsspec_cat_ranges":
            import fsspec

            fs = fsspec.filesystem("http", skip_instance_cache=True)
        elif args.client.startswith("obstore"):
            import asyncio

            import obstore
            from obstore.store import HTTPStore

            store = HTTPStore.from_url(url, client_options={"allow_http": True, "timeout": "300s"})
    except ImportError as e:
        return {"unavailable": f"{type(e).__name__}: {e}"}
    buffer = aligned_empty((size,), np.uint8)
    memory.reset_host_peak_rss()
    rss0, cpu0 = memory.current_rss_bytes(), _cpu_seconds()
    start = time.perf_counter()
    if args.client.startswith("ranged_http"):
        from keras_hub_dist.storage import ranged_http
        from keras_hub_dist.storage.object_stores import open_store

        if args.client == "ranged_http_urllib3_read":  # bodies read as before the fix
            ranged_http._body_readinto = lambda response: response.readinto
        with ranged_http.RangeClient(args.concurrency, chunk) as client:
            store = open_store(url, client)
            remote = client.open(store.stat(name), store, name)
            remote.read_stretches([(0, [memoryview(buffer)])])
    elif args.client in ("fsspec_cat_ranges", "obstore_get_ranges"):
        for i in range(0, len(starts), window):  # one call per window of ranges
            s, e = starts[i:i + window], ends[i:i + window]
            if args.client == "fsspec_cat_ranges":
                parts = fs.cat_ranges([f"{url}/{name}"] * len(s), s, e,
                                      batch_size=args.concurrency, on_error="raise")
            else:  # adjacent ranges become one request, even with coalesce=0
                parts = obstore.get_ranges(store, name, starts=s, ends=e, coalesce=0)
            for a, b, part in zip(s, e, parts):
                buffer[a:b] = np.frombuffer(part, np.uint8)
            del parts
    else:  # obstore_get_range_async: `concurrency` in flight, each copied as it lands

        async def fetch_all() -> None:
            gate = asyncio.Semaphore(args.concurrency)

            async def one(a: int, b: int) -> None:
                async with gate:
                    part = await obstore.get_range_async(store, name, start=a, end=b)
                buffer[a:b] = np.frombuffer(part, np.uint8)

            await asyncio.gather(*(one(a, b) for a, b in zip(starts, ends)))

        asyncio.run(fetch_all())
    wall = time.perf_counter() - start
    cpu = _cpu_seconds() - cpu0
    peak = memory.host_peak_rss_bytes()
    rng = random.Random(0)
    with open(args.preset, "rb") as f:
        offsets = [0, size - MIB] + [rng.randrange(0, size - MIB) for _ in range(62)]
        same = all(os.pread(f.fileno(), MIB, o) == buffer[o:o + MIB].tobytes() for o in offsets)
    return {"wall_s": wall, "cpu_s": cpu, "bytes": size, "host_rss_start": rss0,
            "host_rss_peak": peak, "check": "equal" if same else "DIFFERENT"}


def run_case(args) -> None:
    if args.time_limit_s:
        import signal

        signal.alarm(args.time_limit_s)  # SIGALRM ends the case (exit -14)
    if args.case == "download":
        result = case_download(args)
    elif args.case == "client":
        result = case_client(args)
    else:
        result = case_load(args)
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip the teardown of 8 devices' arrays (and of the job)


# --- orchestration -----------------------------------------------------------


def _disk(path: str) -> tuple[int, int]:
    """(bytes of every file under `path`, the largest file's bytes)."""
    sizes = [os.lstat(os.path.join(root, f)).st_size for root, _, names in os.walk(path)
             for f in names if not os.path.islink(os.path.join(root, f))]
    return sum(sizes), max(sizes, default=0)


def _command(args, case: str, preset: str, url: str, **extra) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--case", case, "--preset", preset,
               "--url", url, "--config", args.config, "--dtype", CONFIGS[args.config]["dtype"]]
    extra.setdefault("time_limit_s", args.time_limit_s)
    for key, value in extra.items():
        command += [f"--{key}", str(value)]
    return command


def _case_env(case_dir: str, endpoint: str, hf_cache: str | None = None) -> None:
    """Points every place a case may write at `case_dir` (set in os.environ,
    which `bench_load._env` copies into the subprocess)."""
    sys.path.insert(0, TESTS)
    from remote.hub import hub_env

    for sub in ("tmp", "hf", "keras"):
        os.makedirs(os.path.join(case_dir, sub), exist_ok=True)
    os.environ.update(hub_env(endpoint, hf_cache or os.path.join(case_dir, "hf", "hub")))
    os.environ.update(TMPDIR=os.path.join(case_dir, "tmp"), HF_HOME=os.path.join(case_dir, "hf"),
                      KERAS_HOME=os.path.join(case_dir, "keras"), HF_HUB_DISABLE_PROGRESS_BARS="1")
    os.environ.pop("HF_TOKEN", None)


def run_one(args, server: Server, case: str, fmt: str, preset: str, case_dir: str,
            hf_cache: str | None = None) -> dict:
    """One case (two processes for `ours2*`), with the server's view of it."""
    _case_env(case_dir, server.endpoint, hf_cache)
    repo = f"bench/{args.config}-{FORMATS[fmt]}"
    before = server.command("clear")
    if case == "download":
        results = [run_capped(_command(args, case, preset, f"{server.endpoint}/{FORMATS[fmt]}"), 0)]
    elif case.startswith("ours2"):
        from tests.multiprocess_jobs import free_port

        port = free_port()
        with ThreadPoolExecutor(2) as pool:  # both processes at once
            results = list(pool.map(lambda i: run_capped(
                _command(args, case, f"hf://{repo}", "", process_id=i, port=port), 0), range(2)))
    else:
        cap = int(args.stock_cap_gb * 1e9) if case.startswith("stock") else 0
        results = [run_capped(_command(args, case, f"hf://{repo}", ""), cap)]
    after = server.command("stats")
    disk, largest = _disk(case_dir)
    failed = [r for r in results if r.get("failed") or r.get("killed")]
    if failed:
        first = failed[0]
        reason = first.get("reason") or (
            f"stopped by the {args.time_limit_s} s limit" if first.get("returncode") == -14
            else first.get("stderr_tail", "")[-600:])
        return {"failed": reason, "wall_s": max(r.get("wall_s", 0) for r in failed),
                "by_process": after["by_process"], "server_cpu_s": after["cpu_s"] - before["cpu_s"]}
    return {"runs": results, "server_cpu_s": after["cpu_s"] - before["cpu_s"],
            "by_process": after["by_process"], "server_errors": after["errors"],
            "disk_left": disk, "largest_file": largest}


def run_benchmark(args, probes: dict[str, str], server: Server) -> list[dict]:
    records = []
    for fmt, preset in probes.items():
        checkpoint = _weights_bytes(preset)
        # Unmeasured: the server's page cache filled, and the first large
        # allocation after writing the probe (kernel reclaim) paid here.
        server.command("set", latency=0.0, rate=None)
        warm = run_one(args, server, "download", fmt, preset, os.path.join(args.workdir, "cases", "warm"))
        print(f"warm-up: {json.dumps(_brief(warm))[:200]}", flush=True)
        for stage in args.stages.split(","):
            latency, rate = STAGES[stage]
            server.command("set", latency=latency, rate=rate)
            stock_cache = None
            for n, case in enumerate(args.cases.split(",")):
                case_dir = os.path.join(args.workdir, "cases", f"{fmt}-{stage}-{n:02d}-{case}")
                # `stock_mem` loads from the cache `stock` filled (its load phase).
                warm = stock_cache if case == "stock_mem" else None
                record = run_one(args, server, case, fmt, preset, case_dir, warm)
                if case == "stock":
                    stock_cache = os.path.join(case_dir, "hf", "hub")
                record.update(format=fmt, stage=stage, case=case, checkpoint=checkpoint)
                records.append(record)
                print(json.dumps(_brief(record)), flush=True)
                if args.json:  # after every case: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(records, f, indent=1)
                if case != "stock":
                    shutil.rmtree(case_dir, ignore_errors=True)
            shutil.rmtree(os.path.join(args.workdir, "cases"), ignore_errors=True)
    return records


def _brief(record: dict) -> dict:
    keep = ("wall_s", "cpu_s", "host_rss_start", "host_rss_peak", "held_bytes", "written")
    runs = [{k: r[k] for k in keep if k in r} for r in record.get("runs", [])]
    return {**{k: v for k, v in record.items() if k != "runs"}, "runs": runs}


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def summarize(records: list[dict]) -> str:
    rows = ["| format | stage | case | wall s (median; runs) | / download | / stock "
            "| fetched / checkpoint (per process) | requests | RSS growth / held (max) "
            "| written to disk (max); left (largest file) | peak / final (max) | CPU s client; server |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in records:
        groups.setdefault((r["format"], r["stage"]), {}).setdefault(r["case"], []).append(r)
    for (fmt, stage), cases in groups.items():
        walls = {c: _median([max(x["wall_s"] for x in r["runs"]) for r in rs if "runs" in r])
                 for c, rs in cases.items()}
        for case, rs in cases.items():
            if case.endswith("_mem"):
                continue
            mem = [r for r in cases.get(case + "_mem", []) if "runs" in r]
            good = [r for r in rs if "runs" in r]
            if not good:
                r = rs[-1]
                sent = " + ".join(f"{v[1] / r['checkpoint']:.3f} in {v[0]} requests"
                                  for v in r.get("by_process", {}).values())
                rows.append(f"| {fmt} | {stage} | {case} | {r.get('failed')!r:.300} after "
                            f"{r.get('wall_s', 0):.0f} s | | | {sent} |" + " |" * 5)
                continue
            wall = walls[case]
            runs = "; ".join(f"{max(x['wall_s'] for x in r['runs']):.2f}" for r in good)
            last = good[-1]
            per_process = [v[1] for v in last["by_process"].values()] if len(last["runs"]) == 1 \
                else [last["by_process"].get(str(p), [0, 0])[1] for p in range(len(last["runs"]))]
            fetched = " + ".join(f"{b / last['checkpoint']:.3f}" for b in per_process)
            requests = sum(v[0] for v in good[-1]["by_process"].values())
            everything = [x for r in good + mem for x in r["runs"]]
            growth = max((x["host_rss_peak"] - x["host_rss_start"]) / x["held_bytes"] for x in everything)
            written = max(x["written"] for x in everything)
            left = max(r["disk_left"] for r in good)
            largest = max(r["largest_file"] for r in good)
            # Records read back from a log's brief lines carry no per-device figures.
            peaks = [_max_ratio(x) for r in mem for x in r["runs"] if "peak_per_device" in x]
            peak = f"{max(peaks):.2f}" if peaks else "-"
            cpu = _median([sum(x["cpu_s"] for x in r["runs"]) for r in good])
            server_cpu = _median([r["server_cpu_s"] for r in good])

            def ratio(other: str) -> str:
                return f"{wall / walls[other]:.3f}" if other in walls and other != case else "-"

            rows.append(
                f"| {fmt} | {stage} | {case} | {wall:.2f} ({runs}) | {ratio('download')} "
                f"| {ratio('stock')} | {fetched} | {requests} | {growth:.3f} "
                f"| {_fmt_bytes(written)}; {_fmt_bytes(left)} (largest {_fmt_bytes(largest)}) | {peak} | {cpu:.1f}; {server_cpu:.1f} |")
        for two in ("ours2", "ours2x"):
            if "ours" in walls and two in walls:
                rows.append(f"| {fmt} | {stage} | {two} / ours wall | {walls[two] / walls['ours']:.3f} |"
                            + " |" * 8)
    return "\n".join(rows)


def load_records(paths: list[str]) -> list[dict]:
    """Records from `--json` files or from logs (one brief JSON record a line),
    in order, for `--render`."""
    records = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        if text.lstrip().startswith("["):
            records += json.loads(text)
        else:
            records += [json.loads(line) for line in text.splitlines()
                        if line.startswith("{") and '"case"' in line]
    return records


def run_clients(args, probes: dict[str, str], server: Server) -> str:
    preset = os.path.join(probes["keras"], "model.weights.h5")
    clients = args.client_list.split(",")
    runs: dict[tuple[str, str], list[dict]] = {}
    # Unmeasured: the server's page cache filled, and the first large
    # allocation after writing the probe (kernel reclaim) paid here.
    server.command("set", latency=0.0, rate=None)
    run_capped(_command(args, "client", preset, f"{server.endpoint}/keras", client=clients[0],
                        concurrency=args.concurrency, chunk=args.chunk_mib * MIB), 0)
    for stage in args.stages.split(","):
        latency, rate = STAGES[stage]
        server.command("set", latency=latency, rate=rate)
        for client in clients * args.repeats:  # interleaved
            before = server.command("clear")
            result = run_capped(_command(args, "client", preset, f"{server.endpoint}/keras",
                                         client=client, concurrency=args.concurrency,
                                         chunk=args.chunk_mib * MIB), 0)
            after = server.command("stats")
            result.update(server_cpu_s=after["cpu_s"] - before["cpu_s"],
                          requests=sum(v[0] for v in after["by_process"].values()))
            print(json.dumps({"stage": stage, "client": client, **result})[:600], flush=True)
            runs.setdefault((stage, client), []).append(result)
    rows = ["| stage | client | wall s (median; runs) | MB/s | requests | CPU s client; server "
            "| RSS growth over the buffer (max) | copies (code) | data |",
            "|---|---|---|---|---|---|---|---|---|"]
    for (stage, client), results in runs.items():
        good = [r for r in results if "wall_s" in r and not r.get("failed")]
        if not good:
            reason = results[-1].get("unavailable") or results[-1].get("stderr_tail", "")[-300:]
            rows.append(f"| {stage} | {client} | not run: {reason!r} |" + " |" * 6)
            continue
        wall = _median([r["wall_s"] for r in good])
        growth = max(r["host_rss_peak"] - r["host_rss_start"] - r["bytes"] for r in good)
        walls = "; ".join(f"{r['wall_s']:.2f}" for r in good)
        rows.append(
            f"| {stage} | {client} | {wall:.2f} ({walls}) "
            f"| {good[0]['bytes'] / 1e6 / wall:.0f} | {good[0]['requests']} "
            f"| {_median([r['cpu_s'] for r in good]):.1f}; {_median([r['server_cpu_s'] for r in good]):.1f} "
            f"| {_fmt_bytes(growth)} | {COPIES.get(client, '?')} "
            f"| {', '.join(sorted({r['check'] for r in good}))} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="width1")
    parser.add_argument("--formats", default="keras,huggingface")
    parser.add_argument("--stages", default="throttled,open", help=f"of {sorted(STAGES)}")
    parser.add_argument("--cases", default=CASES, help="cases in run order, per format and stage")
    parser.add_argument("--clients", action="store_true", help="compare range clients instead")
    parser.add_argument("--client_list", default=",".join(CLIENTS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each client")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunk_mib", type=int, default=16)
    parser.add_argument("--stock_cap_gb", type=float, default=18.0, help="host RSS cap of stock")
    parser.add_argument("--time_limit_s", type=int, default=1200, help="a case is stopped after this")
    parser.add_argument("--workdir", default="/work/bench_tmp/bench_remote")
    parser.add_argument("--keep", action="store_true", help="keep the probes")
    parser.add_argument("--json", default=None, help="also write the records here (after every case)")
    parser.add_argument("--render", nargs="+", metavar="FILE", default=None,
                        help="print the table of saved records (--json files or run logs) and exit")
    # Internal: the server process, or one case in this (fresh) process.
    parser.add_argument("--serve", action="append", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.num_threads = 2  # bench_load's `_case_load` reads it
    if args.serve:
        return serve(args)
    if args.case:
        return run_case(args)
    if args.render:
        print(summarize(load_records(args.render)))
        return

    formats = ["keras"] if args.clients else args.formats.split(",")
    probes = {fmt: os.path.join(args.workdir, f"probe_{args.config}_{FORMATS[fmt]}") for fmt in formats}
    os.makedirs(args.workdir, exist_ok=True)
    os.environ.update(_env())
    server = None
    try:
        for fmt, path in probes.items():
            _write(argparse.Namespace(config=args.config, num_layers=0, format=fmt, preset=path))
        server = Server(probes, args.config)
        header = (f"bench_remote --config {args.config}: {time.strftime('%Y-%m-%d %H:%M')}, "
                  f"{os.cpu_count()} cores, 8 simulated CPU devices, stages "
                  + ", ".join(f"{s} (latency {STAGES[s][0]} s, {STAGES[s][1] or 'no'} B/s per "
                              f"connection)" for s in args.stages.split(",")))
        print(header, flush=True)  # the start time, even if the run is cut short
        if args.clients:
            table = run_clients(args, probes, server)
        else:
            records = run_benchmark(args, probes, server)
            table = summarize(records)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(records, f, indent=1)
        print()
        print(header)
        print(table)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(os.path.join(args.workdir, "cases"), ignore_errors=True)
        if not args.keep:
            for path in probes.values():
                shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
