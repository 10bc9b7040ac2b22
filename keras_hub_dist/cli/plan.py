"""`keras-hub-dist plan`: a job's per-device memory from XLA, before any weight exists.

```
keras-hub-dist plan gemma_7b_en --mesh 1x8 --job fit --lora 8 --batch 8 --seq 2048 --hbm_gb 16
keras-hub-dist plan llama3_8b_en --mesh 1x8 --job generate --batch 8 --seq 8192 --json -
keras-hub-dist plan gemma_7b_en --mesh 1x8 --job fit --lora 8 --target v5e-8
```

On a machine whose JAX runs on CPU the command simulates the mesh's
devices (`jax_num_cpu_devices`), so a plan for 8 or 16 accelerators runs on
a laptop; the figures are then those of XLA's CPU compiler (the plan says
so). `--target v5e-8` (`v6e-8`, `v4-8`, `v5p-8`, larger slices, `h100-8`)
compiles with that chip's own compiler from this host instead (pip
`keras-hub-dist[tpu]` / `[cuda-plan]`), budgets against its device memory
and adds an estimated step time. Exit status 0 when the job fits `--hbm_gb`
(or no budget is given), 1 when it does not, 2 on an error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TextIO

__all__ = ["add_plan_flags", "run_plan"]


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """The `plan` command's flags."""
    add = parser.add_argument
    add("preset", help="A named architecture (e.g. gemma_7b_en), a KerasHub preset or Hugging Face directory.")
    add("--mesh", default="1x8", help="BATCHxMODEL mesh shape. Default: %(default)s.")
    add("--job", default="fit", choices=("fit", "generate", "load"), help="Default: %(default)s.")
    add("--batch", type=int, default=8, help="Global batch size. Default: %(default)s.")
    add("--seq", type=int, default=2048, help="Sequence length (generate: max_length). Default: %(default)s.")
    add("--optimizer", default="adam", help="Keras optimizer name (fit). Default: %(default)s.")
    add("--lora", type=int, default=None, metavar="RANK", help="LoRA rank (fit). Default: a full fine-tune.")
    add("--remat", default=None, help="keras.RematScope mode: full, activations, larger_than, list_of_layers.")
    add("--dtype", default="bfloat16", help="Weights' dtype policy. Default: %(default)s.")
    add("--quantize", default=None, choices=("int8", "int4"), help="Quantized weights, as quantize= loads them.")
    add("--num_layers", "--num-layers", type=int, default=None, help="Plan a reduced depth.")
    add("--stock", action="store_true", help="Plan stock KerasHub (its layout map and generate) instead.")
    add("--hbm_gb", "--hbm-gb", type=float, default=None, help="Per-device budget in GiB: the verdict and alternatives.")
    add(
        "--alternatives",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Plan alternatives when the job does not fit. Default: on.",
    )
    add("--target", default=None, help="Compile for this chip's compiler, e.g. v5e-8, v6e-8, h100-8 (jobs/targets.py). Default: this host's.")
    add("--json", dest="json_path", default=None, help="Write the plan as JSON to this file (- for stdout).")


def _mesh(text: str) -> tuple[int, int]:
    try:
        batch, model = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"Expected --mesh as BATCHxMODEL, e.g. 1x8 or 2x4. Received: --mesh {text}.") from None
    return batch, model


def _simulate_devices(count: int) -> None:
    """Lets the CPU backend offer `count` devices, if JAX has not started;
    an accelerator host's devices are unchanged (the CPU is not its default)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(count, 1))
    except RuntimeError:  # JAX already started: its devices are what there is
        pass


def run_plan(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The `plan` command; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        mesh = _mesh(args.mesh)
        _simulate_devices(math.prod(mesh))
        from keras_hub_dist.jobs.memory_plan import plan_memory

        plan = plan_memory(
            args.preset, mesh, job=args.job, batch_size=args.batch, sequence_length=args.seq,
            optimizer=args.optimizer, lora_rank=args.lora, remat=args.remat, dtype=args.dtype,
            quantize=args.quantize, num_layers=args.num_layers, stock=args.stock,
            hbm_gb=args.hbm_gb, alternatives=args.alternatives, target=getattr(args, "target", None),
        )
    except (ValueError, RuntimeError) as error:
        print(f"keras-hub-dist plan: error: {error}", file=err)
        return 2
    if args.json_path == "-":
        print(json.dumps(plan.to_json(), indent=2), file=out)
    else:
        print(plan.summary(), file=out)
        if args.json_path:
            with open(args.json_path, "w", encoding="utf-8") as f:
                json.dump(plan.to_json(), f, indent=2)
    return 1 if plan.fits is False else 0
