"""`restore_checkpoint` under `jax.distributed`: 2 processes x 4 devices
(loopback, gloo) restore a checkpoint saved by one process on 8 devices."""

import hashlib
import os
import pathlib
import shutil
import sys

import keras
import keras_hub
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import keras_hub_dist  # noqa: E402
from tests.multiprocess_jobs import run_job  # noqa: E402

WORKER = pathlib.Path(__file__).with_name("restore_worker.py")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux and loopback"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny causal LM fitted 2 steps on (1, 8) in this process with
    `OrbaxCheckpoint`, and its state then."""
    root = tmp_path_factory.mktemp("restore_mp")
    preset = keras_hub_dist.write_synthetic_preset(
        str(root / "tiny"), keras_hub.models.LlamaBackbone, dtype="float32", tokenizer=True,
        seed=3, vocabulary_size=256, num_layers=2, num_query_heads=8, num_key_value_heads=8,
        hidden_dim=64, intermediate_dim=128,
    )
    keras.distribution.set_distribution(None)
    lm = keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8), task="causal_lm", progress=False)
    lm.preprocessor = None
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    tokens = np.random.RandomState(1).randint(1, 255, size=(16, 16)).astype("int32")
    directory = str(root / "checkpoint")
    shutil.rmtree(directory, ignore_errors=True)
    lm.fit(
        {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}, np.roll(tokens, -1, axis=1),
        batch_size=8, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.OrbaxCheckpoint(directory, save_freq=1, save_on_background=False)],
    )
    state = {v.path: np.asarray(v.value) for v in lm.trainable_variables + lm.non_trainable_variables}
    state.update({"optimizer/" + v.path.split("/", 1)[1]: np.asarray(v.value) for v in lm.optimizer.variables})
    keras.distribution.set_distribution(None)
    return preset, directory, state


@pytest.mark.parametrize("mesh", ["2x4", "1x8"])
def test_two_processes_restore_every_block_bitwise(saved, tmp_path, mesh):
    preset, directory, state = saved
    reports = run_job(WORKER, 2, 4, [preset, directory, mesh, tmp_path], tmp_path)
    seen = {}
    for report in reports:
        assert report["step"] == 2 and report["iterations"] == 2
        assert sorted(report["blocks"]) == sorted(state)
        for name, blocks in report["blocks"].items():
            for index, digest in blocks.items():
                box = tuple(slice(*map(int, b.split(":"))) for b in index.split(",") if b)
                want = np.ascontiguousarray(state[name][box])
                assert digest == hashlib.sha256(want.tobytes()).hexdigest(), (name, index)
                seen.setdefault(name, set()).add(index)
        # No device of either process above its final bytes.
        assert all(report["peak"][d] <= 1.05 * report["final"][d] for d in report["final"])
    # The two processes' blocks cover every variable.
    for name, value in state.items():
        covered = sum(
            int(np.prod([int(b.split(":")[1]) - int(b.split(":")[0]) for b in i.split(",") if b]))
            for i in seen[name]
        )
        assert covered >= value.size, name
