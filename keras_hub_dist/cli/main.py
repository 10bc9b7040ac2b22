"""The `keras-hub-dist` command line; the package's only terminal output.

```
keras-hub-dist validate --preset gemma_7b_en --num_layers 1 --mesh 1x8
keras-hub-dist validate --preset /path/to/preset_dir --phases load --hbm_gb 16 \\
    --json report.json --plot memory.png
keras-hub-dist validate --preset /path/to/Qwen3-8B --phases load   # an HF checkpoint
keras-hub-dist validate --preset llama3_8b_en --checkpoint_format huggingface
keras-hub-dist validate --preset gemma_7b_en --num_layers 1 --mesh 1x8 --phases fit,generate --batch 8 --seq 128
keras-hub-dist convert ./Qwen3-8B ./qwen3_8b_keras --to keras
keras-hub-dist convert ./gemma_7b_tuned ./gemma_7b_hf --to huggingface --dtype bfloat16
keras-hub-dist plan gemma_7b_en --mesh 1x8 --job fit --lora 8 --batch 8 --seq 2048 --hbm_gb 16
```

`validate` measures, per device, the peak and final memory of building
(`init`) and loading (`load`) a backbone with keras_hub_dist and with stock
KerasHub under the same `ModelParallel`, and of the jobs on the loaded
causal LM (`fit`, `generate`, opt-in), each case in a fresh process; see
`keras_hub_dist.validate.runner` for the phases and
`keras_hub_dist.validate.schema` for the JSON report and the exit codes.

`plan` prints a job's per-device memory from XLA's analysis of the
program it runs, compiled on abstract values (`keras_hub_dist.cli.plan`).

`convert` converts a checkpoint between the KerasHub and Hugging Face formats
file to file, never holding the model's values
(`keras_hub_dist.convert.file_to_file`); exit status 0, or 2 with the error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from keras_hub_dist.cli.plan import add_plan_flags, run_plan
from keras_hub_dist.validate.options import CHECKPOINT_FORMATS, QUANTIZE_MODES, ValidateOptions
from keras_hub_dist.validate.plot import plot_report, require_matplotlib
from keras_hub_dist.validate.report import format_report, over_budget_lines, write_json
from keras_hub_dist.validate.runner import run_validation

__all__ = ["build_parser", "execute", "main"]


def _add_validate_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--preset",
        default="gemma_7b_en",
        help="A named architecture (e.g. gemma_7b_en, llama3_8b_en, gemma2_7b), a "
        "KerasHub preset directory or a Hugging Face checkpoint directory (Transformers "
        "config.json + safetensors). Default: %(default)s.",
    )
    add(
        "--mesh",
        default=None,
        help="BATCHxMODEL mesh shape, e.g. 1x8 or 2x4. Default: 1xN over all N devices.",
    )
    add("--dtype", default=None, help="Weight dtype, e.g. bfloat16. Default: the preset's own.")
    add(
        "--phases",
        default="init,load",
        help="What to measure, comma-separated: init, load, and the jobs on the loaded "
        "causal LM, fit (one train step) and generate (one greedy generate), each "
        "beside plan_memory's figures for the same job. Default: %(default)s.",
    )
    add(
        "--num_layers",
        "--num-layers",
        type=int,
        default=None,
        help="Override the number of transformer layers (a quick, reduced-depth run).",
    )
    add(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a backbone config field (VALUE as JSON), e.g. hidden_dim=64. Repeatable.",
    )
    add(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also measure stock KerasHub under the same distribution. Default: on.",
    )
    add("--nobaseline", dest="baseline", action="store_false", help=argparse.SUPPRESS)
    add(
        "--hbm_gb",
        "--hbm-gb",
        type=float,
        default=None,
        help="Memory budget per device in GiB; exit status 1 if one of our cases "
        "exceeds it. Default: the devices' own limit where they report one.",
    )
    add("--json", dest="json_path", default=None, metavar="PATH", help="Write the JSON report here.")
    add(
        "--plot",
        dest="plot_path",
        default=None,
        metavar="PATH",
        help="Write a PNG of per-device memory over time, ours vs stock (needs matplotlib).",
    )
    add(
        "--devices",
        type=int,
        default=None,
        help="CPU devices to simulate in the case processes (XLA_FLAGS). Default: the "
        "mesh size, or 8. Ignored by TPU/GPU platforms, which use their real devices.",
    )
    add(
        "--interval_ms",
        type=float,
        default=2.0,
        help="Memory sampling interval in milliseconds. Default: %(default)s.",
    )
    add(
        "--timeout_s",
        type=float,
        default=1800.0,
        help="Time limit per case process in seconds. Default: %(default)s.",
    )
    add(
        "--preset_cache",
        default=None,
        metavar="DIR",
        help="Keep the synthetic preset of the load phase in DIR and reuse it on the next "
        "run. Default: a temporary directory removed afterwards.",
    )
    add(
        "--checkpoint_format",
        "--checkpoint-format",
        choices=CHECKPOINT_FORMATS,
        default="keras",
        help="Format of the synthetic checkpoint the load phase writes for a named "
        "architecture: keras (a KerasHub preset) or huggingface (config.json + "
        "safetensors, loaded through KerasHub's converter; Gemma (1) and Llama "
        "architectures, e.g. gemma_7b_en or llama3_8b_en, in --dtype or the "
        "architecture's own dtype). A preset directory is read in its own format. "
        "Default: %(default)s.",
    )
    add(
        "--quantize",
        choices=QUANTIZE_MODES,
        default=None,
        help="Measure quantized models: ours loads (builds) with quantize=MODE, stock "
        "loads (builds) in float under the same distribution, then calls "
        "model.quantize(MODE) (its failure is reported). --dtype stays the float "
        "dtype. Default: float models.",
    )
    add("--batch", type=int, default=8, help="fit / generate: global batch. Default: %(default)s.")
    add(
        "--seq",
        type=int,
        default=128,
        help="fit / generate: sequence length (generate: max_length, half of it the "
        "prompt). Default: %(default)s.",
    )
    add("--lora", dest="lora_rank", type=int, default=None, metavar="RANK",
        help="fit with LoRA of this rank (ours and stock). Default: a full fine-tune.")
    add("--remat", default=None, metavar="MODE",
        help="fit: keras.RematScope mode for ours (full, activations, larger_than, "
        "list_of_layers). Default: none.")
    add("--prompt_chunk", "--prompt-chunk", type=int, default=512,
        help="generate: ours' prompt pass chunk (load_sharded_preset's prompt_chunk). "
        "Default: %(default)s.")
    add("--quiet", action="store_true", help="No progress lines, only the table.")


def build_parser() -> argparse.ArgumentParser:
    """The `keras-hub-dist` argument parser."""
    parser = argparse.ArgumentParser(
        prog="keras-hub-dist",
        description="Initialize and load KerasHub LLMs straight into their shards.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    validate = commands.add_parser(
        "validate",
        help="Per-device memory report for init, load, fit and generate, ours vs stock KerasHub.",
        description=(
            "Measure per-device peak and final memory of initializing and loading a "
            "backbone, with keras_hub_dist and with stock KerasHub, each case in a "
            "fresh process."
        ),
    )
    _add_validate_flags(validate)
    convert = commands.add_parser(
        "convert",
        help="Convert a checkpoint between the KerasHub and Hugging Face formats, file to file.",
        description=(
            "Convert a KerasHub preset to a Hugging Face (Transformers) checkpoint or back, "
            "tile by tile from the source files into the target files, without building "
            "the model's values (host memory stays at a few hundred MiB whatever the size)."
        ),
    )
    _add_convert_flags(convert)
    plan = commands.add_parser(
        "plan",
        help="Per-device memory of a fit / generate / load, from XLA, before any weight exists.",
        description=(
            "Compile the program a job runs (Keras's train step, KerasHub's generate) for the "
            "mesh on abstract values and print XLA's per-device memory analysis: weights, "
            "optimizer state, LoRA factors, KV cache, temporaries, the verdict against "
            "--hbm_gb and, when it does not fit, the alternatives that do."
        ),
    )
    add_plan_flags(plan)
    return parser


def _add_convert_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("source", help="A KerasHub preset or Hugging Face checkpoint (directory or handle).")
    add("target", help="The directory to create, or a bucket prefix (s3://bucket/prefix, gs://bucket/prefix).")
    add("--to", required=True, choices=("keras", "huggingface"), help="The target format.")
    add("--dtype", default=None, help="Dtype of the floating-point weights. Default: the source's own.")
    add(
        "--task",
        default="auto",
        help="auto: carry over the source's tokenizer as a causal LM if it has one; none: "
        "the backbone only; or a task name such as causal_lm. Default: %(default)s.",
    )
    add(
        "--max_shard_size",
        "--max-shard-size",
        default=None,
        help="GB per weights file (a number) or, for huggingface, a size such as 5GB. "
        "Default: 10 (keras) / 50GB (huggingface).",
    )
    add("--overwrite", action="store_true", help="Replace an existing target once complete.")
    add(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Show a progress bar. Default: when stderr is a terminal.",
    )


def run_convert(args: argparse.Namespace) -> int:
    """The `convert` command; returns the exit code."""
    from keras_hub_dist.errors import PresetError, SaveError
    from keras_hub_dist.convert.file_to_file import convert_checkpoint

    shard: float | str | None = args.max_shard_size
    if shard is not None:
        try:
            shard = float(shard)
        except ValueError:
            pass
    try:
        convert_checkpoint(
            args.source, args.target, to=args.to, dtype=args.dtype,
            task=None if args.task == "none" else args.task, overwrite=args.overwrite,
            progress=args.progress, max_shard_size=shard,
        )
    except (PresetError, SaveError, ValueError) as e:
        print(f"keras-hub-dist convert: error: {e}", file=sys.stderr)
        return 2
    return 0


def options_from_args(args: argparse.Namespace) -> ValidateOptions:
    """`ValidateOptions` from parsed flags (raises `ValueError` on bad values)."""
    return ValidateOptions.from_flags(
        preset=args.preset,
        mesh=args.mesh,
        dtype=args.dtype,
        phases=args.phases,
        num_layers=args.num_layers,
        override=args.override,
        baseline=args.baseline,
        hbm_gb=args.hbm_gb,
        devices=args.devices,
        interval_ms=args.interval_ms,
        timeout_s=args.timeout_s,
        preset_cache=args.preset_cache,
        checkpoint_format=args.checkpoint_format,
        quantize=args.quantize,
        batch=args.batch,
        seq=args.seq,
        lora_rank=args.lora_rank,
        remat=args.remat,
        prompt_chunk=args.prompt_chunk,
    )


def execute(
    options: ValidateOptions,
    *,
    json_path: str | None = None,
    plot_path: str | None = None,
    quiet: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Runs the validation, prints the table and writes the files; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    if plot_path:
        # Fail now, not after minutes of measuring.
        require_matplotlib()

    def progress(message: str) -> None:
        if not quiet:
            print(message, file=err, flush=True)

    report = run_validation(options, on_event=progress)
    print(format_report(report), file=out, flush=True)
    if json_path:
        write_json(report, json_path)
        progress(f"JSON report: {json_path}")
    if plot_path:
        plot_report(report, plot_path)
        progress(f"plot: {plot_path}")
    for line in over_budget_lines(report):
        if line.startswith("OVER BUDGET"):
            print(line, file=err, flush=True)
    return int(report["exit_code"])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `keras-hub-dist` console command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("convert", "plan"):
        try:
            return run_convert(args) if args.command == "convert" else run_plan(args)
        except KeyboardInterrupt:
            return 130
    try:
        options = options_from_args(args)
        return execute(
            options, json_path=args.json_path, plot_path=args.plot_path, quiet=args.quiet
        )
    except (ValueError, ImportError, RuntimeError) as e:
        print(f"keras-hub-dist validate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
