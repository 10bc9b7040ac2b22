"""Warning classes of the package, so users can filter them precisely.

Example:

```python
import warnings
import keras_hub_dist

warnings.simplefilter("ignore", keras_hub_dist.MissingLayoutWarning)
```
"""

from __future__ import annotations

__all__ = [
    "KerasHubDistWarning",
    "LayoutFallbackWarning",
    "MissingLayoutWarning",
]


class KerasHubDistWarning(UserWarning):
    """Base class of every warning `keras_hub_dist` emits."""


class MissingLayoutWarning(KerasHubDistWarning):
    """A distribution is active but no layout covers a variable's path.

    The variable is then created exactly as the parent Keras initializer would
    create it (and replicated by Keras), which may not fit on small devices.
    """


class LayoutFallbackWarning(KerasHubDistWarning):
    """A layout could not shard the axis it asked for and used another one."""


class UnconvertedWeightsWarning(KerasHubDistWarning):
    """KerasHub's Hugging Face converter gave no value to some trainable
    weights of the model; they keep their initializer's values, exactly as
    with stock `from_preset`."""


__all__.append("UnconvertedWeightsWarning")


class RemoteDownloadWarning(KerasHubDistWarning):
    """A preset is fetched by KerasHub's own downloader (a `kaggle://` handle
    or a KerasHub preset name): every host downloads whole weight files into
    its cache before loading, instead of reading only its share."""


__all__.append("RemoteDownloadWarning")


class StaleStagingWarning(KerasHubDistWarning):
    """`save_sharded_preset` found what earlier saves to the same target,
    killed before they finished, left beside it: it names every staging
    directory it removed (its save provably dead), restored (the only copy
    of the replaced preset) or left alone (its save may still run, e.g. on
    another host)."""


__all__.append("StaleStagingWarning")


class GenerateFallbackWarning(KerasHubDistWarning):
    """`shard_generate` left a causal LM's prompt pass as stock KerasHub runs
    it (all `max_length` positions at once): a causal LM whose cache and
    masks were not read for the chunked pass (`SUPPORTED_CAUSAL_LMS`), or a
    Gemma 3 / 4 prompt with images or audio, which attend to each other
    across chunks."""


__all__.append("GenerateFallbackWarning")


class LayoutError(ValueError):
    """A layout does not fit a variable (axis names, rank or divisibility)."""


class PresetError(ValueError):
    """A preset cannot be loaded as asked: missing or truncated weights file,
    variables missing from or extra in it, shape/dtype mismatches, or an
    architecture the sharded loader does not support."""


__all__.append("LayoutError")
__all__.append("PresetError")


class UnknownPresetError(ValueError):
    """A name is not one of the named architectures in `presets/`; the
    message lists the closest known names."""


__all__.append("UnknownPresetError")


class SaveError(ValueError):
    """A model cannot be saved as asked: it is not built, the target exists
    (without `overwrite=True`) or is not writable, the processes disagree on
    the target, or writing failed on some process (the target is then left
    untouched)."""


__all__.append("SaveError")


class QuantizationError(ValueError):
    """`quantize=` cannot be applied as asked: an unknown mode, a mode this
    Keras lacks, a dtype the mode cannot take, or a layer whose quantization
    cannot be replayed without values."""


__all__.append("QuantizationError")


class CheckpointError(ValueError):
    """A training checkpoint cannot be restored as asked: the directory is
    not one `keras.callbacks.OrbaxCheckpoint` wrote, the step does not
    exist, or the checkpoint holds another model or another optimizer's
    state. Raised before any variable changes; the model is left as it
    was."""


__all__.append("CheckpointError")


class PlanError(ValueError):
    """A job cannot be planned as asked (`plan_memory`): an unknown job,
    optimizer or remat mode, a batch the mesh's data axis does not divide,
    a LoRA rank below 1, or a mesh larger than the devices the plan can
    compile for. Raised before anything is built or compiled."""


__all__.append("PlanError")


class ProcessLostError(RuntimeError):
    """Another process of the `jax.distributed` job was lost (preempted,
    OOM-killed, its host gone) during a cross-process step of a load, save,
    conversion or restore. Raised on every surviving process that reaches
    the step, as the operation's own error too: `except SaveError` (or
    `PresetError`, `CheckpointError`) catches it. `lost` holds the lost
    process ids where JAX tells them (else `()`), `phase` the step, `left`
    what the operation left behind.
    """

    def __init__(self, message: str, *, lost: tuple[int, ...] = (), phase: str = "", left: str = ""):
        super().__init__(message)
        self.lost, self.phase, self.left = tuple(lost), phase, left


class LoadProcessLostError(ProcessLostError, PresetError):
    """A process was lost during a load (`load_sharded_preset`, a LoRA
    adapter's load, `verify=True`): also a `PresetError`."""


class SaveProcessLostError(ProcessLostError, SaveError):
    """A process was lost during a save, an export, `convert_checkpoint` or
    `save_lora_adapter`: also a `SaveError`."""


class CheckpointProcessLostError(ProcessLostError, CheckpointError):
    """A process was lost during `restore_checkpoint`: also a
    `CheckpointError`."""


def process_lost_class(error_class: type[Exception]) -> type[ProcessLostError]:
    """The `ProcessLostError` that is also an `error_class` (itself for
    one of its own bases: a loss outside any operation)."""
    if not issubclass(error_class, (PresetError, SaveError, CheckpointError)):
        return ProcessLostError
    for lost in (SaveProcessLostError, CheckpointProcessLostError, LoadProcessLostError):
        if issubclass(lost, error_class):
            return lost
    return ProcessLostError


__all__ += [
    "CheckpointProcessLostError",
    "LoadProcessLostError",
    "ProcessLostError",
    "SaveProcessLostError",
    "process_lost_class",
]
