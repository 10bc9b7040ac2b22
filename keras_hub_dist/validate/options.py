"""What `keras-hub-dist validate` measures: its options and their flag forms.

`ValidateOptions` holds one run's settings and checks them; `parse_mesh` and
`parse_overrides` turn the command-line strings (`--mesh 1x8`, repeated
`--override KEY=VALUE`) into them. Nothing here imports JAX or touches a
device: the options are settled in the parent process, before any case runs.

Example:

```python
from keras_hub_dist.validate.options import ValidateOptions

options = ValidateOptions.from_flags(
    preset="gemma_7b_en", mesh="1x8", phases="init,load", override=None,
    num_layers=1,
)
options.mesh_shape, options.config_overrides()  # ((1, 8), {'num_layers': 1})
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CASES",
    "CHECKPOINT_FORMATS",
    "DEFAULT_PHASES",
    "JOB_PHASES",
    "PHASES",
    "QUANTIZE_MODES",
    "ValidateOptions",
    "parse_mesh",
    "parse_overrides",
]

# What is measured (`init`: random initialization, `load`: a preset; the
# jobs on the loaded causal LM, `fit`: one train step, `generate`: one
# generate), and by whom (`ours`: keras_hub_dist, `stock`: plain KerasHub),
# in report order. The jobs are opt-in: the default stays init and load.
PHASES = ("init", "load", "fit", "generate")
DEFAULT_PHASES = ("init", "load")
JOB_PHASES = ("fit", "generate")
CASES = ("ours", "stock")
# `--remat`: `keras.RematScope`'s modes (`shaping.remat.REMAT_MODES`, not
# imported: no Keras here; tests/validate/test_validate_jobs.py compares).
REMAT_MODES = ("full", "activations", "larger_than", "list_of_layers")
# The formats of the synthetic checkpoint the load phase writes for a named
# architecture (`--checkpoint_format`): a KerasHub preset
# (`formats.synthetic`) or a Hugging Face one (`formats.synthetic_hf`).
CHECKPOINT_FORMATS = ("keras", "huggingface")
# `--quantize`: `load_sharded_preset(..., quantize=)` and the factories'
# modes (`plan.quantization.SUPPORTED_MODES`, not imported: no Keras here).
QUANTIZE_MODES = ("int8", "int4")


@dataclasses.dataclass
class ValidateOptions:
    """What `keras-hub-dist validate` measures; see `cli.py` for the flags.

    Attributes:
        preset: A named architecture (`keras_hub_dist.presets`), a KerasHub
            preset directory or a Hugging Face checkpoint directory
            (Transformers `config.json` + safetensors).
        mesh: `(batch, model)` mesh shape; default `(1, devices)`.
        dtype: Weight dtype (e.g. "bfloat16"); default the preset's own.
        phases: Any of "init", "load", "fit", "generate" (default init and
            load).
        num_layers: Override of the number of transformer layers.
        overrides: Further backbone config overrides (named architectures).
        baseline: Also measure stock KerasHub.
        hbm_gb: Per-device budget in GiB; default the devices' `bytes_limit`
            where the platform reports one, else none.
        devices: CPU devices to simulate (`XLA_FLAGS`); default the mesh size
            or 8. Harmless on TPU/GPU, where the real devices are used.
        interval_ms: Sampling interval of the memory sampler.
        timeout_s: Limit per case process.
        preset_cache: Directory to keep (and reuse) the synthetic preset in;
            default a temporary directory removed afterwards.
        checkpoint_format: Format of the synthetic checkpoint the load phase
            writes for a named architecture: `"keras"` (a KerasHub preset)
            or `"huggingface"` (config.json + safetensors, for the classes
            of `formats.synthetic_hf.SUPPORTED_CLASSES`).
        quantize: `"int8"` / `"int4"`: ours loads (and builds) the model
            quantized (`quantize=`); stock loads (builds) it under the same
            distribution, then calls `model.quantize(mode)`.
        batch: The job phases' global batch (`fit`: one step's rows,
            `generate`: its prompts); the mesh's data axis must divide it.
        seq: The job phases' sequence length (`generate`: `max_length`, the
            first half of each row the prompt).
        lora_rank: `fit` with LoRA of this rank on the projections PEFT
            adapts (`keras_hub_dist.enable_lora`, ours and stock); default a
            full fine-tune.
        remat: A `keras.RematScope` mode for ours' `fit` (and its plan).
        prompt_chunk: Ours' `generate` prompt pass chunk
            (`load_sharded_preset(prompt_chunk=)`).
        python: Interpreter of the case processes.
    """

    preset: str = "gemma_7b_en"
    mesh: tuple[int, int] | None = None
    dtype: str | None = None
    phases: tuple[str, ...] = DEFAULT_PHASES
    num_layers: int | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    baseline: bool = True
    hbm_gb: float | None = None
    devices: int | None = None
    interval_ms: float = 2.0
    timeout_s: float = 1800.0
    preset_cache: str | None = None
    checkpoint_format: str = "keras"
    quantize: str | None = None
    batch: int = 8
    seq: int = 128
    lora_rank: int | None = None
    remat: str | None = None
    prompt_chunk: int = 512
    python: str = sys.executable

    @classmethod
    def from_flags(
        cls,
        *,
        mesh: str | None,
        phases: str,
        override: list[str] | None,
        **values: Any,
    ) -> ValidateOptions:
        """Options from command-line strings.

        Args:
            mesh: `--mesh`, e.g. `"1x8"` (see `parse_mesh`); None for the
                default.
            phases: `--phases`, e.g. `"init,load"` or `"fit,generate"`.
            override: The repeated `--override KEY=VALUE` values.
            **values: The other fields of `ValidateOptions`, as they are.

        Returns:
            The checked options.

        Raises:
            ValueError: A malformed mesh, phase list or override.
        """
        return cls(
            mesh=parse_mesh(mesh),
            phases=tuple(p.strip() for p in str(phases).split(",") if p.strip()),
            overrides=parse_overrides(override or []),
            **values,
        )

    def __post_init__(self) -> None:
        phases = tuple(self.phases)
        bad = [p for p in phases if p not in PHASES]
        if not phases or bad:
            raise ValueError(
                f"Expected phases among {PHASES}. Received: phases={phases}. "
                "Use e.g. --phases init,load or --phases fit,generate."
            )
        # Report order, whatever order the flag gave.
        self.phases = tuple(p for p in PHASES if p in phases)
        if self.mesh is not None:
            self.mesh = tuple(int(m) for m in self.mesh)  # type: ignore[assignment]
            if len(self.mesh) != 2 or min(self.mesh) < 1:
                raise ValueError(
                    "Expected a (batch, model) mesh of two positive sizes. "
                    f"Received: mesh={self.mesh}."
                )
        if self.hbm_gb is not None and self.hbm_gb <= 0:
            raise ValueError(f"Expected hbm_gb > 0. Received: hbm_gb={self.hbm_gb}.")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(
                f"Expected num_layers >= 1. Received: num_layers={self.num_layers}."
            )
        self.checkpoint_format = str(self.checkpoint_format or "keras").strip().lower()
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"Expected --checkpoint_format among {CHECKPOINT_FORMATS}. Received: "
                f"--checkpoint_format {self.checkpoint_format!r}. Use keras (a "
                "KerasHub preset) or huggingface (config.json + safetensors)."
            )
        if self.quantize is not None and self.quantize not in QUANTIZE_MODES:
            raise ValueError(
                f"Expected --quantize among {QUANTIZE_MODES}. Received: "
                f"--quantize {self.quantize!r}."
            )
        if self.interval_ms <= 0:
            raise ValueError(
                f"Expected interval_ms > 0. Received: interval_ms={self.interval_ms}."
            )
        self._check_jobs()

    def _check_jobs(self) -> None:
        """The job phases' flags: positive sizes, a known remat mode, a batch
        the mesh's data axis divides; LoRA / remat only with `fit`."""
        for flag, value, least in (
            ("batch", self.batch, 1), ("seq", self.seq, 2), ("prompt_chunk", self.prompt_chunk, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Expected --{flag} >= {least}. Received: --{flag} {value!r}.")
        if self.lora_rank is not None and (
            isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1
        ):
            raise ValueError(
                f"Expected --lora RANK >= 1 (or no --lora for a full fine-tune). "
                f"Received: --lora {self.lora_rank!r}."
            )
        if self.remat is not None and self.remat not in REMAT_MODES:
            raise ValueError(
                f"Unknown --remat mode. Expected one of {list(REMAT_MODES)} "
                f"(keras.RematScope's modes). Received: --remat {self.remat!r}."
            )
        if (self.lora_rank is not None or self.remat is not None) and "fit" not in self.phases:
            raise ValueError(
                "--lora and --remat apply to the fit phase. Expected --phases with fit "
                f"(e.g. --phases fit,generate). Received: --phases {','.join(self.phases)}."
            )
        data = self.mesh_shape[0]
        if any(p in JOB_PHASES for p in self.phases) and self.batch % data:
            works = list(range(data, 4 * data + 1, data))
            raise ValueError(
                f"The mesh's data axis (batch={data}) splits the batch of the job "
                f"phases. Expected a --batch it divides, e.g. {works}. Received: "
                f"--batch {self.batch} on --mesh {self.mesh_shape[0]}x{self.mesh_shape[1]}."
            )

    @property
    def simulated_devices(self) -> int:
        """CPU devices the case processes simulate: `devices`, the mesh size, or 8."""
        if self.devices:
            return int(self.devices)
        return math.prod(self.mesh) if self.mesh else 8

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The `(batch, model)` mesh: `mesh`, or `(1, simulated_devices)`."""
        return tuple(self.mesh) if self.mesh else (1, self.simulated_devices)

    def config_overrides(self) -> dict[str, Any]:
        """The backbone config overrides, `num_layers` included (a fresh dict)."""
        overrides = dict(self.overrides)
        if self.num_layers is not None:
            overrides["num_layers"] = int(self.num_layers)
        return overrides


def parse_mesh(text: str | None) -> tuple[int, int] | None:
    """Parses `--mesh`: `"1x8"` -> `(1, 8)` (batch x model); `"8"` -> `(1, 8)`.

    Args:
        text: `BATCHxMODEL` (`x`, `,` or `*` between the sizes) or a single
            model size; None or blank for the default mesh.

    Returns:
        `(batch, model)`, or None for None or blank text.

    Raises:
        ValueError: Not one or two positive integers.
    """
    if text is None or str(text).strip() == "":
        return None
    parts = re.split(r"[x,*]", str(text).strip().lower())
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) == 1:
        sizes = (1, sizes[0])
    if len(sizes) != 2 or min(sizes) < 1:
        raise ValueError(
            "Expected --mesh as BATCHxMODEL, e.g. 1x8 or 2x4. "
            f"Received: --mesh {text!r}."
        )
    return sizes  # type: ignore[return-value]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """Parses repeated `--override KEY=VALUE` into config overrides.

    VALUE is read as JSON (`64`, `true`, `"bfloat16"`); text that is not
    JSON is kept as a string, so `dtype=bfloat16` needs no quotes.

    Args:
        items: e.g. `["hidden_dim=64", "dtype=bfloat16"]`.

    Returns:
        Key -> value, e.g. `{"hidden_dim": 64, "dtype": "bfloat16"}`.

    Raises:
        ValueError: An item without `=` or with an empty key.
    """
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                "Expected --override KEY=VALUE (VALUE in JSON, e.g. 64, true, "
                f"\"bfloat16\"). Received: --override {item!r}."
            )
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    return overrides
