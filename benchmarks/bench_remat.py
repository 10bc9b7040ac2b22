"""`remat=` on a causal LM's fit step: what each added decoder layer costs.

Compile only, on abstract models (no weight allocated), as
`plan_memory(..., job="fit")` lowers Keras's train step of the causal LM:
a Gemma-7B-width model (bf16, Adam, our layout) with 1 and 2 layers,
without and with `remat="full"`; per layer = 2 layers - 1 layer. Two
figures: XLA's temporaries per device (`memory_analysis()`), and the
residuals the forward pass saves for the backward pass (the jaxpr of
`jax.vjp` of the loss, the weights themselves not counted: what any
compiler must keep, for the whole batch).

    python benchmarks/bench_remat.py                 # full fine-tune, 8 x 512
    python benchmarks/bench_remat.py --lora 8 --seq 2048

Measured (2026-11-28, XLA:CPU, jax 0.10.2, Keras 3.15.1, mesh 1x8, XLA's
default flags), per layer, no remat -> remat="full":

    full fine-tune 8 x 512   temporaries   868 -> 24 MiB (0.028x), residuals 2,562 -> 24 MiB (0.009x)
    LoRA r=8 8 x 512         temporaries   773 -> 24 MiB (0.031x), residuals 2,994 -> 24 MiB (0.008x)
    LoRA r=8 8 x 2048        temporaries 3,077 -> 96 MiB (0.031x)

`jax.checkpoint` of each block instead (before shaping/remat.py) gave 676 MiB
(0.78x) and 509 MiB (0.66x) of temporaries at 8 x 512: docs/plan.md.
"""

from __future__ import annotations

import argparse
import os


def _saved_residual_bytes(job, batch, length) -> int:
    import jax

    from keras_hub_dist.jobs import programs

    task = job.task
    specs = lambda vs: [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in vs]  # noqa: E731
    state = [specs(vs) for vs in (task.non_trainable_variables, task.metrics_variables, task.optimizer.variables)]
    data = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), programs.fit_batch(job, batch, length))

    def pullback(trainable, state, data):
        def loss(trainable):
            return task.compute_loss_and_updates(
                trainable, state[0], state[1], *data, training=True, optimizer_variables=state[2]
            )[0]

        return jax.vjp(loss, trainable)[1]

    with job.scope():
        closed = jax.make_jaxpr(pullback)(specs(task.trainable_variables), state, data)
    inputs = set(closed.jaxpr.invars)
    saved = [v for v in closed.jaxpr.outvars if type(v).__name__ == "Var" and v not in inputs]
    return sum(v.aval.size * v.aval.dtype.itemsize for v in saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gemma_7b_en")
    parser.add_argument("--devices", type=int, default=8, help="mesh 1 x devices")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lora", type=int, default=None, help="LoRA rank (default: full fine-tune)")
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    import keras

    from keras_hub_dist.jobs import programs
    from keras_hub_dist.jobs.abstract_job import abstract_job
    from keras_hub_dist.plan import presets

    temps, saved = {}, {}
    for remat in (None, "full"):
        for layers in (1, 2):
            keras.backend.clear_session()
            cls, config, _ = presets.backbone_config(args.preset, dtype="bfloat16", num_layers=layers)
            job = abstract_job(cls, config, (1, args.devices), lora_rank=args.lora, remat=remat)
            lowered = programs.lower_fit(job, args.batch, args.seq, "adam")
            temps[remat, layers] = programs.program_memory(lowered.compile())["temp_bytes"]
            saved[remat, layers] = _saved_residual_bytes(job, args.batch, args.seq)
            print(f"  remat={remat} {layers} layer(s): temporaries {temps[remat, layers] / 2**20:,.1f} MiB", flush=True)
    what = "full fine-tune" if args.lora is None else f"LoRA r={args.lora}"
    print(f"\n{args.preset} width, bf16, {what}, fit {args.batch} x {args.seq}, mesh 1x{args.devices}; per layer:")
    for name, figures in (("temporaries per device", temps), ("saved residuals, whole batch", saved)):
        off, on = (figures[m, 2] - figures[m, 1] for m in (None, "full"))
        print(f"  {name:30s} None {off / 2**20:,.1f} MiB  full {on / 2**20:,.1f} MiB  ({on / off:.3f}x)")


if __name__ == "__main__":
    main()
