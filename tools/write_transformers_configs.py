"""Writes what today's `transformers` saves for every tested family: the
test fixtures of `tests/data/transformers5/`.

For each family the test suite checks (`tests/formats/hf`: the same cases,
the same tiny sizes), this tool takes the published-style config.json of
that case, loads it with the installed `transformers` (`AutoConfig`, as
`from_pretrained` does with a downloaded checkpoint), builds the model class
named in `architectures` with random weights (torch, CPU) and
`save_pretrained`s it: exactly what a user who loads, fine-tunes and saves a
checkpoint with `transformers` 5 gets. It keeps, per case:

- `config.json`, as `save_pretrained` wrote it (`transformers_version` in it
  says which version);
- `tensors.json`, every tensor of the safetensors files it wrote: sorted
  `[name, shape, dtype]` (read from the safetensors headers), so tests can
  write a checkpoint with exactly those names without torch.

It needs `transformers` and `torch` (not dependencies of keras_hub_dist nor
of its tests), e.g. in a venv of its own:

    python3 -m venv /tmp/tf5 && /tmp/tf5/bin/pip install "transformers==5.23.0" \\
        torch ml_dtypes safetensors
    /tmp/tf5/bin/python tools/write_transformers_configs.py            # write
    /tmp/tf5/bin/python tools/write_transformers_configs.py --check    # compare

gpt-oss: the published checkpoints store the experts in MXFP4, which
`transformers` writes only from a GPU-quantized model; on CPU it builds and
saves the dequantized model, so that case is saved without
`quantization_config` (see tests/data/transformers5/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "data", "transformers5")
sys.path.insert(0, REPO)

# Cases of tests/formats/hf that are one family's other layout of the same
# model_type (`qwen3_5_moe_fused`: fused experts, which save_pretrained
# writes one way only) are not repeated.
_SKIPPED = frozenset({"qwen3_5_moe_fused"})


def _cases() -> dict[str, dict]:
    """{case: published-style config.json contents}, float32, untied where possible."""
    from tests.formats.hf import dense, moe, recent

    return {
        case: module.hf_checkpoint(case, tied=False, dtype="float32")[0]
        for module in (dense, moe, recent)
        for case in module.CASES
        if case not in _SKIPPED
    }


def _safetensors_tensors(directory: str) -> list[list]:
    """Sorted [name, shape, dtype] of every tensor in the directory's safetensors files."""
    rows = []
    for fname in sorted(os.listdir(directory)):
        if not fname.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, fname), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        rows += [[name, list(t["shape"]), t["dtype"]]
                 for name, t in header.items() if name != "__metadata__"]
    return sorted(rows)


def _save_with_transformers(config: dict, directory: str) -> None:
    import torch
    import transformers

    config = dict(config)
    # See the module docstring: on CPU only the dequantized gpt-oss is saved.
    config.pop("quantization_config", None)
    with tempfile.TemporaryDirectory() as source:
        with open(os.path.join(source, "config.json"), "w") as f:
            json.dump(config, f)
        hf_config = transformers.AutoConfig.from_pretrained(source)
    model_cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(0)
    model = model_cls._from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(directory)


def written(case_config: dict) -> tuple[dict, list[list]]:
    """(config.json, tensors) that `save_pretrained` writes for one case."""
    with tempfile.TemporaryDirectory() as directory:
        _save_with_transformers(case_config, directory)
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        return config, _safetensors_tensors(directory)


def _dump(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _tensors_dump(rows: list[list]) -> str:
    # One tensor a line: diffs between transformers versions stay readable.
    return "[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed fixtures instead of writing them")
    parser.add_argument("--only", nargs="*", help="cases to write (default: all)")
    args = parser.parse_args(argv)
    import transformers

    cases = _cases()
    differ = []
    for case, config in cases.items():
        if args.only and case not in args.only:
            continue
        hf_config, tensors = written(config)
        files = {"config.json": _dump(hf_config), "tensors.json": _tensors_dump(tensors)}
        folder = os.path.join(OUT, case)
        for name, text in files.items():
            path = os.path.join(folder, name)
            if args.check:
                old = open(path).read() if os.path.exists(path) else None
                if old != text:
                    differ.append(os.path.relpath(path, REPO))
                continue
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        print(f"{case}: model_type={hf_config['model_type']!r}, {len(tensors)} tensors, "
              f"transformers {transformers.__version__}")
    if differ:
        print("differ from what this transformers writes:\n  " + "\n  ".join(differ))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
