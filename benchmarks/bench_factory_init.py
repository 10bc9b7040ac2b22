"""Wall time of a factory build with sharded random init, by depth.

Builds a reduced-width Gemma (hidden 256, ffn 512, vocab 4096, 8 heads) with
`keras_hub_dist.gemma_backbone` under `ModelParallel` on a 1x8 mesh, in this
fresh process, until every weight is resident. Compiling the per-variable init
program dominates at this width, so this shows what reusing compiled programs
across layers saves.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_factory_init.py --num_layers 8
"""

import argparse
import os
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_layers", type=int, default=8)
    args = parser.parse_args()

    import jax
    import keras

    import keras_hub_dist

    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices()[:8])
    layout_map = keras_hub_dist.get_layout_map("gemma_2b_en", mesh)
    warnings.simplefilter("ignore", keras_hub_dist.LayoutFallbackWarning)
    start = time.perf_counter()
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        backbone = keras_hub_dist.gemma_backbone(
            "gemma_2b_en", num_layers=args.num_layers, hidden_dim=256,
            intermediate_dim=512, vocabulary_size=4096, head_dim=32,
            num_query_heads=8,
        )
        jax.block_until_ready([v.value for v in backbone.weights])
    print(f"{args.num_layers} layers: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
