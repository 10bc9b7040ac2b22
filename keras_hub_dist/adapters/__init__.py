"""LoRA adapters in PEFT's format, read into a sharded model.

Above `load/` and `save/`: it maps projections with the Hugging Face
export's mapping (`save.lora_map`) and registers its reader with the
loader (`load_sharded_preset(..., lora_adapter=...)`).
"""

from keras_hub_dist.adapters.peft_lora import ALL_PROJECTIONS, enable_lora, enable_lora_without_values, read_adapter
from keras_hub_dist.load.loader import register_adapter_reader

register_adapter_reader(read_adapter)

__all__ = ["ALL_PROJECTIONS", "enable_lora", "enable_lora_without_values", "read_adapter"]
