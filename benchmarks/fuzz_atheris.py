"""Coverage-guided fuzzing (atheris, optional: `pip install atheris`) of the
safetensors header check and the config parser, beside the hypothesis runs
of benchmarks/bench_fuzz.py.

Each input is split by its first byte: even -> the bytes as a safetensors
file (`validate_header`), odd -> the rest as config.json (`read_config`).
Anything but acceptance or a `PresetError` is a crash atheris reports (and
saves as `crash-*`).

Usage: `python benchmarks/fuzz_atheris.py -runs=100000 -max_len=4096`
(any libFuzzer flag; seed inputs: a directory of files as last argument).
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import atheris  # noqa: E402

with atheris.instrument_imports():
    from keras_hub_dist.formats.safetensors_header import validate_header
    from keras_hub_dist.load.source import read_config

from keras_hub_dist.errors import PresetError  # noqa: E402
from keras_hub_dist.storage.locations import LocalDirectory  # noqa: E402

_FOLDER = tempfile.mkdtemp(prefix="fuzz_atheris")


def one_input(data: bytes) -> None:
    if not data:
        return
    try:
        if data[0] % 2 == 0:
            validate_header(data[1:], len(data) - 1, "fuzz.safetensors")
        else:
            with open(os.path.join(_FOLDER, "config.json"), "wb") as f:
                f.write(data[1:])
            read_config(LocalDirectory(_FOLDER))
    except PresetError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
