"""The whole job per device, ours vs stock, from XLA's analysis of the real programs.

For each architecture, job and mesh, `keras_hub_dist.plan_memory` compiles
the program the job runs on abstract values (no weight allocated) for 8
simulated CPU devices and reads XLA's per-device memory analysis, twice:

- stock: KerasHub's own layout map (`Backbone.get_layout_map`), its own
  `generate` (the prompt pass over all `max_length` positions at once, no
  cache layout), Keras's train step with nothing rematerialized;
- ours: the package's default layouts, the batch kept on the batch axis
  between decoder blocks (`shaping.batch_axis`), the chunked prompt pass with
  the batch on the batch axis, and for `fit` also with `remat="full"`.

Printed: per-device weights + state (XLA's arguments), temporaries and total
(arguments + outputs + temporaries - aliases) in MiB, and ours / stock. The
figures are XLA's CPU compiler's (it upcasts bf16 dots to f32 and fuses
less than a TPU's or GPU's); the arrays (scores, cache, activations) are
the same on any device. XLA's analysis is deterministic (a second compile
gives the same bytes), so each figure is one compile; the seconds printed
are each plan's wall time (build, lower, compile) on this machine.

    python benchmarks/bench_plan.py                       # reduced depth (2 layers), the table
    python benchmarks/bench_plan.py --archs gemma_7b_en --jobs fit --full    # full depth
    python benchmarks/bench_plan.py --headline            # the README's two full-size rows
    python benchmarks/bench_plan.py --batch-axis          # fit per added layer, batch kept split or not
"""

from __future__ import annotations

import argparse
import os
import resource
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import keras_hub_dist  # noqa: E402
from keras_hub_dist.shaping import apply as build  # noqa: E402

ARCHS = ("gemma_7b_en", "gemma2_9b_en", "llama3_8b_en", "qwen3_8b_en", "mistral_7b_en", "gpt_oss_20b_en")
MIB = 2**20


def _plan(arch, mesh, job, *, stock, remat=None, full=False, **kwargs):
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = keras_hub_dist.plan_memory(
            arch, mesh, job=job, stock=stock, remat=remat, dtype="bfloat16",
            num_layers=None if full else kwargs.pop("num_layers", 2), alternatives=False, **kwargs,
        )
    return plan, time.perf_counter() - start


def _row(label, plan, seconds, base=None):
    ratio = f"{plan.temp_bytes / base.temp_bytes:.3f}x / {plan.total_bytes / base.total_bytes:.3f}x" if base else "-"
    print(
        f"  {label:<14} args {plan.argument_bytes / MIB:>10,.1f}  temps {plan.temp_bytes / MIB:>10,.1f}  "
        f"total {plan.total_bytes / MIB:>10,.1f} MiB   temps / total vs stock {ratio:<20} ({seconds:.0f} s)",
        flush=True,
    )


def table(archs, jobs, meshes, full, fit_shape, generate_shape, lora_rank):
    for arch in archs:
        for job in jobs:
            batch, seq = fit_shape if job == "fit" else generate_shape
            extra = dict(batch_size=batch, sequence_length=seq)
            if job == "fit" and lora_rank:
                extra["lora_rank"] = lora_rank
            for mesh in meshes:
                print(f"{arch} {job} {batch}x{seq} mesh {mesh[0]}x{mesh[1]}{' full depth' if full else ' 2 layers'}")
                stock, t = _plan(arch, mesh, job, stock=True, full=full, **extra)
                _row("stock", stock, t)
                ours, t = _plan(arch, mesh, job, stock=False, full=full, **extra)
                _row("ours", ours, t, stock)
                if job == "fit":
                    remat, t = _plan(arch, mesh, job, stock=False, remat="full", full=full, **extra)
                    _row("ours + remat", remat, t, stock)


def batch_axis(archs, meshes, seqs):
    """A fit step (Adam, batch 8, full fine-tune) at 1 and 2 layers, with the
    batch kept on the data axis between blocks (ours) and without (the
    blocks left to XLA, as stock): temporaries and each added layer's."""
    keep = build.keep_batch_split
    for arch in archs:
        for seq in seqs:
            for mesh in meshes:
                figures = {}
                for kept in (False, True):
                    build.keep_batch_split = keep if kept else (lambda model: None)
                    try:
                        one, _ = _plan(arch, mesh, "fit", stock=False, num_layers=1, batch_size=8, sequence_length=seq)
                        two, _ = _plan(arch, mesh, "fit", stock=False, num_layers=2, batch_size=8, sequence_length=seq)
                    finally:
                        build.keep_batch_split = keep
                    figures[kept] = (one.temp_bytes / MIB, (two.temp_bytes - one.temp_bytes) / MIB)
                (before, before_layer), (after, after_layer) = figures[False], figures[True]
                print(
                    f"{arch} fit 8x{seq} mesh {mesh[0]}x{mesh[1]}: temporaries 1 layer {before:,.0f} -> {after:,.0f} MiB, "
                    f"each added layer {before_layer:,.0f} -> {after_layer:,.0f} MiB ({after_layer / before_layer:.2f}x)",
                    flush=True,
                )


def headline():
    """Full-size Gemma-7B LoRA r=8 fit (Adam, 8 x 2048) and Llama-3-8B generate
    (8 x 8192) on (1, 8), against 16 GiB per device."""
    for arch, job, extra, remat in (
        ("gemma_7b_en", "fit", dict(batch_size=8, sequence_length=2048, lora_rank=8), "full"),
        ("llama3_8b_en", "generate", dict(batch_size=8, sequence_length=8192), None),
    ):
        print(f"{arch} {job} {extra} mesh 1x8, full depth, budget 16 GiB")
        stock, t = _plan(arch, (1, 8), job, stock=True, full=True, hbm_gb=16, **extra)
        _row("stock", stock, t)
        print(f"    stock fits: {stock.fits}")
        ours, t = _plan(arch, (1, 8), job, stock=False, remat=remat, full=True, hbm_gb=16, **extra)
        _row("ours" + (f" remat={remat}" if remat else ""), ours, t, stock)
        print(f"    ours fits: {ours.fits}")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--jobs", default="fit,generate")
    parser.add_argument("--meshes", default="1x8,2x4")
    parser.add_argument("--full", action="store_true", help="Full depth instead of 2 layers.")
    parser.add_argument("--fit", default="8x2048", help="BATCHxSEQ of the fit step. Default: %(default)s.")
    parser.add_argument("--generate", default="8x8192", help="BATCHxMAX_LENGTH of generate. Default: %(default)s.")
    parser.add_argument("--lora", type=int, default=8, help="LoRA rank of the fit (0: full fine-tune).")
    parser.add_argument("--headline", action="store_true")
    parser.add_argument("--batch-axis", action="store_true", help="Fit with and without the batch kept split.")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, keras_hub_dist {keras_hub_dist.__version__}, {jax.device_count()} devices: "
          f"{jax.devices()[0].platform}")
    if args.headline:
        headline()
        return
    shape = lambda text: tuple(int(x) for x in text.split("x"))  # noqa: E731
    if args.batch_axis:
        archs = args.archs.split(",") if args.archs != ",".join(ARCHS) else ["llama3_8b_en", "gemma_7b_en"]
        batch_axis(archs, [shape(m) for m in "1x8,2x4,8x1".split(",")], (512, 2048))
        return
    table(
        args.archs.split(","), args.jobs.split(","), [shape(m) for m in args.meshes.split(",")],
        args.full, shape(args.fit), shape(args.generate), args.lora,
    )
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
