"""Write a full-size KerasHub preset with random weights, one block at a time.

No weights can be downloaded in some environments (CI, air-gapped machines),
yet loading a 17 GB checkpoint is exactly what needs testing.
`write_synthetic_preset` writes a preset that stock
`keras_hub.models.Backbone.from_preset` loads: `config.json` and
`metadata.json` as `save_to_preset` writes them, and `model.weights.h5` with
exactly Keras's layout (written by replaying Keras's own save walk over an
abstract backbone, so group names, `vars/<i>` datasets, `name` attributes and
bfloat16 tagging are Keras's). Optionally it adds a tiny tokenizer so
`CausalLM.from_preset` / `load_sharded_preset(..., task="causal_lm")` work.

The backbone is built without allocating any weight and each dataset is
filled in row bands of at most `chunk_bytes`, so host memory stays at a few
tens of MB whatever the model size.

Example:

```python
import keras_hub_dist

keras_hub_dist.write_synthetic_preset(
    "/tmp/gemma_7b_1layer", "gemma_7b_en", num_layers=1, dtype="float32"
)
backbone = keras_hub.models.Backbone.from_preset("/tmp/gemma_7b_1layer")
```
"""

from __future__ import annotations

import datetime
import io
import json
import math
import os
import shutil
import zlib
from collections.abc import Mapping
from typing import Any

import keras
import ml_dtypes
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import PresetError
from keras_hub_dist.plan import presets
from keras_hub_dist.plan.build import build_without_values

__all__ = ["write_synthetic_preset"]

_DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
# Uniform on [-a, a] has standard deviation a / sqrt(3): 0.02, the usual LLM
# init scale, keeps activations of a deep random model finite.
_STDDEV = 0.02


def _strip_build_config(config: Any) -> Any:
    if isinstance(config, dict):
        return {
            k: _strip_build_config(v)
            for k, v in config.items()
            if k not in ("compile_config", "build_config")
        }
    if isinstance(config, list):
        return [_strip_build_config(v) for v in config]
    return config


def _serialized_config(architecture: Any, overrides: Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(architecture, str):
        config = presets.resolve(architecture).config_json()
    elif isinstance(architecture, type):
        config = {
            "module": architecture.__module__,
            "class_name": architecture.__name__,
            "config": {},
            "registered_name": keras.saving.get_registered_name(architecture),
        }
    elif isinstance(architecture, Mapping) and "class_name" in architecture:
        config = json.loads(json.dumps(architecture))
    else:
        raise PresetError(
            "Expected architecture to be a named architecture (see "
            "keras_hub_dist.presets.names()), a KerasHub backbone class, or a "
            "serialized backbone config (a preset's config.json). Received: "
            f"{architecture!r}."
        )
    config["config"] = {**config.get("config", {}), **overrides}
    return config


class _StreamingStore(_compat.H5IOStore):
    """Keras's own H5 store, except each variable is written in row bands of
    random values instead of from its (never allocated) value."""

    def __init__(self, path: str, seed: int, chunk_bytes: int, progress: Any) -> None:
        super().__init__(path, mode="w")
        self._seed = seed
        self._chunk_bytes = chunk_bytes
        self._progress = progress

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(value, keras.Variable):
            raise PresetError(
                f"Layer at {self._h5_entry_path!r} saves a computed value, not a "
                "variable. Expected plain variables (no LoRA / merged "
                "quantization) in a synthetic preset."
            )
        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        shape = tuple(int(d) for d in value.shape)
        name = keras.backend.standardize_dtype(value.dtype)
        dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
        dataset = self._h5_entry_group.create_dataset(key, shape=shape, dtype=dtype)
        if name == "bfloat16":
            dataset.attrs["dtype"] = "bfloat16"
        full_name = f"{dataset.name}"
        rng = np.random.default_rng([self._seed, zlib.crc32(full_name.encode())])
        if not shape:
            dataset[()] = _random((), dtype, rng)
            return
        row_bytes = max(math.prod(shape[1:]) * dtype.itemsize, 1)
        rows = max(1, self._chunk_bytes // row_bytes)
        for start in range(0, shape[0], rows):
            stop = min(shape[0], start + rows)
            block = _random((stop - start,) + shape[1:], dtype, rng)
            dataset[start:stop] = block
            self._progress.update(block.nbytes)


def _random(shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -127), min(info.max, 127) + 1, size=shape, dtype=dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    values = rng.random(shape, dtype=np.float32)
    half_width = _STDDEV * math.sqrt(3.0)
    values *= 2 * half_width
    values -= half_width
    return values.astype(dtype, copy=False)


def _metadata(backbone: keras.Model) -> dict[str, Any]:
    import keras_hub

    tasks = sorted(
        {
            c.__base__.__name__
            for c in set(keras.saving.get_custom_objects().values())
            if isinstance(c, type)
            and issubclass(c, keras_hub.models.Task)
            and getattr(c, "backbone_cls", None) is type(backbone)
        }
    )
    return {
        "keras_version": keras.version(),
        "keras_hub_version": keras_hub.__version__,
        "parameter_count": int(backbone.count_params()),
        "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S"),
        "tasks": tasks,
        "synthetic": True,
    }


def _tokenizer_class(backbone_cls: type) -> type | None:
    import keras_hub

    for c in set(keras.saving.get_custom_objects().values()):
        if (
            isinstance(c, type)
            and issubclass(c, keras_hub.models.CausalLM)
            and getattr(c, "backbone_cls", None) is backbone_cls
            and getattr(c, "preprocessor_cls", None) is not None
        ):
            return getattr(c.preprocessor_cls, "tokenizer_cls", None)
    return None


def _bytes_to_unicode() -> list[str]:
    # GPT-2's reversible byte -> printable character table (byte-level BPE).
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _tiny_tokenizer(tokenizer_cls: type, vocabulary_size: int) -> Any:
    """A small tokenizer of the family's class with its special tokens."""
    import keras_hub

    try:
        probe = tokenizer_cls()
    except TypeError:
        probe = tokenizer_cls(proto=None)
    special = sorted(set(probe.special_tokens))
    if issubclass(tokenizer_cls, keras_hub.tokenizers.SentencePieceTokenizer):
        import sentencepiece

        words = [f"w{i}" for i in range(200)] + (
            "the quick brown fox jumps over lazy dog a of to and in is it "
            "that was for on are with as his they be at one have this from"
        ).split()
        corpus = [" ".join(words[i : i + 7]) for i in range(0, len(words), 3)]
        size = min(vocabulary_size, len(words) + len(special) + 1)
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus),
            model_writer=model,
            vocab_size=size,
            model_type="WORD",
            unk_id=0,
            bos_id=-1,
            eos_id=-1,
            pad_id=-1,
            user_defined_symbols=[t for t in special if t != "<unk>"],
            hard_vocab_limit=False,
            minloglevel=2,
        )
        # Pad the vocabulary to the model's size: a random model generates
        # any id below it, and detokenizing must not fail on one.
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(model.getvalue())
        for i in range(len(proto.pieces), vocabulary_size):
            piece = proto.pieces.add()
            piece.piece = f"\u2581x{i}"
            piece.score = -100.0 - i
            piece.type = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL
        return tokenizer_cls(proto=proto.SerializeToString())
    if issubclass(tokenizer_cls, keras_hub.tokenizers.BytePairTokenizer):
        chars = _bytes_to_unicode()
        vocabulary = {c: i for i, c in enumerate(chars)}
        merges = []
        for pair in ("Ġ t", "t h", "Ġt h", "h e", "Ġ a"):
            left, right = pair.split()
            if left + right not in vocabulary:
                vocabulary[left + right] = len(vocabulary)
            merges.append(pair)
        for token in special:
            vocabulary.setdefault(token, len(vocabulary))
        for i in range(len(vocabulary), vocabulary_size):
            vocabulary[f"x{i}"] = i  # Every id the model can emit decodes.
        if len(vocabulary) > vocabulary_size:
            raise PresetError(
                f"A byte-level tokenizer needs {len(vocabulary)} tokens. Expected "
                f"vocabulary_size >= {len(vocabulary)}. Received: "
                f"{vocabulary_size}. Use a larger vocabulary or tokenizer=False."
            )
        return tokenizer_cls(vocabulary=vocabulary, merges=merges)
    raise PresetError(
        f"Cannot make a synthetic {tokenizer_cls.__name__}. Expected a "
        "SentencePiece or byte-pair tokenizer. Pass tokenizer=False."
    )


def write_synthetic_preset(
    preset_dir: str | os.PathLike,
    architecture: Any,
    *,
    dtype: Any = None,
    seed: int = 0,
    tokenizer: bool | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
    **overrides: Any,
) -> str:
    """Writes a KerasHub preset with random weights, streaming, to `preset_dir`.

    The preset has `config.json`, `metadata.json` and `model.weights.h5`
    exactly as `backbone.save_to_preset` writes them (plus `tokenizer.json`
    and its assets with `tokenizer=True`), so stock
    `keras_hub.models.Backbone.from_preset` and `load_sharded_preset` load it.
    Weights are uniform random with standard deviation 0.02, deterministic in
    `seed`; only one row band (`chunk_bytes`) is ever in host memory.

    Args:
        preset_dir: Directory to create.
        architecture: A named architecture (`keras_hub_dist.presets`, e.g.
            `"gemma_7b_en"`), a KerasHub backbone class (then give its
            arguments as `overrides`), or a serialized backbone config (the
            contents of a preset's `config.json`).
        dtype: Dtype (policy) of the weights, e.g. `"bfloat16"`; default the
            architecture's.
        seed: Seed of the random values.
        tokenizer: Also write a tiny tokenizer of the family (a few hundred
            tokens, with the family's special tokens) so task loading works.
            Default: only when the vocabulary is small enough to hold it.
        overwrite: Replace an existing `preset_dir`.
        progress: Show a progress bar on stderr (default: when a TTY).
        chunk_bytes: Largest block written at once.
        **overrides: Backbone config overrides, e.g. `num_layers=1`.

    Returns:
        The preset directory.

    Raises:
        PresetError: Unknown architecture input, or `preset_dir` exists and
            `overwrite` is False.
    """
    preset_dir = os.fspath(preset_dir)
    if os.path.exists(preset_dir):
        if not overwrite:
            raise PresetError(
                f"The preset directory {preset_dir!r} already exists. Expected a "
                "new path. Received: an existing path; pass overwrite=True."
            )
        shutil.rmtree(preset_dir)
    if dtype is not None:
        overrides = {**overrides, "dtype": dtype}
    config = _serialized_config(architecture, overrides)

    backbone, _ = build_without_values(*presets.backbone_config(config)[:2])

    os.makedirs(preset_dir)
    try:
        serialized = _strip_build_config(keras.saving.serialize_keras_object(backbone))
        with open(os.path.join(preset_dir, "config.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(serialized, indent=4))
        with open(os.path.join(preset_dir, "metadata.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(_metadata(backbone), indent=4))

        total = sum(
            math.prod(v.shape) * np.dtype(
                ml_dtypes.bfloat16 if v.dtype == "bfloat16" else v.dtype
            ).itemsize
            for v in backbone.weights
        )
        bar = byte_progress(total, f"Writing {os.path.basename(preset_dir)}", progress)
        store = _StreamingStore(
            os.path.join(preset_dir, "model.weights.h5"), seed, chunk_bytes, bar
        )
        try:
            _compat.walk_saved_variables(backbone, store)
        finally:
            store.close()
            bar.close()

        tokenizer_cls = _tokenizer_class(type(backbone))
        vocabulary_size = int(backbone.get_config().get("vocabulary_size", 0) or 0)
        if tokenizer is None:
            tokenizer = tokenizer_cls is not None and vocabulary_size >= 300
        if tokenizer:
            if tokenizer_cls is None:
                raise PresetError(
                    f"{type(backbone).__name__} has no causal LM tokenizer "
                    "class. Expected a KerasHub LLM backbone. Pass tokenizer=False."
                )
            _tiny_tokenizer(tokenizer_cls, vocabulary_size).save_to_preset(preset_dir)
    except BaseException:
        shutil.rmtree(preset_dir, ignore_errors=True)
        raise
    return preset_dir
