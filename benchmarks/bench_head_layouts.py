"""Attention split on heads, and rematerialization: XLA temporaries per device.

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

    python benchmarks/bench_head_layouts.py                    # both, 1x8
    python benchmarks/bench_head_layouts.py --only heads --mesh 2x4

Measured (2026-11-27, XLA:CPU, jax 0.10.2, Keras 3.15.1, mesh 1x8):

    fit 8 x 512 (Adam)         stock 831 MiB  ours 831  heads 1,519 (1.83x)  heads+norms 887 (1.07x)
    generate 8 x 2048 (greedy) stock 1,118 MiB, the same in all four
    remat, Gemma-7B width, per layer, with Keras's RematScope around the
    whole build (before plan/remat.py): None 868 MiB, full 676 (0.78x),
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
    parser.add_argument("--only", choices=("heads", "remat"), default=None)
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


def main() -> None:
    args = _parse()
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
    from keras_hub_dist.plan.build import build_without_values
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
        backbone, _ = build_without_values(cls, config, remat)
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
