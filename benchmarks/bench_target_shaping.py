"""Two shaping defaults re-measured on the TPU v5e-8 compiler (libtpu), one model at reduced depth.

`remat=` for a LoRA fit (None vs "full") and generate's `prompt_chunk`
(512, the default, vs 2048 vs None: the prompt in one pass), ours, on
`v5e-8` mesh (1, 8), bf16, from this CPU host: per-device total and the
ESTIMATED step time (`plan.step_time`).

```
python benchmarks/bench_target_shaping.py --model gemma_7b_en --layers 2
```
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    ("fit lora r=8, remat=None", dict(job="fit", lora_rank=8, remat=None, batch_size=8, sequence_length=2048)),
    ("fit lora r=8, remat='full'", dict(job="fit", lora_rank=8, remat="full", batch_size=8, sequence_length=2048)),
    ("generate 8x8192, prompt_chunk=512", dict(job="generate", prompt_chunk=512, batch_size=8, sequence_length=8192)),
    ("generate 8x8192, prompt_chunk=2048", dict(job="generate", prompt_chunk=2048, batch_size=8, sequence_length=8192)),
    ("generate 8x8192, prompt_chunk=None", dict(job="generate", prompt_chunk=None, batch_size=8, sequence_length=8192)),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma_7b_en")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--target", default="v5e-8")
    args = parser.parse_args()
    import keras_hub_dist

    for label, kwargs in CASES:
        start = time.perf_counter()
        plan = keras_hub_dist.plan_memory(
            args.model, (1, 8), dtype="bfloat16", num_layers=args.layers, target=args.target,
            alternatives=False, **kwargs,
        )
        est = plan.step_time
        print(json.dumps(dict(
            case=label, total_mib=round(plan.total_bytes / 2**20, 1), temp_mib=round(plan.temp_bytes / 2**20, 1),
            overlapped_ms=est and round(est.step.overlapped_s * 1e3, 2), serial_ms=est and round(est.step.serial_s * 1e3, 2),
            refusal=plan.refusal, plan_s=round(time.perf_counter() - start, 1),
        )), flush=True)


if __name__ == "__main__":
    main()
