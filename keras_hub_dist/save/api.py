"""`save_sharded_preset`: one entry point for both formats.

`format="keras"` writes a KerasHub preset (`save.saver`), `format=
"huggingface"` a Transformers checkpoint (`save.hf_export`); both are written
from every process with no gather, staged, checksummed and published with a
rename.

Example:

```python
keras_hub_dist.save_sharded_preset(lm, "./tuned")                          # KerasHub preset
keras_hub_dist.save_sharded_preset(lm, "./tuned_hf", format="huggingface")  # for vLLM, SGLang, Transformers
```
"""

from __future__ import annotations

import os
from typing import Any

import keras

from keras_hub_dist import _processes
from keras_hub_dist.errors import SaveError
from keras_hub_dist.save import hf_export, remote_hf_export, remote_save, saver
from keras_hub_dist.save.remote_publish import check_url
from keras_hub_dist.storage.locations import is_url

__all__ = ["FORMATS", "save_sharded_preset"]

FORMATS = ("keras", "huggingface")
# `max_shard_size` not given: each format's own default.
_DEFAULT: Any = object()


@_processes.raises_process_lost(SaveError, "the save", _processes.SAVE_LEFT)
def save_sharded_preset(
    model: keras.Model,
    preset_dir: str | os.PathLike,
    *,
    format: str = "keras",  # noqa: A002 - the name users know from the loaders
    overwrite: bool = False,
    progress: bool | None = None,
    max_shard_size: float | int | str | None = _DEFAULT,
    num_threads: int = 2,
    dtype: Any = None,
    durable: bool = False,
) -> None:
    """Saves a (sharded) KerasHub backbone or task, from every process, with
    no gather, as a KerasHub preset or a Hugging Face checkpoint.

    `format="keras"` writes what `model.save_to_preset(preset_dir)` writes:
    config.json, metadata.json, the weights (`model.weights.h5`, or Keras's
    multi-file `model.weights.json` + `model_NNNNN.weights.h5` over
    `max_shard_size` GB), and for a task task.json and its preprocessor's
    files. Stock `from_preset` and `load_sharded_preset` (on any mesh) load
    it.

    `format="huggingface"` writes what `CausalLM.export_to_transformers`
    writes — config.json, generation_config.json, a task's tokenizer files —
    with the weights as `model-0000i-of-0000n.safetensors` shards (split as
    Transformers' `save_pretrained` splits them, `max_shard_size` of
    `None` meaning its `"50GB"`) and `model.safetensors.index.json`.
    Transformers, KerasHub and `load_sharded_preset` read it (tested), and
    so do servers that read Transformers checkpoints (vLLM, SGLang). For the families KerasHub exports (Gemma, Gemma 3, Gemma 4, Llama 3,
    Mistral, Qwen 2, Qwen 3.5, GPT-2) the tensors are those of KerasHub's
    exporter (where it is right, see docs/save.md); Qwen 3, Qwen3-MoE,
    Mixtral, gpt-oss (unquantized), SmolLM3 and Gemma 2 are written by
    inverting KerasHub's importer. A backbone's untied LM head is written
    too (stock `Backbone.export_to_transformers` leaves it out).

    Either way, a LoRA-enabled model saves its merged kernels. Keras
    computes each merge eagerly from replicated LoRA factors: the product
    `lora_a @ lora_b` and its scaled copy are whole on every device for a
    moment (two kernel-sized buffers, one layer at a time); the merged kernel
    is written in the kernel's own sharding. Every process
    of a `jax.distributed` job calls it with the same arguments, on a
    filesystem they share, and writes only the blocks its own devices hold
    (a replicated block once, by one process), with positioned writes into
    preallocated files. Nothing is gathered: no device computes anything;
    the host holds at most one block of a weight (on CPU not even that) plus,
    for the Hugging Face format, a 16 MiB buffer for transposed or cast
    blocks.

    Crash safety: everything is written into a temporary directory beside
    the target (`.<name>.partial-<token>`) that is renamed to `preset_dir`
    only after every process has finished; a failure on any process raises
    `SaveError` on all of them, removes the temporary directory and leaves
    the target untouched. A process killed outright (SIGKILL, a lost
    machine) leaves the temporary directory behind, never a half-written
    target. Beside it an owner record (`.<name>.owner-<token>.json`: host,
    boot, pid and start time of process 0) lets the next save to the same
    target remove it once that save is provably dead: same host and its
    process gone (or its pid now another process's), or the host rebooted
    since. A directory whose save may still run (on another host, or in
    another container of this one) is left alone; every directory removed
    or left is named in a `StaleStagingWarning`. A preset that a killed save
    had moved aside to replace it (`.<name>.replaced-<token>`) is restored
    when the target is missing. Each weights file's checksum is recorded
    (metadata.json, or the index's `metadata` for the Hugging Face format),
    so `load_sharded_preset(..., verify=True)` detects bytes changed later.

    Power loss: the rename is atomic, but without `durable=True` the
    kernel may still hold the written bytes in memory when it returns, so a
    power loss can leave a published preset with files partly written.
    `durable=True` flushes (`fsync`) every file and directory written (each
    process the blocks it wrote, before the processes agree to publish;
    process 0 everything else) and the parent directory before the rename,
    and the parent again after it.

    Args:
        model: A built `keras_hub.models.Backbone` or `Task`.
        preset_dir: The directory to create (its parent is created if
            needed).
        format: `"keras"` or `"huggingface"`.
        overwrite: Replace an existing non-empty `preset_dir` (only once the
            new one is complete).
        progress: Show a progress bar on stderr; default: when stderr is a
            terminal.
        max_shard_size: GB per weights file (a number), or for the Hugging
            Face format also a size such as `"5GB"`. Default: 10 GB as
            `save_to_preset` (Keras; `None` for one file), `"50GB"` as
            Transformers' `save_pretrained` (Hugging Face).
        num_threads: Threads that hash the written files.
        dtype: Hugging Face format only: the dtype of the floating-point
            tensors (e.g. `"bfloat16"`), cast block by block; default: each
            variable's.
        durable: Flush everything to the disk before and after publishing
            (see above). Off by default: it waits until the disk holds the
            whole preset (0.5 s of a 10 s save of 3.8 GB on a VM disk; on a
            physical disk up to the preset's size over its write speed; see
            BENCHMARKS.md).

    Raises:
        SaveError: The model is not a built KerasHub backbone or task, has
            variables without values, or (Hugging Face) is quantized or of a
            family that does not export (the message lists those that do);
            `preset_dir` exists and is not empty (without `overwrite=True`),
            is not a directory, or cannot be written; the processes passed
            different `preset_dir`s; or writing failed on some process.

    Example:

    ```python
    lm = keras_hub_dist.load_sharded_preset("gemma_7b_en", mesh=(1, 8), task="causal_lm")
    keras_hub_dist.save_sharded_preset(lm, "./gemma_7b_hf", format="huggingface")
    ```
    """
    if isinstance(preset_dir, str) and is_url(preset_dir):  # never a local path
        _save_remote(model, preset_dir, format, overwrite, progress, max_shard_size, dtype, durable)
        return
    if format == "keras":
        if dtype is not None:
            raise SaveError(
                f"Expected dtype=None for format='keras' (a preset keeps the model's "
                f"dtype). Received: dtype={dtype!r}. Load the model in that dtype instead."
            )
        saver.save_sharded_preset(
            model, preset_dir, overwrite=overwrite, progress=progress,
            max_shard_size=10 if max_shard_size is _DEFAULT else max_shard_size,
            num_threads=num_threads, durable=durable,
        )
    elif format == "huggingface":
        hf_export.save_huggingface(
            model, preset_dir, overwrite=overwrite, progress=progress,
            max_shard_size=None if max_shard_size is _DEFAULT else max_shard_size,
            num_threads=num_threads, dtype=dtype, durable=durable,
        )
    else:
        raise SaveError(f"Expected format to be one of {FORMATS}. Received: format={format!r}.")


def _save_remote(
    model: Any, url: str, format: str, overwrite: bool, progress: bool | None,  # noqa: A002
    max_shard_size: Any, dtype: Any, durable: bool,
) -> None:
    check_url(url, durable)
    if format not in FORMATS:
        raise SaveError(f"Expected format to be one of {FORMATS}. Received: format={format!r}.")
    if format == "huggingface":
        remote_hf_export.save_huggingface_remote(
            model, url, overwrite=overwrite, progress=progress, dtype=dtype,
            max_shard_size=None if max_shard_size is _DEFAULT else max_shard_size,
        )
        return
    if dtype is not None:
        raise SaveError(
            f"Expected dtype=None for format='keras' (a preset keeps the model's "
            f"dtype). Received: dtype={dtype!r}. Load the model in that dtype instead."
        )
    remote_save.save_keras_remote(
        model, url, overwrite=overwrite, progress=progress,
        max_shard_size=10 if max_shard_size is _DEFAULT else max_shard_size,
    )
