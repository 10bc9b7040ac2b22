"""Benchmark: a host lost mid-operation (issue 40), per phase and per
process killed.

Each case is a 2-process x 4-device job on loopback (gloo), started by
`tests/remote/lost_process_worker.py`: process VICTIM stops at a known point
of the phase (a load's third variable read, a directory save's third
positioned write, an S3 save's first part upload, a restore's first
checkpoint read), says so in a file, and this script SIGKILLs it. Measured
at the events: kill -> the survivor catching its error (by its own clock),
kill -> the survivor's exit, its exit status and error class, and what is
left at the target (a directory: the target and staging entries beside it;
S3: objects and open multipart uploads).

The setup is the package's (`keras_hub_dist.initialize`, heartbeat
`--heartbeat`, default 10 s) or, with `--jax-defaults`, the one before
issue 40 (`jax.distributed.initialize`, JAX's 100 s heartbeat: expect
minutes per case). The models are the tests' synthetic Llama presets
(tiny: 2 blocks, width 64; for S3 a 21 MB one, so that both processes
upload 5 MiB parts); the S3 store is moto's server on loopback.

    python benchmarks/bench_lost_host.py [--heartbeat 10] [--phases load,save,s3,restore] [--victims 1,0]

`--sweep` kills at events instead (issue 60): the victim's own test hook
(`KERAS_HUB_DIST_TEST_KILL_AT="OPERATION.EVENT:K"`, keras_hub_dist/_lost.py)
SIGKILLs it at the K-th EVENT of the operation, for every K from 1 until
the operation ends before the K-th (`--max-k` at most), for each operation
and its events: a load (Keras and HF formats, a directory and S3) and an
adapter load at each variable and each exchange round; a save (a directory,
S3), an HF export, `convert_checkpoint`, an adapter save and
`restore_checkpoint` at each cross-process step, each part written and the
publish. Printed: per operation and event, the K swept and, over them, the
worst kill -> error and kill -> exit and every exit status seen.

    python benchmarks/bench_lost_host.py --sweep [--heartbeat 10] [--victims 1] [--max-k 40] [--stride 1] [--ops load,save,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

WORKER = ROOT / "tests" / "remote" / "lost_process_worker.py"


class _Stopped(Exception):
    pass


def _left(phase: str, target: str) -> str:
    if phase == "save":
        parent = pathlib.Path(target).parent
        names = sorted(p.name for p in parent.iterdir() if p.name != "job")
        return ", ".join(names) or "nothing"
    if phase == "s3":
        from keras_hub_dist.storage import uploads

        writer = uploads.open_writer(target)
        objects = sorted(writer.list())
        return f"{len(objects)} objects {objects[:3]}, {len(writer.list_uploads())} open uploads"
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heartbeat", type=int, default=10)
    parser.add_argument("--jax-defaults", action="store_true")
    parser.add_argument("--phases", default="load,save,s3,restore")
    parser.add_argument("--victims", default="1,0")
    parser.add_argument("--limit", type=int, default=240, help="seconds a survivor may take to exit")
    parser.add_argument("--sweep", action="store_true", help="kill at every event (the test hook)")
    parser.add_argument("--max-k", type=int, default=40)
    parser.add_argument("--stride", type=int, default=1, help="sweep K = 1, 1 + stride, ...")
    parser.add_argument("--ops", default=",".join(SWEEP))
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
        return

    import pytest

    import tests.multiprocess_jobs as jobs
    from remote import stores

    def stop(message: str) -> None:
        raise _Stopped(message)

    pytest.fail = pytest.skip = stop  # the job runner's failures, as rows here
    heartbeat = 0 if args.jax_defaults else args.heartbeat
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = pathlib.Path(tmp)
        tiny, parts = jobs.lost_process_presets(root)
        checkpoint = jobs.weights_only_checkpoint(root, tiny) if "restore" in args.phases else None
        s3 = stack.enter_context(stores.MotoS3()) if "s3" in args.phases else None
        for phase in args.phases.split(","):
            for victim in map(int, args.victims.split(",")):
                case = root / f"{phase}_{victim}"
                (case / "job").mkdir(parents=True)
                preset, target = tiny, str(case / "saved")
                if phase == "s3":
                    remote = stack.enter_context(stores.empty_remote("s3", s3=s3))
                    for key, value in remote.env.items():
                        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
                    preset, target = parts, remote.url
                elif phase == "restore":
                    target = checkpoint
                started = time.time()
                try:
                    result = jobs.run_lost_process_job(
                        WORKER, [preset, phase, target], case / "job", victim=victim, heartbeat_s=heartbeat,
                        limit_s=args.limit)
                except _Stopped as error:
                    rows.append({"phase": phase, "victim": victim, "error": str(error)[:300]})
                    continue
                report = result["report"]
                rows.append({
                    "phase": phase,
                    "victim": victim,
                    "raised": (report.get("classes") or ["(none: no Python exception)"])[0],
                    "kill_to_error_s": None if result["kill_to_error_s"] is None else round(result["kill_to_error_s"], 2),
                    "exit": result["exit"],
                    "kill_to_exit_s": round(result["kill_to_exit_s"], 2),
                    "left_at_target": _left(phase, target),
                    "case_wall_s": round(time.time() - started, 1),
                    "message": (report.get("message") or "")[:240],
                })
                print(json.dumps(rows[-1]), flush=True)
    setup = "JAX defaults (jax.distributed.initialize)" if args.jax_defaults else f"keras_hub_dist.initialize(heartbeat_timeout_s={args.heartbeat})"
    print(f"\nsetup: {setup}; 2 processes x 4 CPU devices, loopback, mesh (1, 8)\n")
    print("| phase | killed | survivor raised | kill -> error | exit status | kill -> exit | left at the target |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['phase']} | process {row['victim']} | runner: {row['error'][:80]} | | | | |")
            continue
        error_s = "-" if row["kill_to_error_s"] is None else f"{row['kill_to_error_s']:.2f} s"
        print(f"| {row['phase']} | process {row['victim']} | {row['raised']} | {error_s} | {row['exit']} | "
              f"{row['kill_to_exit_s']:.2f} s | {row['left_at_target']} |")


# operation -> (worker phase, preset, target, events); the hook's OPERATION
# is the first word of the events.
SWEEP = {
    "load": ("load", "tiny", None, ("load.variable", "load.exchange")),
    "load-hf": ("load", "tiny_hf", None, ("load.variable", "load.exchange")),
    "load-s3": ("load", "tiny@s3", None, ("load.variable", "load.exchange")),
    "save": ("save", "tiny", "dir", ("save.step", "save.part", "save.publish")),
    "save-s3": ("s3", "parts", "s3", ("save.step", "save.publish")),
    "hf-export": ("hf", "tiny3", "dir", ("save.step", "save.part", "save.publish")),
    "convert": ("convert", "tiny3", "dir", ("conversion.step",)),
    "adapter-save": ("adapter-save", "tiny3", "dir", ("adapter-save.step", "adapter-save.publish")),
    "adapter-load": ("adapter-load", "tiny_hf", "adapter", ("load.variable", "load.exchange")),
    "restore": ("restore", "tiny", "checkpoint", ("restore.step",)),
}


def sweep(args: argparse.Namespace) -> None:
    import pytest

    import tests.multiprocess_jobs as jobs
    from remote import stores

    def stop(message: str) -> None:
        raise _Stopped(message)

    pytest.fail = pytest.skip = stop
    summary = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = pathlib.Path(tmp)
        tiny, parts = jobs.lost_process_presets(root)
        tiny3, tiny_hf, adapter = jobs.lost_process_hf_and_adapter(root)
        presets = {"tiny": tiny, "parts": parts, "tiny3": tiny3, "tiny_hf": tiny_hf}
        s3 = stack.enter_context(stores.MotoS3())
        case = 0
        for op in args.ops.split(","):
            phase, preset_name, target_kind, events = SWEEP[op]
            for event in events:
                for victim in map(int, args.victims.split(",")):
                    rows = []
                    for k in range(1, args.max_k + 1, args.stride):
                        case += 1
                        out = root / f"case{case}"
                        (out / "job").mkdir(parents=True)
                        env = {}
                        if preset_name == "tiny@s3":
                            remote = stack.enter_context(stores.checkpoint_everywhere(tiny, s3=s3, gcs=None, schemes=("s3",)))["s3"]
                            preset, env = remote.url, remote.env
                        else:
                            preset = presets[preset_name]
                        target = {None: "-", "dir": str(out / "saved"), "adapter": adapter,
                                  "checkpoint": None}.get(target_kind)
                        if target_kind == "checkpoint":
                            target = str(root / "checkpoint") if (root / "checkpoint").exists() else \
                                jobs.weights_only_checkpoint(root, tiny)
                        if target_kind == "s3":
                            remote = stack.enter_context(stores.empty_remote("s3", s3=s3))
                            target, env = remote.url, remote.env
                        for key, value in env.items():
                            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
                        try:
                            result = jobs.run_lost_process_job(
                                WORKER, [preset, phase, target], out / "job", victim=victim,
                                heartbeat_s=args.heartbeat, limit_s=args.limit, kill_at=f"{event}:{k}")
                        except _Stopped as error:
                            rows.append({"k": k, "error": str(error)[:300]})
                            print(json.dumps({"op": op, "event": event, **rows[-1]}), flush=True)
                            break
                        if not result["reached"]:
                            break
                        report = result["report"]
                        rows.append({
                            "k": k, "exit": result["exit"],
                            "raised": (report.get("classes") or ["(none)"])[0],
                            "error_s": None if result["kill_to_error_s"] is None else round(result["kill_to_error_s"], 2),
                            "exit_s": round(result["kill_to_exit_s"], 2),
                            "left": _left("save" if target_kind == "dir" else phase, target) if target_kind in ("dir", "s3") else "-",
                            "lost": report.get("lost"), "step": (report.get("message") or "")[:160],
                        })
                        print(json.dumps({"op": op, "event": event, "victim": victim, **rows[-1]}), flush=True)
                    summary.append((op, event, victim, rows))
    print(f"\nsetup: keras_hub_dist.initialize(heartbeat_timeout_s={args.heartbeat}); 2 processes x 4 CPU devices, "
          "loopback, mesh (1, 8); victim SIGKILLed by its own test hook at the K-th event\n")
    print("| operation | kill point (event) | victim | K swept | survivor raised | worst kill -> error | "
          "worst kill -> exit | exit statuses |")
    print("|---|---|---|---|---|---|---|---|")
    for op, event, victim, rows in summary:
        done = [r for r in rows if "error" not in r]
        if not done:
            print(f"| {op} | {event} | {victim} | none reached | {rows[0]['error'][:60] if rows else '-'} | | | |")
            continue
        raised = sorted({r["raised"] for r in done})
        swept = ",".join(str(r["k"]) for r in done) if args.stride > 1 else f"1-{done[-1]['k']}"
        errors = [r["error_s"] for r in done if r["error_s"] is not None]
        worst_error = f"{max(errors):.2f} s" if errors else "-"
        missing = len(done) - len(errors)
        if missing:
            worst_error += f" ({missing} without a Python error)"
        print(f"| {op} | {event} | {victim} | {swept} | {', '.join(raised)} | {worst_error} | "
              f"{max(r['exit_s'] for r in done):.2f} s | {', '.join(str(c) for c in sorted({r['exit'] for r in done}))} |")


if __name__ == "__main__":
    main()
