"""Save a LoRA fine-tune as a PEFT adapter, from every process, with no
gather: `save_lora_adapter`.

The adapter is what vLLM (`--enable-lora`), SGLang and Transformers +
`peft` load on top of the base model exported to the Hugging Face format:
`adapter_config.json` and `adapter_model.safetensors`, a few MB where the
merged export is the whole model. The steps are the Hugging Face export's
(`save.hf_export`), on the LoRA factors only:

1. every process agrees on the target and the model, and finds each
   LoRA-enabled projection's Transformers module (`save.lora_map`, from the
   export's own mapping);
2. process 0 creates the staging directory beside the target (owner record,
   sweep of what dead saves left: `save.staging`), `adapter_config.json` and
   the safetensors file, header written and data a hole;
3. each distinct block of each factor is written once, by one process
   holding it (`save.write_plan.block_owners`), through the pieces of the
   tensor it lands in (`formats.pieces`), transposed on the host;
4. the file is hashed (each process a share of the chunks) and the checksum
   recorded in `adapter_model.safetensors.index.json`;
5. process 0 publishes the directory with a rename.

Into a bucket (`s3://`, `gs://`), the same bytes go straight into the
objects, as the Hugging Face export's do
(`save.remote_hf_export.upload_safetensors`): process 0 claims the target
(it must hold nothing, or `overwrite=True`) before any byte is uploaded;
the safetensors file is one multipart upload, each process writing the
blocks the same plan gives it (a replicated factor's blocks spread over
the processes, `block_owners`) into a zeroed part buffer, summed onto the
part's owner (an adapter is usually one part, under 5 MiB: the last part
may be that small); its checksums are hashed from the parts as they are
uploaded. Process 0 completes the upload, then writes the index and
`adapter_config.json` last, so the adapter is readable only once whole; a
failure anywhere aborts every upload.

Keras's own LoRA on a projection with several output axes (KerasHub's
default query / value targets: a kernel `(hidden, heads, head_dim)`) is one
rank-`r` update per head sharing `B` (`plan.lora_layers`). PEFT holds it
exactly at rank `heads * r`, with `lora_B` block diagonal; every module of
an adapter then has the largest such rank, zero-padded (vLLM and PEFT read
one rank per adapter), and `lora_alpha = scale * rank`, so that PEFT
computes what the Keras model computes. LoRA enabled in PEFT's own form
(`keras_hub_dist.enable_lora`, or loaded with
`load_sharded_preset(..., lora_adapter=...)`) is written at its own rank.

Example:

```python
keras_hub_dist.save_lora_adapter(lm, "./my_adapter", base_model_name_or_path="google/gemma-7b")
peft.PeftModel.from_pretrained(transformers_model, "./my_adapter")
keras_hub_dist.save_lora_adapter(lm, "gs://my-bucket/adapters/v1")
```
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import SaveError
from keras_hub_dist.formats import peft
from keras_hub_dist.formats.pieces import Atom, Piece, canonical
from keras_hub_dist.formats.safetensors_writer import SafetensorsLayout, TensorSpec, create_files, plan_files
from keras_hub_dist.plan.lora_layers import LoraForm, lora_form
from keras_hub_dist.save import staging
from keras_hub_dist.save.hf_export import BlockPlan, checksummed_index, plan_blocks
from keras_hub_dist.save.hf_mapping import HfMapping
from keras_hub_dist.save.lora_map import LoraModule, lora_modules
from keras_hub_dist.save.piece_write import PieceWriter
from keras_hub_dist.save.remote_hf_export import RemoteFiles, upload_safetensors
from keras_hub_dist.save.remote_publish import agreed_url, check_url
from keras_hub_dist.save.saver import (
    _agreed_target,
    _backbone_and_task,
    _create_staging,
    _device_indices,
    _guard,
    _local_digests,
    _model_error,
    _walk_writes,
    claim_target,
)
from keras_hub_dist.storage import host_io
from keras_hub_dist.storage.locations import is_url
from keras_hub_dist.storage.ranged_http import RangeClient
from keras_hub_dist.storage.uploads import open_writer

__all__ = ["INDEX_FILE", "adapter_mapping", "save_lora_adapter"]

INDEX_FILE = peft.ADAPTER_INDEX


def _strides(sizes: list[int]) -> list[int]:
    return [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]


def _factor_pieces(name_a: str, name_b: str, form: LoraForm, module: LoraModule, rank: int) -> tuple[list, list]:
    """The pieces of Keras's `A` in `lora_A (rank, in)` and of `B` in
    `lora_B (out, rank)`, for a layer of `form` (rows past the layer's own
    rank stay zero: the file's holes)."""
    shape, size_in = form.kernel_shape, module.in_features
    in_steps = dict(zip(form.inputs, _strides([shape[i] for i in form.inputs])))
    if not form.heads:  # A (in..., r) -> lora_A[rr, in]; B (r, out) -> lora_B[out, rr]
        a_atoms = (Atom(size_in, form.rank, 1), Atom(form.rank, 1, size_in))
        b_atoms = (Atom(form.rank, module.out_features, 1), Atom(module.out_features, 1, rank))
        return [Piece((name_a, 0), 0, 0, a_atoms)], [Piece((name_b, 0), 0, 0, b_atoms)]
    # Keras's form: A (kernel[:-1]..., r), B (r, last). lora_A's row of head
    # e, factor rr is e * r + rr; lora_B is block diagonal, B once per head.
    a_axes = list(shape[:-1]) + [form.rank]
    head_steps = dict(zip(form.heads, _strides([shape[i] for i in form.heads])))
    a_atoms = tuple(
        Atom(d, step, in_steps[i] if i in in_steps else head_steps[i] * form.rank * size_in)
        for i, (d, step) in enumerate(zip(a_axes[:-1], _strides(a_axes)))
    ) + (Atom(form.rank, 1, size_in),)
    last = shape[-1]
    b_atoms = (Atom(form.rank, last, 1), Atom(last, 1, rank))
    heads = math.prod(shape[i] for i in form.heads)
    b_pieces = [Piece((name_b, 0), 0, e * last * rank + e * form.rank, b_atoms) for e in range(heads)]
    return [canonical(Piece((name_a, 0), 0, 0, a_atoms))], [canonical(p) for p in b_pieces]


def adapter_mapping(backbone: Any) -> tuple[HfMapping, list[Any], int, float]:
    """The adapter of `backbone`'s LoRA-enabled layers, without values:
    `(mapping of the factors, the factor variables, rank, lora_alpha)`.

    Raises:
        SaveError: No LoRA-enabled layer; one that is no Transformers
            linear module, or of a form neither Keras's nor PEFT's; layers
            with different scales (`lora_alpha / rank`), which one adapter
            cannot hold.
    """
    enabled = [l for l in _compat.leaf_layers(backbone) if getattr(l, "lora_enabled", False)]
    if not enabled:
        raise SaveError(
            "Expected a model with LoRA enabled (`backbone.enable_lora(rank)` or "
            "`keras_hub_dist.enable_lora(model, rank)`). Received: no LoRA-enabled layer."
        )
    modules = {id(layer): m for layer, m in lora_modules(backbone)}
    found, problems = [], []
    for layer in enabled:
        form, module = lora_form(layer), modules.get(id(layer))
        if module is None or form is None:
            problems.append(
                f"{layer.path}: " + ("no Transformers linear module holds its kernel" if module is None
                                     else f"LoRA factors {tuple(layer.lora_kernel_a.shape)}, "
                                     f"{tuple(layer.lora_kernel_b.shape)} of neither Keras's nor PEFT's form")
            )
        else:
            found.append((layer, form, module))
    scales = sorted({form.scale for _, form, _ in found})
    if len(scales) > 1:
        problems.append(f"layers scale their updates differently (lora_alpha / rank: {scales}); one adapter has one scale")
    if problems:
        raise SaveError(
            "Expected LoRA only on projections a PEFT adapter can hold. Received: "
            + "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "") + "."
        )
    rank = max(form.peft_rank for _, form, _ in found)
    tensors, pieces, shapes, variables = [], {}, {}, []
    for layer, form, module in found:
        a, b = layer.lora_kernel_a, layer.lora_kernel_b
        for variable, factor, shape in ((a, "A", (rank, module.in_features)), (b, "B", (module.out_features, rank))):
            tensors.append(TensorSpec(peft.tensor_name(module.module, factor), shape, np.dtype(variable.dtype)))
            shapes[variable.path] = tuple(int(d) for d in variable.shape)
            variables.append(variable)
        a_pieces, b_pieces = _factor_pieces(a.path, b.path, form, module, rank)
        pieces[a.path] = tuple((tensors[-2].name, p) for p in a_pieces)
        pieces[b.path] = tuple((tensors[-1].name, p) for p in b_pieces)
    config = {"targets": sorted({m.target for _, _, m in found})}
    mapping = HfMapping(config, tuple(tensors), pieces, shapes, (), "keras_hub_dist")
    return mapping, variables, rank, scales[0] * rank


def _layout(tensors: tuple[TensorSpec, ...]) -> SafetensorsLayout:
    """One file, `adapter_model.safetensors`, as `peft` writes it."""
    layout = plan_files(tensors, max(1, sum(t.nbytes for t in tensors)) * 2)
    return SafetensorsLayout((dataclasses.replace(layout.files[0], name=peft.ADAPTER_WEIGHTS),), layout.tensors)


def _checked_adapter(model: Any) -> tuple[HfMapping, list[Any], int, float]:
    """`adapter_mapping` of the model's backbone, run by every process;
    `SaveError` on every process if it failed on one."""
    backbone, _ = _backbone_and_task(model)
    _processes.check_all(_model_error(model), SaveError, "Cannot save the adapter")
    found: list[Any] = []
    error = _guard(lambda: found.append(adapter_mapping(backbone)))
    _processes.check_all(error, SaveError, "Mapping the LoRA layers to a PEFT adapter failed")
    return found[0]


def _write_config(folder: str, text: str) -> None:
    with open(os.path.join(folder, peft.ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        f.write(text)


def _indices(variables: list[Any], mapping: HfMapping) -> dict[str, Any]:
    """Factor -> device -> the block it holds."""
    return {v.path: _device_indices(_compat.variable_array(v).sharding, mapping.shapes[v.path]) for v in variables}


class _Factors:
    """The factors' arrays by variable path (`RemoteFiles.values`)."""

    def __init__(self, variables: list[Any]) -> None:
        self._variables = {v.path: v for v in variables}

    def __call__(self, path: str) -> Any:
        return _compat.variable_array(self._variables[path])

    def release(self) -> None:
        pass


def _save_remote(model: Any, url: str, base_model_name_or_path: str | None, overwrite: bool,
                 progress: bool | None) -> None:
    """`save_lora_adapter` into a bucket: the safetensors export's upload
    (`save.remote_hf_export.upload_safetensors`: target claimed before any
    byte, each process uploading the blocks it was given by the same plan
    as the local save, every upload aborted on a failure), with
    `adapter_config.json` written last."""
    agreed_url(url, "adapter_dir")
    mapping, variables, rank, alpha = _checked_adapter(model)
    layout = _layout(mapping.tensors)
    text = peft.adapter_config_json(rank, alpha, mapping.config["targets"], base_model_name_or_path)
    files = RemoteFiles(
        mapping, layout,
        indices=lambda: _indices(variables, mapping),
        values=lambda: _Factors(variables),
        write_files=lambda folder: _write_config(folder, text),
        index_file=INDEX_FILE, config=peft.ADAPTER_CONFIG, label="Saving adapter",
    )
    with RangeClient(process_index=jax.process_index()) as client:
        upload_safetensors(url, open_writer(url, client), overwrite, progress, lambda: files, what="adapter")


def _write(variables: list[Any], plans: dict[str, list[BlockPlan]], progress: bool | None, base: str, durable: bool) -> str | None:
    """Writes this process's blocks of the factors; its first error as a message."""
    files = host_io.FileDescriptors(os.O_WRONLY)
    writer = PieceWriter(files)
    bar = byte_progress(sum(b.nbytes for p in plans.values() for b in p), f"Saving adapter {base}", progress)
    error: list[str] = []

    def walk() -> None:
        for variable in variables:
            array = _compat.variable_array(variable)
            shards = {s.device.id: s for s in array.addressable_shards}
            for block in plans.get(variable.path, ()):
                host = _compat.host_array(shards[block.device_id].data) if block.device_id is not None else np.asarray(array)
                writer.write(host, block.writes)
                bar.update(block.nbytes)

    return _walk_writes(walk, files, bar, durable, error)


@_processes.raises_process_lost(SaveError, "the adapter save", _processes.SAVE_LEFT)
def save_lora_adapter(
    model: Any,
    adapter_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    num_threads: int = 2,
    durable: bool = False,
) -> None:
    """Saves the LoRA factors of a model as a PEFT adapter directory.

    Run by every process of the job (one process is fine too), on a
    filesystem they share or into a bucket: each writes only the factor
    blocks its devices hold, nothing is gathered. The adapter loads with
    `peft.PeftModel.from_pretrained(base, adapter_dir)`, vLLM's
    `--enable-lora --lora-modules name=adapter_dir` or
    `load_sharded_preset(base, lora_adapter=adapter_dir)` on top of the
    same base model in the Hugging Face format
    (`save_sharded_preset(..., format="huggingface")` of the model before
    its fine-tune, or the checkpoint it was loaded from), and computes what
    the Keras model computes.

    Args:
        model: A KerasHub backbone or task with LoRA enabled
            (`backbone.enable_lora(rank)`, `layer.enable_lora(rank,
            lora_alpha=...)`, `keras_hub_dist.enable_lora`, or loaded with
            `lora_adapter=`).
        adapter_dir: The directory to create, or a bucket prefix
            (`"s3://bucket/prefix"`, `"gs://bucket/prefix"`) to write the
            same files into, straight from every process.
        base_model_name_or_path: Recorded in `adapter_config.json` (the
            Hub name or path of the base model).
        overwrite: Replace an existing non-empty directory, once the new
            adapter is complete.
        progress: A progress bar on stderr; default: when stderr is a terminal.
        num_threads: Threads that hash the written file.
        durable: fsync the files and directories before and after
            publishing (local directories only: an object is durable once
            written).

    Raises:
        SaveError: Not a KerasHub model, no LoRA-enabled layer, LoRA on a
            layer that is no Transformers linear module, layers with
            different scales, a family that does not export to the Hugging
            Face format, a target that exists or holds objects (without
            `overwrite`) or cannot be written (a bucket that does not
            exist, `hf://`), `durable=True` into a bucket, all before any
            byte is written; writing or uploading failed on some process
            (nothing is published then, every upload is aborted).

    Example:

    ```python
    lm.backbone.enable_lora(rank=8)
    lm.fit(data)
    keras_hub_dist.save_lora_adapter(lm, "./adapter", base_model_name_or_path="google/gemma-7b")
    ```
    """
    if isinstance(adapter_dir, str) and is_url(adapter_dir):  # never a local path
        check_url(adapter_dir, durable, "adapter_dir")
        _save_remote(model, adapter_dir, base_model_name_or_path, overwrite, progress)
        return
    target = _agreed_target(adapter_dir)
    mapping, variables, rank, alpha = _checked_adapter(model)
    claim_target(target, overwrite)
    layout = _layout(mapping.tensors)
    parent, base = os.path.split(target)
    token = _processes.broadcast_string(secrets.token_hex(6))
    folder = staging.staging_path(parent, base, token)
    paths = [os.path.join(folder, peft.ADAPTER_WEIGHTS)]
    try:
        error = None
        if jax.process_index() == 0:
            def prepare() -> None:
                created = _create_staging(target, token, durable)
                _write_config(created, peft.adapter_config_json(
                    rank, alpha, mapping.config["targets"], base_model_name_or_path))
                create_files(layout, created)

            error = _guard(prepare)
        _processes.check_all(error, SaveError, f"Preparing {folder!r} failed")

        plans: dict[str, list[BlockPlan]] = {}

        def plan() -> None:
            indices = _indices(variables, mapping)
            plans.update(plan_blocks(
                mapping, layout, folder, indices,
                process_index=jax.process_index(), process_count=jax.process_count(),
            )[0])
            if not os.path.exists(paths[0]):
                raise SaveError(
                    f"Process {jax.process_index()} cannot see {paths[0]!r}, which process 0 "
                    "created. Expected every process to share the filesystem of adapter_dir."
                )

        _processes.check_all(_guard(plan), SaveError, "Planning the writes failed")
        _processes.check_all(_write(variables, plans, progress, base, durable), SaveError, "Writing the adapter failed")

        table: list[np.ndarray] = []
        error = _guard(lambda: table.append(_local_digests(paths, num_threads)))
        _processes.check_all(error, SaveError, "Hashing the adapter failed")
        digests = _processes.sum_over_processes(table[0])

        if jax.process_index() == 0:
            def finish() -> None:
                with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
                    f.write(checksummed_index(layout, paths, digests))
                _processes.reached("publish")
                staging.publish(folder, target, token, durable=durable)

            error = _guard(finish)
        _processes.check_all(error, SaveError, f"Publishing {target!r} failed")
    finally:
        if jax.process_index() == 0:
            staging.discard(target, token)
