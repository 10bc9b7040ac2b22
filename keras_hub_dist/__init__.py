"""Initialize and load KerasHub LLMs straight into their shards.

Example:

```python
import keras
import keras_hub_dist

model = keras_hub_dist.load_sharded_preset("gemma_7b_en", mesh=(1, 8))
keras_hub_dist.save_sharded_preset(model, "./my_gemma")  # from every process

# Resume training from a keras.callbacks.OrbaxCheckpoint directory.
model.compile(optimizer=keras.optimizers.Adam(5e-5))
keras_hub_dist.restore_checkpoint(model, "./ckpt")
```
"""

import os as _os

# The package is JAX-only: pick the JAX backend unless the user chose one
# (this only takes effect when keras has not been imported yet; the
# `keras-hub-dist` command relies on it).
_os.environ.setdefault("KERAS_BACKEND", "jax")

from keras_hub_dist._compat import require_jax_backend as _require_jax_backend  # noqa: E402

_require_jax_backend()

from keras_hub_dist import initializers  # noqa: E402
from keras_hub_dist import memory  # noqa: E402
from keras_hub_dist import presets  # noqa: E402
from keras_hub_dist import registry  # noqa: E402
from keras_hub_dist.plan.abstract import abstract_backbone  # noqa: E402
from keras_hub_dist.init.factories import gemma3_backbone  # noqa: E402
from keras_hub_dist.init.factories import gemma4_backbone  # noqa: E402
from keras_hub_dist.init.factories import gemma_backbone  # noqa: E402
from keras_hub_dist.init.factories import gpt_oss_backbone  # noqa: E402
from keras_hub_dist.init.factories import llama_backbone  # noqa: E402
from keras_hub_dist.init.factories import mistral_backbone  # noqa: E402
from keras_hub_dist.init.factories import mixtral_backbone  # noqa: E402
from keras_hub_dist.init.factories import qwen3_5_backbone  # noqa: E402
from keras_hub_dist.init.factories import qwen3_5_moe_backbone  # noqa: E402
from keras_hub_dist.init.factories import qwen3_backbone  # noqa: E402
from keras_hub_dist.init.factories import qwen3_moe_backbone  # noqa: E402
from keras_hub_dist.init.factories import qwen_backbone  # noqa: E402
from keras_hub_dist.errors import CheckpointError  # noqa: E402
from keras_hub_dist.errors import GenerateFallbackWarning  # noqa: E402
from keras_hub_dist.errors import KerasHubDistWarning  # noqa: E402
from keras_hub_dist.errors import LayoutError  # noqa: E402
from keras_hub_dist.errors import LayoutFallbackWarning  # noqa: E402
from keras_hub_dist.errors import UnconvertedWeightsWarning  # noqa: E402
from keras_hub_dist.errors import MissingLayoutWarning  # noqa: E402
from keras_hub_dist.errors import PlanError  # noqa: E402
from keras_hub_dist.errors import PresetError  # noqa: E402
from keras_hub_dist.errors import ProcessLostError  # noqa: E402
from keras_hub_dist._processes import initialize  # noqa: E402
from keras_hub_dist.errors import QuantizationError  # noqa: E402
from keras_hub_dist.errors import SaveError  # noqa: E402
from keras_hub_dist.errors import RemoteDownloadWarning  # noqa: E402
from keras_hub_dist.errors import StaleStagingWarning  # noqa: E402
from keras_hub_dist.errors import UnknownPresetError  # noqa: E402
from keras_hub_dist.init.initializers import DistributedGlorotNormal  # noqa: E402
from keras_hub_dist.init.initializers import DistributedGlorotUniform  # noqa: E402
from keras_hub_dist.init.initializers import DistributedHeNormal  # noqa: E402
from keras_hub_dist.init.initializers import DistributedHeUniform  # noqa: E402
from keras_hub_dist.init.initializers import DistributedLecunNormal  # noqa: E402
from keras_hub_dist.init.initializers import DistributedLecunUniform  # noqa: E402
from keras_hub_dist.init.initializers import DistributedRandomNormal  # noqa: E402
from keras_hub_dist.init.initializers import DistributedRandomUniform  # noqa: E402
from keras_hub_dist.init.initializers import DistributedTruncatedNormal  # noqa: E402
from keras_hub_dist.init.initializers import DistributedVarianceScaling  # noqa: E402
from keras_hub_dist.plan.layouts import get_layout_map  # noqa: E402
from keras_hub_dist.plan.quantized_layouts import QuantizationAwareModelParallel  # noqa: E402
from keras_hub_dist.load.loader import LoadReport  # noqa: E402
from keras_hub_dist.load.loader import load_sharded_preset  # noqa: E402
from keras_hub_dist.shaping.generate import lower_generate  # noqa: E402
from keras_hub_dist.shaping.generate import shard_generate  # noqa: E402
from keras_hub_dist.load.restore import restore_checkpoint  # noqa: E402
from keras_hub_dist.save.api import save_sharded_preset  # noqa: E402
from keras_hub_dist.convert.file_to_file import convert_checkpoint  # noqa: E402
from keras_hub_dist.save.lora_adapter import save_lora_adapter  # noqa: E402
from keras_hub_dist.adapters import enable_lora  # noqa: E402
from keras_hub_dist.measure.memory import MemorySampler  # noqa: E402
from keras_hub_dist.plan.auto_layout import LayoutPlan  # noqa: E402
from keras_hub_dist.plan.auto_layout import plan_layout  # noqa: E402
from keras_hub_dist.jobs.memory_plan import MemoryPlan  # noqa: E402
from keras_hub_dist.jobs.memory_plan import plan_memory  # noqa: E402
from keras_hub_dist.formats.synthetic import write_synthetic_preset  # noqa: E402
from keras_hub_dist.formats.synthetic_hf import write_synthetic_hf_checkpoint  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "DistributedGlorotNormal",
    "DistributedGlorotUniform",
    "DistributedHeNormal",
    "DistributedHeUniform",
    "DistributedLecunNormal",
    "DistributedLecunUniform",
    "DistributedRandomNormal",
    "DistributedRandomUniform",
    "DistributedTruncatedNormal",
    "DistributedVarianceScaling",
    "GenerateFallbackWarning",
    "KerasHubDistWarning",
    "LayoutError",
    "LayoutFallbackWarning",
    "UnconvertedWeightsWarning",
    "LayoutPlan",
    "LoadReport",
    "MemoryPlan",
    "MemorySampler",
    "MissingLayoutWarning",
    "PlanError",
    "PresetError",
    "ProcessLostError",
    "QuantizationAwareModelParallel",
    "QuantizationError",
    "SaveError",
    "RemoteDownloadWarning",
    "StaleStagingWarning",
    "UnknownPresetError",
    "abstract_backbone",
    "convert_checkpoint",
    "enable_lora",
    "gemma3_backbone",
    "gemma4_backbone",
    "gemma_backbone",
    "get_layout_map",
    "gpt_oss_backbone",
    "initialize",
    "initializers",
    "llama_backbone",
    "load_sharded_preset",
    "lower_generate",
    "memory",
    "mistral_backbone",
    "mixtral_backbone",
    "plan_layout",
    "plan_memory",
    "presets",
    "qwen3_5_backbone",
    "qwen3_5_moe_backbone",
    "qwen3_backbone",
    "qwen3_moe_backbone",
    "qwen_backbone",
    "registry",
    "restore_checkpoint",
    "save_lora_adapter",
    "save_sharded_preset",
    "shard_generate",
    "write_synthetic_hf_checkpoint",
    "write_synthetic_preset",
]
