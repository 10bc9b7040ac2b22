"""The small files of a Hugging Face export: config.json,
generation_config.json, and a task's tokenizer files.

What KerasHub's `export_to_transformers` writes, through its own functions
(`hf_exporter.export_tokenizer`, `export_image_converter`,
`export_processor_config`, `export_generation_config`), plus:

- generation_config.json for every family (stock writes one for Gemma 3
  only), with the token ids of config.json, as Transformers'
  `GenerationConfig.from_model_config` does;
- tokenizer files for the families KerasHub cannot export, with the stock
  writer of the same tokenizer kind: Qwen 3 / Qwen3-MoE as Qwen 2's
  (`vocab.json`, `merges.txt`), Mixtral as Mistral's (`tokenizer.model`),
  SmolLM3 and gpt-oss as Llama 3's (`tokenizer.json` for
  `PreTrainedTokenizerFast`, which splits text as KerasHub's byte-pair
  tokenizer does).

Example:

```python
write_hf_files("out_dir", backbone, task, mapping.config)
```
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

from keras_hub_dist import _compat

__all__ = ["write_hf_files"]

# Tokenizers KerasHub cannot export -> the stock tokenizer they are written as.
_TOKENIZER_AS = {
    "Qwen3Tokenizer": "QwenTokenizer",
    "Qwen3MoeTokenizer": "QwenTokenizer",
    "MixtralTokenizer": "MistralTokenizer",
    "SmolLM3Tokenizer": "Llama3Tokenizer",
    "GptOssTokenizer": "Llama3Tokenizer",
}
_RENAMES = {
    "QwenTokenizer": ("vocabulary.json", "vocab.json"),
    "MistralTokenizer": ("vocabulary.spm", "tokenizer.model"),
}


def _dump(path: str, data: Any, indent: int = 2) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=indent, ensure_ascii=False)


def _export_tokenizer(tokenizer: Any, directory: str) -> None:
    stock = _compat.stock_hf_exporter()
    name = type(tokenizer).__name__
    if name in stock.MODEL_TOKENIZER_CONFIGS:
        stock.export_tokenizer(tokenizer, directory)
        return
    alias = _TOKENIZER_AS.get(name)
    if alias is None:
        raise ValueError(
            f"Expected a tokenizer keras_hub_dist can export to the Hugging Face format "
            f"({', '.join(sorted(set(stock.MODEL_TOKENIZER_CONFIGS) | set(_TOKENIZER_AS)))}). "
            f"Received: {name}. Set `task.preprocessor = None` to export the model alone."
        )
    # What stock `export_tokenizer` does for `alias`.
    tokenizer.save_assets(directory)
    _dump(os.path.join(directory, "tokenizer_config.json"), stock.MODEL_TOKENIZER_CONFIGS[alias](tokenizer), 4)
    if alias in _RENAMES:
        source, target = _RENAMES[alias]
        shutil.move(os.path.join(directory, source), os.path.join(directory, target))
    if alias == "Llama3Tokenizer":
        _dump(os.path.join(directory, "tokenizer.json"), stock.build_llama3_tokenizer_json(tokenizer))
        for leftover in ("vocabulary.json", "merges.txt"):
            path = os.path.join(directory, leftover)
            if os.path.exists(path):
                os.remove(path)


def _generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {"_from_model_config": True, **{k: config[k] for k in keys if config.get(k) is not None}}


def write_hf_files(directory: str, backbone: Any, task: Any, config: Mapping[str, Any]) -> None:
    """Writes config.json, generation_config.json and (for a task with a
    preprocessor) the tokenizer files into `directory`.

    Raises:
        ValueError: A task whose tokenizer has no Hugging Face form here.
    """
    stock = _compat.stock_hf_exporter()
    _dump(os.path.join(directory, "config.json"), dict(config))
    stock.export_image_converter(backbone, directory)
    stock.export_processor_config(backbone, directory)
    stock.export_generation_config(backbone, directory)
    generation = os.path.join(directory, "generation_config.json")
    if not os.path.exists(generation):
        _dump(generation, _generation_config(config))
    preprocessor = getattr(task, "preprocessor", None) if task is not None else None
    if preprocessor is not None:
        if getattr(preprocessor, "tokenizer", None) is None:
            raise ValueError("CausalLM preprocessor must have a tokenizer.")
        _export_tokenizer(preprocessor.tokenizer, directory)
