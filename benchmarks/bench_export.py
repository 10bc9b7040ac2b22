"""Benchmark: Hugging Face export and `convert`, ours vs stock vs the floor.

Two benchmarks, each case in a fresh subprocess (so one case's memory cannot
hide another's), on 8 simulated CPU devices:

`--bench export` (the probe, `--config width1`: Gemma-7B width, 1 decoder
block, float32, 3.8 GB): load the synthetic preset sharded on mesh (1, 8)
with `load_sharded_preset`, then time only the export:

- `ours`: `save_sharded_preset(model, out, format="huggingface")`;
- `stock`: `GemmaCausalLM(backbone=model, preprocessor=None).export_to_transformers(out)`
  (KerasHub 0.32's `export_to_safetensors`: every weight a host NumPy array,
  one `safetensors.numpy.save_file`);
- `floor`: write the model's byte count sequentially from a 64 MiB buffer.

Around the call: wall and CPU time; host anonymous memory (`RssAnon` sampled
every 1 ms by a thread, and `VmHWM` reset before the call) growth over the
model's bytes; per-device peak over the bytes before (`MemorySampler`).
`--check` then compares, in the parent, the two outputs tensor by tensor
(every tensor but the q/k/v projections, which stock gets wrong at this
shape: see the README) and ours' tensors with the source preset's datasets.

`--bench convert` (`--config full7b`: the full `gemma_7b_en`, bfloat16,
17 GB, as a Hugging Face checkpoint from `write_synthetic_hf_checkpoint`):

- `copy`: copy every file of the checkpoint to a new directory
  (`shutil.copyfile`: the kernel's `sendfile`, no user-space copy);
- `to_keras`: `convert_checkpoint(src, keras_dir, to="keras")`;
- `to_hf`: `convert_checkpoint(keras_dir, hf_dir, to="huggingface")`, back.

Each case: wall and CPU time, host `RssAnon` peak (sampled every 1 ms) and
growth, `VmHWM`. The disk is synced (untimed) before every case, so each
starts with no dirty pages of the previous one. `--check` compares the
round trip's tensors with the source checkpoint's (SHA-256 of each, streamed;
the source is deleted before `to_hf` unless `--keep`, so the disk holds at
most two copies of the model).

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_export.py --bench export --config width1 --workdir /tmp/bench_export --check
    flock /tmp/khd-heavy.lock python benchmarks/bench_export.py --bench convert --config full7b --workdir /tmp/bench_convert --check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_load import RESULT_TAG, _cpu_seconds, _median, _write, run_capped  # noqa: E402
from bench_save import _AnonSampler, _case_floor  # noqa: E402

CHUNK = 64 << 20


def _measured(call) -> dict:
    """Runs `call()` with the host and device samplers; returns the figures."""
    import keras_hub_dist

    sampler = keras_hub_dist.MemorySampler(interval_s=0.002)
    with _AnonSampler(interval_s=0.001) as anon, sampler:
        cpu0 = _cpu_seconds()
        start = time.perf_counter()
        extra = call() or {}
        wall = time.perf_counter() - start
        cpu = _cpu_seconds() - cpu0
        sampler.sample()
    ratios = [
        sampler.peak_per_device[d] / b for d, b in sampler.start_per_device.items() if b > 0
    ]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "anon_before": anon.before,
        "anon_peak": anon.peak,
        "anon_max_gap_s": anon.max_gap_s,
        "hwm_growth_bytes": sampler.host_peak_rss - sampler.host_start_rss,
        "hwm_peak": sampler.host_peak_rss,
        "device_peak": max(ratios) if ratios else float("nan"),
        **extra,
    }


def _case_export(args, which: str) -> dict:
    import gc

    import jax
    import keras_hub

    import keras_hub_dist

    model = keras_hub_dist.load_sharded_preset(args.preset, mesh=(1, 8), progress=False)
    arrays = [v.value for v in model.weights]
    jax.block_until_ready(arrays)
    model_bytes = sum(a.nbytes for a in arrays)
    del arrays
    gc.collect()

    def ours():
        keras_hub_dist.save_sharded_preset(model, args.out, format="huggingface", progress=False)

    def stock():
        keras_hub.models.GemmaCausalLM(backbone=model, preprocessor=None).export_to_transformers(args.out)

    result = _measured(ours if which == "ours" else stock)
    result["model_bytes"] = model_bytes
    result["host_growth"] = (result["anon_peak"] - result["anon_before"]) / model_bytes
    result["out_files"] = sorted(os.listdir(args.out))
    return result


def _case_convert(args, which: str) -> dict:
    if which == "copy":
        def call():
            os.makedirs(args.out)
            for name in sorted(os.listdir(args.preset)):
                shutil.copyfile(os.path.join(args.preset, name), os.path.join(args.out, name))
    else:
        import h5py  # noqa: F401 - imported before measuring, as the rest:
        import keras_hub  # noqa: F401 - modules loaded during the call
                          # would count their heap as the conversion's

        from keras_hub_dist import _compat
        from keras_hub_dist.convert import file_to_file as convert
        from keras_hub_dist.convert.file_to_file import convert_checkpoint

        _compat.stock_hf_exporter()
        _compat.transformers_converter({"model_type": "gemma"})

        # RssAnon also sampled as each tile is written (the thread needs the
        # GIL, and may miss a moment): the larger of the two is reported.
        at_writes = [0]
        write = convert.PieceWriter.write
        status = os.open("/proc/self/status", os.O_RDONLY)

        def anon() -> int:
            text = os.pread(status, 1 << 16, 0)
            start = text.index(b"RssAnon:")
            return int(text[start + 8:text.index(b"\n", start)].split()[0]) * 1024

        def sampled(self, *a):
            result = write(self, *a)
            at_writes[0] = max(at_writes[0], anon())
            return result

        convert.PieceWriter.write = sampled

        def call():
            stats = convert_checkpoint(
                args.preset, args.out, to="keras" if which == "to_keras" else "huggingface",
                task=None, progress=False,
            )
            return {"bytes_read": stats.bytes_read, "bytes_copied": stats.bytes_copied, "tiles": stats.tiles}

    result = _measured(call)
    if which != "copy":
        result["anon_peak"] = max(result["anon_peak"], at_writes[0])
    result["model_bytes"] = sum(
        os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out)
    )
    return result


def run_case(args) -> None:
    if args.case == "floor":
        result = _case_floor(args)
    elif args.bench == "export":
        result = _case_export(args, args.case)
    else:
        result = _case_convert(args, args.case)
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)


# --- checks (in the parent, streamed) ------------------------------------------------


def _safetensors_index(folder: str) -> dict:
    """tensor name -> (path, byte offset, nbytes, dtype, shape)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        for tensor, entry in header.items():
            if tensor != "__metadata__":
                a, b = entry["data_offsets"]
                out[tensor] = (path, 8 + length + a, b - a, entry["dtype"], entry["shape"])
    return out


def _same_bytes(a: tuple, b: tuple) -> bool:
    if a[2:] != b[2:]:
        return False
    with open(a[0], "rb", buffering=0) as fa, open(b[0], "rb", buffering=0) as fb:
        for lo in range(0, a[2], CHUNK):
            n = min(CHUNK, a[2] - lo)
            if os.pread(fa.fileno(), n, a[1] + lo) != os.pread(fb.fileno(), n, b[1] + lo):
                return False
    return True


def _check_export(ours: str, stock: str, preset: str) -> list[str]:
    from keras_hub_dist.formats import keras_h5

    problems = []
    a, b = _safetensors_index(ours), _safetensors_index(stock)
    wrong = {n for n in b if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
    for name in sorted(set(b) - wrong):
        if name not in a or not _same_bytes(a[name], b[name]):
            problems.append(f"{name}: ours differs from stock")
    datasets = keras_h5.read_datasets(keras_h5.weights_files(os.path.join(preset, "model.weights.h5")))
    embedding = datasets["layers/reversible_embedding/vars/0"]
    ours_embedding = a["model.embed_tokens.weight"]
    if not _same_bytes(ours_embedding, (embedding.file, embedding.offset) + ours_embedding[2:]):
        problems.append("model.embed_tokens.weight differs from the source preset")
    return problems


def _tensor_digests(folder: str) -> dict[str, tuple]:
    """tensor name -> (dtype, shape, SHA-256 of its bytes), streamed."""
    out = {}
    for name, (path, offset, nbytes, dtype, shape) in _safetensors_index(folder).items():
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            for lo in range(0, nbytes, CHUNK):
                digest.update(os.pread(f.fileno(), min(CHUNK, nbytes - lo), offset + lo))
        out[name] = (dtype, tuple(shape), digest.hexdigest())
    return out


def _check_round_trip(source: dict[str, tuple], back: str) -> list[str]:
    """The round trip's tensors against the source's digests."""
    after = _tensor_digests(back)
    problems = [] if sorted(source) == sorted(after) else [f"tensor names differ: {sorted(set(source) ^ set(after))[:5]}"]
    for name in sorted(set(source) & set(after)):
        if source[name] != after[name]:
            problems.append(f"{name}: differs after the round trip")
    return problems


# --- orchestration -------------------------------------------------------------------


def _spawn(args, case: str, out: str, preset: str) -> dict:
    command = [
        sys.executable, os.path.abspath(__file__), "--bench", args.bench, "--case", case,
        "--config", args.config, "--preset", preset, "--out", out, "--nbytes", str(args.nbytes),
    ]
    return run_capped(command, int(args.stock_cap_gb * 1e9) if case == "stock" else 0)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _row(name: str, runs: list[dict], reference: float, floor: float, gb: float) -> str:
    ok = [r for r in runs if not (r.get("failed") or r.get("killed"))]
    if not ok:
        r = runs[-1]
        return f"| {name} | stopped: {r.get('reason') or r.get('stderr_tail', '')[-300:]!r} |"
    wall = _median([r["wall_s"] for r in ok])
    walls = "; ".join(f"{r['wall_s']:.2f}" for r in ok)
    cells = [f"{wall:.2f} ({walls})", f"{wall / reference:.2f}" if reference else "-",
             f"{wall / floor:.2f}" if floor else "-"]
    if "anon_peak" in ok[0]:
        growth = max(r["anon_peak"] - r["anon_before"] for r in ok)
        cells += [f"{growth / 2**20:.0f} MiB ({growth / (gb * 1e9):.3f})",
                  f"{max(r['anon_peak'] for r in ok) / 2**30:.2f} GiB",
                  f"{max(r['hwm_growth_bytes'] for r in ok) / 2**20:.0f} MiB",
                  f"{max(r['device_peak'] for r in ok):.3f}",
                  f"CPU {_median([r['cpu_s'] for r in ok]):.1f} s; sampler gap "
                  f"{max(r['anon_max_gap_s'] for r in ok) * 1e3:.0f} ms"]
    else:
        cells += ["-"] * 5
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", choices=("export", "convert"), default="export")
    parser.add_argument("--config", default=None)
    parser.add_argument("--workdir", default="/tmp/bench_export")
    parser.add_argument("--cases", default=None)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--stock_cap_gb", type=float, default=21.0)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.config = args.config or ("width1" if args.bench == "export" else "full7b")
    if args.case:
        run_case(args)
        return

    os.makedirs(args.workdir, exist_ok=True)
    source = os.path.join(args.workdir, f"source_{args.config}")
    write_args = argparse.Namespace(
        config=args.config, preset=source, num_layers=None,
        format="keras" if args.bench == "export" else "huggingface",
    )
    _write(write_args)
    gb = sum(os.path.getsize(os.path.join(source, n)) for n in os.listdir(source)) / 1e9
    args.nbytes = int(gb * 1e9)
    started = time.perf_counter()
    results: dict[str, list[dict]] = {}
    if args.bench == "export":
        order = (args.cases or "floor,ours,stock,floor,ours,stock").split(",")
        outputs = {}
        for i, case in enumerate(order):
            subprocess.run(["sync"], check=False)
            out = os.path.join(args.workdir, f"out_{case}")
            _remove(out)
            results.setdefault(case, []).append(_spawn(args, case, out, source))
            last = i == max(j for j, c in enumerate(order) if c == case)
            if args.check and case in ("ours", "stock") and last:
                outputs[case] = out
            else:
                _remove(out)
        reference = _median([r["wall_s"] for r in results.get("stock", []) if "wall_s" in r and not r.get("killed")])
        names = ("ours", "stock", "floor")
        header = ("| case | time s (median; runs) | / stock | / floor | host anon growth (/ model) "
                  "| RssAnon peak | VmHWM growth | device peak / before | notes |")
    else:
        order = (args.cases or "copy,to_keras,to_hf").split(",")
        outputs = {}
        keras_dir = os.path.join(args.workdir, "converted_keras")
        digests = None
        for case in order:
            if case == "to_hf" and not args.keep:
                # The source is not needed any more: its tensors' digests
                # are, for --check (peak disk: two copies of the model).
                digests = _tensor_digests(source) if args.check else None
                _remove(source)
            subprocess.run(["sync"], check=False)
            out = {"copy": os.path.join(args.workdir, "copy"), "to_keras": keras_dir,
                   "to_hf": os.path.join(args.workdir, "converted_hf")}[case]
            _remove(out)
            results.setdefault(case, []).append(_spawn(args, case, out, keras_dir if case == "to_hf" else source))
            if case == "copy":
                _remove(out)
            outputs[case] = out
        reference = _median([r["wall_s"] for r in results.get("copy", []) if "wall_s" in r])
        names = ("to_keras", "to_hf", "copy")
        header = ("| case | time s | / copy | - | host anon growth (/ model) | RssAnon peak "
                  "| VmHWM growth | device peak / before | notes |")
    floor = _median([r["wall_s"] for r in results.get("floor", []) if "wall_s" in r])
    print(f"\n{args.bench} {args.config}: {gb:.2f} GB source; {time.perf_counter() - started:.0f} s of cases\n")
    print(header)
    print("|" + "---|" * 9)
    for name in names:
        if name in results:
            print(_row(name, results[name], reference, floor, gb))
    if args.check:
        if args.bench == "export":
            problems = _check_export(outputs["ours"], outputs["stock"], source)
        else:
            problems = _check_round_trip(digests or _tensor_digests(source), outputs["to_hf"])
        print("\n--check:", "OK" if not problems else f"FAILED {problems[:5]}")
    if not args.keep:
        for path in list(outputs.values()) + [source]:
            _remove(path)
        for name in os.listdir(args.workdir):
            _remove(os.path.join(args.workdir, name))


if __name__ == "__main__":
    main()
