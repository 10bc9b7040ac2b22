"""Which bytes of which Hugging Face tensor every variable element becomes.

One source of truth, KerasHub's, replayed without values:

- the layout (tensor names, shapes, state-dict order) and config.json come
  from KerasHub's exporter for the families it exports
  (`get_*_weights_map`, `get_*_config`), with the corrections of
  `save.hf_families`, and from `save.hf_families` for the families it
  only imports (Qwen 3, Qwen3-MoE, Mixtral, gpt-oss, SmolLM3, Gemma 2);
- the element mapping is KerasHub's *import* converter traced on that
  layout (`formats.huggingface.trace_sources`: the converter runs on lazy
  tensors standing for the files about to be written) and inverted
  (`formats.pieces.invert`): each piece says which elements of a variable
  land where in a tensor. So a checkpoint we write is, by construction, one
  that KerasHub reads back into the same variables.
- For the families KerasHub exports, its `get_*_weights_map` is also
  replayed, on variables that are lazy arrays (`keras.ops` inside the
  exporter module stands in for NumPy for the duration, and so does
  `Variable.__getitem__`), and its pieces are compared with the inverted
  converter's, tensor by tensor: they agree everywhere except where stock
  is wrong (`HfMapping.stock_wrong`, e.g. Gemma's q/k/v with several K/V
  heads), and there the converter's inverse is written.

Nothing here reads or computes a weight value.

Example:

```python
mapping = hf_mapping(abstract_backbone)
mapping.config["model_type"], [t.name for t in mapping.tensors]
mapping.pieces["layers/.../vars/0"]   # [(tensor name, Piece), ...]
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.errors import SaveError
from keras_hub_dist.formats import huggingface, keras_h5
from keras_hub_dist.formats.base import StoredTensor, StoredTensorSource, is_float, listing, numpy_dtype
from keras_hub_dist.formats.lazy_numpy import LazyArray
from keras_hub_dist.formats.mxfp4 import Mxfp4Source
from keras_hub_dist.formats.pieces import NotAffine, Piece, canonical, identity, invert, pieces_of
from keras_hub_dist.formats.safetensors_files import SafetensorsCheckpoint, SafetensorsHeader
from keras_hub_dist.formats.safetensors_writer import TensorSpec, plan_files
from keras_hub_dist.save.hf_families import FAMILIES, GEMMA2, Family, corrected_config, corrected_layout, gemma2_like

__all__ = ["HfMapping", "exportable_families", "hf_mapping"]


@dataclass(frozen=True)
class HfMapping:
    """A model's Hugging Face checkpoint, without values.

    Attributes:
        config: config.json contents.
        tensors: Every tensor, in Transformers' state-dict order.
        pieces: Keras weights dataset name (as `save_weights` names it) ->
            `(tensor name, piece)` pairs; each piece's leaf is
            `(dataset name, 0)`.
        shapes: Dataset name -> the variable's shape.
        stock_wrong: Tensors where KerasHub's exporter disagrees with its
            own importer (its values are not written).
        exporter: `"keras_hub"` (stock's layout) or `"keras_hub_dist"`.
    """

    config: dict[str, Any]
    tensors: tuple[TensorSpec, ...]
    pieces: Mapping[str, tuple[tuple[str, Piece], ...]]
    shapes: Mapping[str, tuple[int, ...]]
    stock_wrong: tuple[str, ...]
    exporter: str


def exportable_families() -> list[str]:
    """Backbone classes `hf_mapping` exports."""
    stock = _compat.stock_hf_exporter().MODEL_EXPORTERS
    return sorted(set(stock) | set(FAMILIES))


def _family(backbone: Any) -> tuple[Family | None, Any, Any]:
    """`(our family or None, stock config fn, stock weights fn)`."""
    name = type(backbone).__name__
    if name == "GemmaBackbone" and gemma2_like(backbone):
        return GEMMA2, None, None
    if name in FAMILIES:
        return FAMILIES[name], None, None
    stock = _compat.stock_hf_exporter()
    if name in stock.MODEL_EXPORTERS and name in stock.MODEL_CONFIGS:
        return None, stock.MODEL_CONFIGS[name], stock.MODEL_EXPORTERS[name]
    raise SaveError(
        f"Cannot export a {name} to the Hugging Face format. Expected one of the "
        f"families that export: {', '.join(exportable_families())}. Received: {name}. "
        "Save it as a KerasHub preset instead (format='keras')."
    )


@contextlib.contextmanager
def _patched(classes: set[type], name: str, value: Any) -> Iterator[None]:
    originals = {cls: cls.__dict__.get(name) for cls in classes}
    for cls in classes:
        setattr(cls, name, value)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


class _LazyOps:
    """`keras.ops` for the exporter's replay: NumPy's function of the same
    name, with variables replaced by their lazy arrays."""

    def __init__(self, lazy: Any) -> None:
        self._lazy = lazy

    def __getattr__(self, name: str) -> Any:
        function = getattr(np, name)
        return lambda *args, **kwargs: function(
            *self._lazy(args), **{k: self._lazy(v) for k, v in kwargs.items()}
        )


def _replay_stock(backbone: Any, weights_fn: Any, leaves: dict[int, LazyArray]) -> dict[str, Any]:
    """KerasHub's `get_*_weights_map(backbone, include_lm_head=True)` with
    every variable a lazy array: tensor name -> `TensorSource`."""

    def lazy(value: Any) -> Any:
        if isinstance(value, keras.Variable):
            if id(value) not in leaves:
                raise SaveError(f"KerasHub's exporter reads {value.path!r}, which the model does not save.")
            return leaves[id(value)]
        if isinstance(value, (list, tuple)):
            return type(value)(lazy(v) for v in value)
        return value

    classes = {type(v) for v in backbone.weights}
    with (
        _compat.replaced_module_global(weights_fn, "ops", _LazyOps(lazy)),
        _patched(classes, "__getitem__", lambda self, key: lazy(self)[key]),
    ):
        exported = weights_fn(backbone, include_lm_head=True)
    out = {}
    for name, value in exported.items():
        value = lazy(value)
        if not isinstance(value, LazyArray):
            raise SaveError(
                f"KerasHub's exporter computes {name!r} with operations keras_hub_dist "
                f"cannot replay without values (a {type(value).__name__})."
            )
        out[name] = value.source
    return out


def _token_ids(config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """As stock `export_backbone`: bos / eos from the tokenizer."""
    if tokenizer is not None:
        if getattr(tokenizer, "start_token", None) is not None:
            config["bos_token_id"] = tokenizer.token_to_id(tokenizer.start_token)
        if getattr(tokenizer, "end_token", None) is not None:
            config["eos_token_id"] = tokenizer.token_to_id(tokenizer.end_token)
    return config


def _trace_files(
    specs: Sequence[TensorSpec], family: Family | None
) -> tuple[SafetensorsCheckpoint, dict[tuple[str, int], str]]:
    """The planned files as KerasHub's converter would see them (headers
    only), and `(file, offset)` -> tensor name."""
    traced: list[TensorSpec] = []
    for spec in specs:
        instead = family.traced_as(spec.name, spec.shape) if family and family.traced_as else None
        traced += [spec] if instead is None else [TensorSpec(n, s, np.dtype(d)) for n, s, d in instead]
    layout = plan_files(traced)
    headers, where = {}, {}
    for file in layout.files:
        tensors = {}
        for spec in traced:
            if spec.name in file.offsets:
                tensors[spec.name] = StoredTensor(file.name, file.offsets[spec.name], spec.shape, np.dtype(spec.dtype))
                where[(file.name, file.offsets[spec.name])] = spec.name
        headers[file.name] = SafetensorsHeader(file.name, tensors)
    return SafetensorsCheckpoint(headers, layout.weight_map), where


def _inverted(
    backbone: Any,
    datasets: Mapping[str, Any],
    specs: Sequence[TensorSpec],
    config: dict[str, Any],
    family: Family | None,
) -> tuple[dict[str, list[tuple[str, Piece]]], list[str]]:
    """KerasHub's import converter traced on the planned files, inverted:
    dataset name -> `[(tensor, piece)]`, and the problems."""
    files, where = _trace_files(specs, family)
    sources, problems = huggingface.trace_sources(backbone, files, config)
    pieces: dict[str, list[tuple[str, Piece]]] = {}
    for name, variable in datasets.items():
        source = sources.get(id(variable))
        if source is None:
            if variable.trainable:
                problems.append(
                    f"{variable.path} ({name}): no tensor of the checkpoint holds it "
                    "(KerasHub's converter never reads it back)"
                )
            continue
        if isinstance(source, Mxfp4Source):
            tensor = where[(source.blocks.file, source.blocks.offset)][: -len("_blocks")]
            pieces[name] = [(tensor, identity((name, 0), tuple(variable.shape)))]
            continue
        try:
            pieces[name] = [(where[p.leaf], invert(p, (name, 0))) for p in pieces_of(source)]
        except NotAffine as e:
            problems.append(f"{variable.path}: KerasHub's converter transforms it in a way with no inverse here ({e})")
    return pieces, problems


def _by_tensor(pieces: Mapping[str, Sequence[tuple[str, Piece]]]) -> dict[str, set[tuple[str, Piece]]]:
    out: dict[str, set[tuple[str, Piece]]] = {}
    for dataset, pairs in pieces.items():
        for tensor, piece in pairs:
            out.setdefault(tensor, set()).add((dataset, canonical(piece)))
    return out


def hf_mapping(backbone: Any, *, tokenizer: Any = None, dtype: Any = None) -> HfMapping:
    """The Hugging Face checkpoint of `backbone` (its values are not read:
    a backbone built without values will do).

    Args:
        backbone: A KerasHub backbone.
        tokenizer: Its tokenizer, for config.json's token ids.
        dtype: Dtype of the floating-point tensors; default: each variable's.

    Raises:
        SaveError: A family that does not export (the message lists those
            that do), a variable the checkpoint has no place for, or a
            layout KerasHub's converter cannot read back.
    """
    family, config_fn, weights_fn = _family(backbone)
    datasets = keras_h5.expected_datasets(backbone)
    first = {}
    for name, variable in datasets.items():
        first.setdefault(id(variable), name)
    datasets = {name: v for name, v in datasets.items() if first[id(v)] == name}
    shapes = {name: tuple(int(d) for d in v.shape) for name, v in datasets.items()}
    dtypes = {name: numpy_dtype(v.dtype) for name, v in datasets.items()}

    stock: dict[str, list[tuple[str, Piece]]] = {}
    if family is None:
        leaves = {
            id(v): LazyArray(StoredTensorSource(StoredTensor(n, 0, shapes[n], dtypes[n]), n), frozenset({n}))
            for n, v in datasets.items()
        }
        exported = _replay_stock(backbone, weights_fn, leaves)
        config = corrected_config(backbone, dict(config_fn(backbone)))
        layout = corrected_layout(backbone, [(n, tuple(s.shape)) for n, s in exported.items()])
        try:
            for tensor, source in exported.items():
                for p in pieces_of(source):
                    stock.setdefault(p.leaf[0], []).append((tensor, p))
        except NotAffine:
            stock = {}
        exporter = "keras_hub"
    else:
        config = family.config(backbone)
        layout = family.layout(backbone)
        exporter = "keras_hub_dist"
    config = _token_ids(config, tokenizer)

    guess = np.dtype(numpy_dtype(backbone.dtype_policy.variable_dtype))
    specs = [TensorSpec(n, s, guess) for n, s in layout]
    pieces, problems = _inverted(backbone, datasets, specs, config, family)
    inverse = _by_tensor(pieces)
    stock_pieces = _by_tensor(stock)
    stock_wrong = [n for n, _ in layout if n in stock_pieces and n in inverse and stock_pieces[n] != inverse[n]]
    # What stock writes and KerasHub's importer never reads: a tied head
    # written again is left out (Transformers writes it once); anything else
    # is written as stock maps it.
    unread = {n for n, _ in layout if n not in inverse and n in stock_pieces}
    repeated = {n for n in unread if any(stock_pieces[n] == p for p in inverse.values())}
    layout = [(n, s) for n, s in layout if n not in repeated]
    for dataset, pairs in stock.items():
        extra = [(t, p) for t, p in pairs if t in unread - repeated]
        if extra:
            pieces.setdefault(dataset, []).extend(extra)
    inverse = _by_tensor(pieces)

    sizes = {n: int(np.prod(s)) for n, s in layout}
    for tensor, pairs in inverse.items():
        covered = sum(p.size for _, p in pairs)
        if covered != sizes.get(tensor, -1):
            problems.append(f"tensor {tensor!r}: {covered} of its {sizes.get(tensor)} elements come from the model")
    for tensor in sizes:
        if tensor not in inverse:
            problems.append(f"tensor {tensor!r}: no variable of the model fills it")
    if problems:
        raise SaveError(
            f"Cannot export the {type(backbone).__name__} to the Hugging Face format: "
            f"KerasHub's converter (model_type={config.get('model_type')!r}) does not read "
            f"the planned checkpoint back into the model. {len(problems)} problem(s):"
            + listing(problems)
            + "\nIf the model has an untied LM head (or other weights) where the family "
            "ties them, the format has no place for it."
        )

    tensor_dtype: dict[str, np.dtype] = {}
    for dataset, pairs in pieces.items():
        for tensor, _ in pairs:
            own = dtypes[dataset]
            if dtype is not None and is_float(own):
                own = np.dtype(numpy_dtype(dtype))
            tensor_dtype.setdefault(tensor, own)
    tensors = tuple(TensorSpec(n, s, tensor_dtype[n]) for n, s in layout)
    if dtype is not None and "torch_dtype" in config:
        config["torch_dtype"] = np.dtype(numpy_dtype(dtype)).name
    return HfMapping(
        config=config,
        tensors=tensors,
        pieces={d: tuple(p) for d, p in pieces.items()},
        shapes=shapes,
        stock_wrong=tuple(stock_wrong),
        exporter=exporter,
    )
