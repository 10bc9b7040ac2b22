"""Layouts against stock, attention on heads, remat: XLA temporaries per device.

Compile only (`compiled.memory_analysis()`), on abstract models (no weight
allocated), N simulated CPU devices:

- heads: a Llama-3-8B-width backbone (1 layer, bf16) under KerasHub's own
  Llama map ("stock": q/k/v split on the hidden dimension), ours (the same
  attention split), q/k/v split on heads ("heads",
  `family_rules.llama_head_rules` without its norm entries) and with the
  norm scales on the model axis too ("heads+norms"), for a `fit` step
  (Keras's train step, Adam, MSE on the hidden states) at batch x
  train_len and a `generate` call (LlamaCausalLM, greedy) at batch x
  gen_len.
- remat: a Gemma-7B-width backbone (bf16, our map) with 1 and 2 layers,
  `fit` step at batch x train_len, without rematerialization and with each
  mode in `--remat_modes`; the per-layer figure is 2 layers minus 1 layer.

- stock: per named architecture x job x mesh, `plan_memory(stock=True)`
  (KerasHub's own map and generate; for a family KerasHub has no map for,
  this package's map without the residual-stream rules) against ours
  (`plan_memory(stock=False)`): XLA temporaries and total per device, the
  causal LM's whole step (logits and loss included), `--layers` layers.

    python benchmarks/bench_head_layouts.py                    # heads, remat, 1x8
    python benchmarks/bench_head_layouts.py --only heads --mesh 2x4
    python benchmarks/bench_head_layouts.py --only stock --names gemma_7b_en,llama3_8b_en

Measured (2026-11-27, XLA:CPU, jax 0.10.2, Keras 3.15.1, mesh 1x8):

    fit 8 x 512 (Adam)         stock 831 MiB  ours 831  heads 1,519 (1.83x)  heads+norms 887 (1.07x)
    generate 8 x 2048 (greedy) stock 1,118 MiB, the same in all four
    remat, Gemma-7B width, per layer, with Keras's RematScope around the
    whole build (before shaping/remat.py): None 868 MiB, full 676 (0.78x),
    larger_than 676 (0.78x), activations 868 (1.00x); --optimizer sgd: the
    same figures (Adam's slots add no temporaries). remat= now applies to
    the decoder blocks only: benchmarks/bench_remat.py (full: 0.03x)
"""

from __future__ import annotations

import argparse
import os
import time


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("heads", "remat", "stock"), default=None)
    parser.add_argument(
        "--names", default="gemma_7b_en,gemma2_9b_en,gemma3_4b_text,llama3_8b_en",
        help="stock: the named architectures to plan (comma-separated)",
    )
    parser.add_argument("--meshes", default="1x8,2x4,8x1", help="stock: meshes")
    parser.add_argument("--jobs", default="fit,generate", help="stock: jobs")
    parser.add_argument("--layers", type=int, default=1, help="stock: num_layers")
    parser.add_argument("--mesh", default="1x8", help="batch x model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--train_len", type=int, default=512)
    parser.add_argument("--gen_len", type=int, default=2048)
    parser.add_argument("--llama", default="llama3_8b_en")
    parser.add_argument("--gemma", default="gemma_7b_en")
    parser.add_argument("--remat_modes", default="full,larger_than,activations")
    parser.add_argument(
        "--optimizer", default="adam",
        help="Keras optimizer of the fit step (sgd: no slots, which shows how "
        "much of a layer's temporaries are Adam's)",
    )
    parser.add_argument(
        "--vocab", type=int, default=None,
        help="override the vocabulary size (the generate prefill's logits, "
        "batch x gen_len x vocab f32, dominate its temporaries)",
    )
    return parser.parse_args()


def stock_table(args: argparse.Namespace) -> None:
    """Per architecture x job x mesh: `plan_memory(stock=True)` against ours.

    Stock is KerasHub's own map (the backbone's `get_layout_map`) and its own
    generate; for the families KerasHub has no map for (Gemma 3 / 4, ...)
    it is this package's map without `family_rules`' residual-stream rules
    (the map before they were added).
    """
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import keras_hub_dist
    from keras_hub_dist.plan import family_rules

    residual = dict(family_rules._RESIDUAL_RULES)
    print(
        f"stock vs ours: {args.layers} layer(s), bf16, fit {args.batch} x "
        f"{args.train_len} ({args.optimizer}), generate {args.batch} x "
        f"{args.gen_len}; XLA per device (MiB), compile only"
    )
    print(f"  {'architecture':16s} {'job':9s} {'mesh':5s} {'stock temp':>11s} "
          f"{'ours temp':>10s} {'ratio':>6s} {'stock total':>12s} {'ours total':>11s} {'ratio':>6s}")
    for name in args.names.split(","):
        for job in args.jobs.split(","):
            for mesh in args.meshes.split(","):
                shape = tuple(int(n) for n in mesh.split("x"))
                plans = {}
                for stock in (True, False):
                    family_rules._RESIDUAL_RULES.clear()
                    if not stock:
                        family_rules._RESIDUAL_RULES.update(residual)
                    with _quiet_keras_hub_warnings():
                        plans[stock] = keras_hub_dist.plan_memory(
                            name, shape, job=job, num_layers=args.layers,
                            dtype="bfloat16", batch_size=args.batch,
                            sequence_length=args.train_len if job == "fit" else args.gen_len,
                            optimizer=args.optimizer, stock=stock, alternatives=False,
                        )
                old, new = plans[True], plans[False]
                print(
                    f"  {name:16s} {job:9s} {mesh:5s} {old.temp_bytes / 2**20:11,.0f} "
                    f"{new.temp_bytes / 2**20:10,.0f} {new.temp_bytes / old.temp_bytes:5.2f}x "
                    f"{old.total_bytes / 2**20:12,.0f} {new.total_bytes / 2**20:11,.0f} "
                    f"{new.total_bytes / old.total_bytes:5.2f}x",
                    flush=True,
                )
    family_rules._RESIDUAL_RULES.update(residual)


def main() -> None:
    args = _parse()
    if args.only == "stock":
        os.environ.setdefault("KERAS_BACKEND", "jax")
        stock_table(args)
        return
    shape = tuple(int(n) for n in args.mesh.split("x"))
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={shape[0] * shape[1]}"
    )
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import keras
    import keras_hub

    import keras_hub_dist
    from keras_hub_dist.measure.step_memory import generate_memory, train_step_memory
    from keras_hub_dist.plan import presets
    from keras_hub_dist.shaping.apply import build_shaped
    from keras_hub_dist.plan.family_rules import llama_head_rules

    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), jax.devices())
    batch_sharding = jax.sharding.NamedSharding(
        mesh.backend_mesh, jax.sharding.PartitionSpec("batch")
    )

    def ints(length):
        return jax.ShapeDtypeStruct((args.batch, length), "int32", sharding=batch_sharding)

    def build(name, layout_map, remat=None, **overrides):
        cls, config, _ = presets.backbone_config(name, dtype="bfloat16", **overrides)
        keras.backend.clear_session()
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
        keras.distribution.set_distribution(distribution)
        # Abstract: variables have shapes and layouts, no values.
        backbone, _ = build_shaped(cls, config, remat)
        return backbone

    def fit_temp(backbone):
        x = {"token_ids": ints(args.train_len), "padding_mask": ints(args.train_len)}
        y = jax.ShapeDtypeStruct(
            (args.batch, args.train_len, backbone.hidden_dim), "bfloat16",
            sharding=batch_sharding,
        )
        return train_step_memory(backbone, x, y, optimizer=args.optimizer)["temp_bytes"]

    def mib(n):
        return f"{n / 2**20:,.0f} MiB"

    if args.only in (None, "heads"):
        cls = presets.backbone_config(args.llama)[0]

        def heads_map(norms):
            layout_map = keras_hub_dist.get_layout_map(cls, mesh)
            rules = llama_head_rules("model", "batch")
            for key, axes in rules.items():
                if norms or "layernorm" not in key:
                    if key in set(layout_map.keys()):
                        del layout_map[key]
                    layout_map[key] = axes
            return layout_map

        maps = {
            "stock": lambda: cls.get_layout_map(mesh),
            "ours": lambda: keras_hub_dist.get_layout_map(cls, mesh),
            "heads": lambda: heads_map(False),
            "heads+norms": lambda: heads_map(True),
        }
        rows = {}
        vocab = {} if args.vocab is None else {"vocabulary_size": args.vocab}
        for which, layout_map in maps.items():
            start = time.perf_counter()
            backbone = build(args.llama, layout_map(), num_layers=1, **vocab)
            fit = fit_temp(backbone)
            backbone = build(args.llama, layout_map(), num_layers=1, **vocab)
            with _quiet_keras_hub_warnings():
                lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
            lm.compile(sampler="greedy")
            gen = generate_memory(
                lm, {"token_ids": ints(args.gen_len), "padding_mask": ints(args.gen_len)}
            )["temp_bytes"]
            rows[which] = (fit, gen)
            print(f"  {which}: compiled in {time.perf_counter() - start:.0f} s", flush=True)
        print(
            f"\nheads: {args.llama} width, 1 layer, bf16, mesh {args.mesh}"
            f"{'' if args.vocab is None else f', vocabulary {args.vocab}'}; "
            "XLA temporaries per device, each / stock (KerasHub's map)"
        )
        for i, what in enumerate((
            f"fit {args.batch} x {args.train_len} (Adam)",
            f"generate {args.batch} x {args.gen_len} (greedy)",
        )):
            stock = rows["stock"][i]
            cells = "  ".join(
                f"{which} {mib(row[i])} ({row[i] / stock:.2f}x)"
                for which, row in rows.items()
            )
            print(f"  {what:28s} {cells}")

    if args.only in (None, "remat"):
        cls = presets.backbone_config(args.gemma)[0]
        temps = {}
        for mode in [None, *args.remat_modes.split(",")]:
            for layers in (1, 2):
                start = time.perf_counter()
                backbone = build(
                    args.gemma, keras_hub_dist.get_layout_map(cls, mesh), mode,
                    num_layers=layers,
                )
                temps[mode, layers] = fit_temp(backbone)
                print(f"  remat={mode} {layers} layer(s): {mib(temps[mode, layers])}, "
                      f"compiled in {time.perf_counter() - start:.0f} s", flush=True)
        print(
            f"\nremat: {args.gemma} width, bf16, fit {args.batch} x "
            f"{args.train_len} ({args.optimizer}), mesh {args.mesh}; XLA temporaries per "
            "device, 1 layer / 2 layers / per layer (2 - 1)"
        )
        off = temps[None, 2] - temps[None, 1]
        for mode in [None, *args.remat_modes.split(",")]:
            one, two = temps[mode, 1], temps[mode, 2]
            print(f"  remat={str(mode):12s} {mib(one):>11s} {mib(two):>11s} "
                  f"{mib(two - one):>11s}  ratio {(two - one) / off:.2f}x")


class _quiet_keras_hub_warnings:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


if __name__ == "__main__":
    main()
