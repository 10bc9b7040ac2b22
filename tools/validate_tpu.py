"""TPU / GPU / CPU validation script: per-device memory of init and load.

The same tool as `keras-hub-dist validate`, with absl flags:

```
python tools/validate_tpu.py --preset=gemma_7b_en --mesh=1x8 --dtype=bfloat16 \\
    --phases=init,load --hbm_gb=16 --json=report.json --plot=memory.png
python tools/validate_tpu.py --preset=gemma_7b_en --num_layers=1   # CPU, 8 simulated devices
```

Each case (ours / stock KerasHub x init / load) runs in a fresh process; the
exit status is 1 when a device's peak in one of our cases exceeds --hbm_gb.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_PRESET = flags.DEFINE_string(
    "preset", "gemma_7b_en", "A named architecture or a KerasHub preset directory."
)
_MESH = flags.DEFINE_string("mesh", None, "BATCHxMODEL mesh shape, e.g. 1x8. Default: 1xN.")
_DTYPE = flags.DEFINE_string("dtype", None, "Weight dtype, e.g. bfloat16. Default: the preset's.")
_PHASES = flags.DEFINE_string("phases", "init,load", "init, load or init,load.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", None, "Override the number of layers.")
_OVERRIDE = flags.DEFINE_multi_string(
    "override", [], "Backbone config override KEY=VALUE (VALUE as JSON); repeatable."
)
_BASELINE = flags.DEFINE_boolean("baseline", True, "Also measure stock KerasHub.")
_HBM_GB = flags.DEFINE_float(
    "hbm_gb", None, "Per-device budget in GiB. Default: the devices' own limit, if reported."
)
_JSON = flags.DEFINE_string("json", None, "Write the JSON report to this path.")
_PLOT = flags.DEFINE_string("plot", None, "Write a PNG of per-device memory over time.")
_DEVICES = flags.DEFINE_integer(
    "devices", None, "CPU devices to simulate (ignored on TPU/GPU). Default: mesh size or 8."
)
_INTERVAL_MS = flags.DEFINE_float("interval_ms", 2.0, "Memory sampling interval (ms).")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 1800.0, "Time limit per case process (s).")
_PRESET_CACHE = flags.DEFINE_string(
    "preset_cache", None, "Keep and reuse the synthetic preset of the load phase here."
)
_CHECKPOINT_FORMAT = flags.DEFINE_enum(
    "checkpoint_format", "keras", ["keras", "huggingface"],
    "Format of the synthetic checkpoint the load phase writes: a KerasHub preset "
    "or a Hugging Face one (config.json + safetensors).",
)
_QUIET = flags.DEFINE_boolean("quiet", False, "No progress lines.")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from keras_hub_dist.cli import main as cli
    from keras_hub_dist.validate.options import ValidateOptions

    try:
        options = ValidateOptions.from_flags(
            preset=_PRESET.value,
            mesh=_MESH.value,
            dtype=_DTYPE.value,
            phases=_PHASES.value,
            num_layers=_NUM_LAYERS.value,
            override=_OVERRIDE.value,
            baseline=_BASELINE.value,
            hbm_gb=_HBM_GB.value,
            devices=_DEVICES.value,
            interval_ms=_INTERVAL_MS.value,
            timeout_s=_TIMEOUT_S.value,
            preset_cache=_PRESET_CACHE.value,
            checkpoint_format=_CHECKPOINT_FORMAT.value,
        )
        return cli.execute(
            options, json_path=_JSON.value, plot_path=_PLOT.value, quiet=_QUIET.value
        )
    except (ValueError, ImportError, RuntimeError) as e:
        print(f"validate_tpu: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    app.run(main)
