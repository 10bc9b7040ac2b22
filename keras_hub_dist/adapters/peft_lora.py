"""PEFT LoRA adapters into a sharded model: `load_sharded_preset(...,
lora_adapter=...)`, and `enable_lora` in PEFT's form.

The loader indexes the base checkpoint, then hands its model (built without
values) and index to `read_adapter` (registered with `load.loader`), which,
before any device memory is used:

1. reads and checks `adapter_config.json` (`formats.peft.read_config`: a
   PEFT feature not computed here is named) and the safetensors header;
2. matches every tensor with its Transformers module through the Hugging
   Face export's mapping (`save.lora_map`): a module the model lacks, a
   target module the family does not have, or a shape that differs is an
   error naming the tensor, expected and received;
3. either enables LoRA on exactly those projections, in PEFT's form
   (`plan.lora_layers.enable_lora`, rank `r`, `lora_alpha`), its factors
   created without values and added to the index as transposed views of
   the adapter's tensors; or, with `merge=True`, replaces each adapted
   kernel's source by `kernel + scaling * A @ B`, computed per block on the
   host as the block is read.

The loader then plans, reads and places the factors with the base weights,
each device's block straight into its shard.

Example:

```python
lm = keras_hub_dist.load_sharded_preset("./gemma_7b_hf", task="causal_lm", lora_adapter="./adapter")
```
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats import checksums, peft
from keras_hub_dist.formats.base import CheckpointIndex, Index, IndexedVariable, StoredTensorSource, TensorSource, listing, numpy_dtype
from keras_hub_dist.formats.huggingface import checksum_metadata
from keras_hub_dist.formats.safetensors_files import read_header
from keras_hub_dist.formats.transforms import Transpose, reshape
from keras_hub_dist.plan import lora_layers, presets
from keras_hub_dist.shaping.remat import apply_remat, remat_scope
from keras_hub_dist.save.lora_map import LoraModule, lora_modules

__all__ = ["ALL_PROJECTIONS", "enable_lora", "enable_lora_without_values", "read_adapter"]

# The common PEFT choice: every linear projection of a decoder block.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def enable_lora(
    model: Any, rank: int, lora_alpha: float | None = None, target_modules: Sequence[str] = ALL_PROJECTIONS,
    remat: Any = None,
) -> list[str]:
    """Enables LoRA in PEFT's form on the projections PEFT would adapt.

    `Backbone.enable_lora(rank)` adapts the query and value projections in
    Keras's form (one rank-`r` update per head, which PEFT holds only at
    rank `heads * r`: see `save_lora_adapter`); this adapts the projections
    named as Transformers names them, each with one rank-`r` update, exactly
    what a PEFT `LoraConfig(r=rank, lora_alpha=..., target_modules=...)`
    trains. The rest of the backbone is frozen, as `enable_lora` does.
    `lora_A` starts as Keras's (`he_uniform`, `lora_B` zeros), from seeds
    process 0 draws (with Python's `random`, which
    `keras.utils.set_random_seed` seeds) and every process uses: in a job of
    several processes each process drawing its own would give one variable
    different values on different hosts, which JAX refuses.

    Args:
        model: A KerasHub backbone or task (of a family that exports to the
            Hugging Face format).
        rank: The rank `r`.
        lora_alpha: Updates are scaled by `lora_alpha / rank`; default `rank`.
        target_modules: Transformers module names, e.g. `("q_proj", "v_proj")`;
            default: those of q/k/v/o and gate/up/down `_proj` the model has.
        remat: Rematerialization for training the adapters: `None` leaves
            the model's as it is (as built: off unless loaded with
            `remat=`); a `keras.RematScope` mode (`"full"`: each decoder
            block rematerialized, ...) or scope replaces it
            (`shaping.remat.apply_remat`: the decoder blocks only).

    Returns:
        The paths of the layers LoRA was enabled on.

    Raises:
        ValueError: A target module the family does not have, or an unknown
            `remat` mode (both before the model is changed).

    Example:

    ```python
    keras_hub_dist.enable_lora(lm, rank=8, lora_alpha=16)
    lm.fit(data)
    keras_hub_dist.save_lora_adapter(lm, "./adapter")
    ```
    """
    scope = remat_scope(remat)
    backbone = getattr(model, "backbone", model)
    chosen = _chosen_layers(backbone, target_modules)
    if scope is not None:
        apply_remat(backbone, scope)
    _freeze_except(backbone, chosen)
    seed = int(_processes.broadcast_string(str(random.getrandbits(31))))
    for i, layer in enumerate(chosen):
        # Keras's "he_uniform", with a seed every process agrees on.
        he_uniform = keras.initializers.VarianceScaling(2.0, "fan_in", "uniform", seed=seed + i)
        lora_layers.enable_lora(layer, rank, lora_alpha, a_initializer=he_uniform)
    return [layer.path for layer in chosen]


def enable_lora_without_values(
    model: Any, rank: int, lora_alpha: float | None = None, target_modules: Sequence[str] = ALL_PROJECTIONS
) -> list[Any]:
    """`enable_lora` on a model built without values (a plan): the same
    layers adapted and frozen, the factors created without values.

    Returns:
        The factor variables created, still without values.
    """
    backbone = getattr(model, "backbone", model)
    chosen = _chosen_layers(backbone, target_modules)
    _freeze_except(backbone, chosen)
    with _compat.creating_variables_without_values() as created:
        for layer in chosen:
            lora_layers.enable_lora(layer, rank, lora_alpha)
    return created


def _chosen_layers(backbone: Any, target_modules: Sequence[str]) -> list[Any]:
    modules = lora_modules(backbone)
    if target_modules is ALL_PROJECTIONS:
        # The default: each of them the model has (gpt-oss's experts are
        # stacked banks, not projections PEFT adapts).
        present = {m.target for _, m in modules}
        target_modules = tuple(t for t in ALL_PROJECTIONS if t in present)
    _check_targets(tuple(target_modules), modules, ValueError)
    return [layer for layer, m in modules if m.target in set(target_modules)]


def _freeze_except(backbone: Any, layers: list[Any]) -> None:
    """As `Backbone.enable_lora`: everything frozen but the adapted layers
    (whose kernels Keras's `enable_lora` freezes in turn)."""
    backbone.trainable = True
    for layer in backbone._flatten_layers(include_self=False):
        layer.trainable = False
    for layer in layers:
        layer.trainable = True


def _check_targets(targets: tuple[str, ...] | str, modules: list[tuple[Any, LoraModule]], error: type) -> None:
    if isinstance(targets, str):  # a regex, as PEFT allows: the tensors say what it matched
        return
    known = sorted({m.target for _, m in modules})
    missing = [t for t in targets if t not in known]
    if missing:
        raise error(
            f"Expected target modules the model has ({', '.join(known)}). Received: "
            f"{', '.join(repr(t) for t in missing)}, which this model does not have."
        )


class LoraMerged(TensorSource):
    """`kernel + scaling * update(A, B)`, block by block: the kernel's block
    from its own source, the small factors read once and kept."""

    def __init__(self, kernel: TensorSource, a: TensorSource, b: TensorSource, scaling: float, inputs: tuple[int, ...]) -> None:
        self.kernel, self.a, self.b, self.scaling, self.inputs = kernel, a, b, scaling, inputs
        self.shape = tuple(kernel.shape)
        self.dtype = np.result_type(np.dtype(kernel.dtype), np.float32)
        self.description = f"{kernel.description} + LoRA ({a.description})"
        self._factors: tuple[np.ndarray, np.ndarray] | None = None

    def read(self, index: Index) -> np.ndarray:
        if self._factors is None:
            whole = lambda s: s.read(tuple((0, d) for d in s.shape)).astype(np.float32)  # noqa: E731
            self._factors = (whole(self.a), whole(self.b))
        a, b = self._factors
        outputs = [i for i in range(len(self.shape)) if i not in self.inputs]
        a = a[tuple(slice(*index[i]) for i in self.inputs)]
        out_sizes = [self.shape[i] for i in outputs]
        b = b.reshape([b.shape[0]] + out_sizes)[(slice(None),) + tuple(slice(*index[i]) for i in outputs)]
        update = np.tensordot(a, b, axes=1)
        order = list(self.inputs) + outputs
        update = np.transpose(update, [order.index(i) for i in range(len(self.shape))])
        block = self.kernel.read(index).astype(self.dtype)
        block += (self.scaling * update).astype(self.dtype)
        return block

    def read_nbytes(self, index: Index) -> int:
        return self.kernel.read_nbytes(index)

    def union_read_helps(self, indices: Sequence[Index]) -> bool:
        return False


def _read_config(location: Any, label: str) -> peft.AdapterConfig:
    try:  # bounded, and a JSON object, as config.json is
        parsed = presets.read_json_object(location, peft.ADAPTER_CONFIG)
    except FileNotFoundError as e:
        raise PresetError(
            f"Expected a PEFT adapter directory holding {peft.ADAPTER_CONFIG!r} and "
            f"{peft.ADAPTER_WEIGHTS!r}. Received: {label!r} without {peft.ADAPTER_CONFIG} ({e})."
        ) from None
    return peft.read_config(parsed, label)


def _factors(location: Any, label: str, config: peft.AdapterConfig, modules: dict[str, tuple[Any, LoraModule]], family: str) -> tuple[Any, dict]:
    """The adapter's file and, per module, its `(A, B)` stored tensors,
    checked against the model."""
    if not location.has(peft.ADAPTER_WEIGHTS):
        raise PresetError(
            f"Expected {peft.ADAPTER_WEIGHTS!r} in the adapter {label!r}. Received: "
            f"{'only adapter_model.bin (convert it with peft to safetensors)' if location.has('adapter_model.bin') else 'no weights file'}."
        )
    header = read_header(location.open(peft.ADAPTER_WEIGHTS))
    found: dict[str, dict[str, Any]] = {}
    problems = []
    targets = {m.target for _, m in modules.values()}
    for name, stored in header.tensors.items():
        parsed = peft.module_of(name)
        if parsed is None:
            problems.append(f"{name}: not a LoRA factor of a linear module (lora_A / lora_B)")
            continue
        module, factor = parsed
        if module not in modules:
            target = module.rsplit(".", 1)[-1]
            why = (f"target module {target!r} is not one a {family} has ({', '.join(sorted(targets))})"
                   if target not in targets else f"the {family} has no module {module!r}")
            problems.append(f"{name}: {why}")
            continue
        m = modules[module][1]
        expected = (config.rank, m.in_features) if factor == "A" else (m.out_features, config.rank)
        if tuple(stored.shape) != expected:
            problems.append(f"{name}: expected shape {expected}, received {tuple(stored.shape)}")
            continue
        if not np.issubdtype(np.dtype(stored.dtype), np.floating) and stored.dtype.name != "bfloat16":
            problems.append(f"{name}: expected a floating-point tensor, received {stored.dtype}")
            continue
        found.setdefault(module, {})[factor] = stored
    for module, pair in found.items():
        if len(pair) != 2:
            problems.append(f"{module}: only lora_{next(iter(pair))} in the file, expected lora_A and lora_B")
    if problems:
        raise PresetError(
            f"Expected an adapter for this {family} (r={config.rank}). Received: {label!r} with "
            f"{len(problems)} tensor(s) that do not fit:" + listing(problems)
        )
    if not found:
        raise PresetError(f"Expected LoRA factors in {label}/{peft.ADAPTER_WEIGHTS}. Received: none.")
    return header, found


def _verify(location: Any, label: str, header: Any, num_threads: int) -> None:
    """Checks the weights file against the checksums `save_lora_adapter`
    recorded beside it."""
    recorded = checksum_metadata(location, peft.ADAPTER_INDEX)
    if not recorded:
        raise PresetError(
            f"Cannot verify the adapter {label!r}: expected the checksums that "
            f"`save_lora_adapter` records in {peft.ADAPTER_INDEX!r}. Received: an adapter "
            f"without {'them' if location.has(peft.ADAPTER_INDEX) else 'that file'} (PEFT's "
            "`save_pretrained` writes none). Load it with verify=False."
        )
    file = header.opened if header.opened is not None else header.file
    checksums.verify_files([file], recorded, label, num_threads=num_threads)


def read_adapter(
    backbone: Any, index: CheckpointIndex, location: Any, label: str, merge: bool,
    verify: bool = False, num_threads: int = 2,
) -> tuple[CheckpointIndex, list[Any]]:
    """Adds the adapter at `location` to the load of `backbone` (see the
    module): `(index, variables created without values)`. With `verify`,
    first checks its weights file against its recorded checksums.

    Raises:
        PresetError: No adapter there, a PEFT feature not computed here, a
            target module or module the model lacks, a tensor of another
            shape (named, expected and received); with `verify`, no
            recorded checksums or a file that differs from them.
    """
    config = _read_config(location, label)
    family = type(backbone).__name__
    modules = {m.module: (layer, m) for layer, m in lora_modules(backbone)}
    _check_targets(config.target_modules, list(modules.values()), PresetError)
    header, found = _factors(location, label, config, modules, family)
    if verify:
        _verify(location, label, header, num_threads)
    description = f"{label}/{peft.ADAPTER_WEIGHTS}"

    def sources(module: str) -> tuple[TensorSource, TensorSource]:
        stored = found[module]
        layer, m = modules[module]
        in_shape = tuple(m.kernel_shape[i] for i in m.inputs)
        a = reshape(Transpose(StoredTensorSource(stored["A"], f"{description} {peft.tensor_name(module, 'A')}"), (1, 0)),
                    in_shape + (config.rank,))
        b = Transpose(StoredTensorSource(stored["B"], f"{description} {peft.tensor_name(module, 'B')}"), (1, 0))
        return a, b

    entries = list(index.entries)
    created: list[Any] = []
    if merge:
        position = {id(e.variable): i for i, e in enumerate(entries)}
        for module in found:
            layer, m = modules[module]
            i = position[id(layer._kernel)]
            merged = LoraMerged(entries[i].source, *sources(module), config.scaling, m.inputs)
            entries[i] = IndexedVariable(entries[i].path, entries[i].shape, entries[i].dtype, merged, entries[i].variable)
    else:
        layers = [modules[module][0] for module in found]
        _freeze_except(backbone, layers)
        # Keras scales by lora_alpha / rank: PEFT's own numbers where it does
        # too, the scaling times the rank under rsLoRA.
        alpha = config.scaling * config.rank if config.raw.get("use_rslora") else config.lora_alpha
        with _compat.creating_variables_without_values() as created:
            for layer in layers:
                lora_layers.enable_lora(layer, config.rank, alpha)
        for module in found:
            layer = modules[module][0]
            for variable, source in zip((layer.lora_kernel_a, layer.lora_kernel_b), sources(module)):
                shape = tuple(int(d) for d in variable.shape)
                entries.append(IndexedVariable(variable.path, shape, numpy_dtype(variable.dtype), source, variable))
    adapter_bytes = sum(s.nbytes for pair in found.values() for s in pair.values())
    return (
        CheckpointIndex(
            files=index.files + (header.file,),
            entries=tuple(entries),
            total_bytes=index.total_bytes + adapter_bytes,
            format=index.format,
            opened=index.opened + ((header.opened,) if index.opened else ()),
        ),
        created,
    )
