"""`restore_checkpoint`: a keras.callbacks.OrbaxCheckpoint restored in place,
bitwise, on any mesh, with no device ever above its final bytes, and bad
inputs refused before anything changes."""

import functools
import gc
import os
import shutil

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES

pytest.importorskip("orbax.checkpoint")

import keras_hub_dist  # noqa: E402
from keras_hub_dist import CheckpointError, _compat, load_sharded_preset, restore_checkpoint  # noqa: E402
from keras_hub_dist.load import orbax_checkpoint, restore  # noqa: E402
from keras_hub_dist.measure import memory  # noqa: E402
from keras_hub_dist.measure.event_samples import sampling_after_calls  # noqa: E402

# One decoder block: what is restored is every variable of whatever model
# (a second block only adds the same kinds of variables), and compiling the
# train step of each mesh is most of this module's time.
TINY = dict(
    vocabulary_size=256, num_layers=1, num_query_heads=8, num_key_value_heads=8,
    hidden_dim=64, intermediate_dim=128,
)
TOKENS = np.random.RandomState(0).randint(1, 255, size=(16, 16)).astype("int32")
# Two steps of 8 sequences (divisible by every mesh's batch axis), then a third.
DATA = ({"token_ids": TOKENS, "padding_mask": np.ones_like(TOKENS)}, np.roll(TOKENS, -1, axis=1))
NEXT = ({"token_ids": TOKENS[:8], "padding_mask": np.ones_like(TOKENS[:8])}, np.roll(TOKENS[:8], -1, axis=1))


def _state(model):
    """Every saved value, as NumPy: model variables by path, the
    optimizer's without the optimizer's own (automatic) name."""
    values = {v.path: np.asarray(v.value) for v in restore._model_variables(model)}
    if model.optimizer is not None:
        for v in model.optimizer.variables:
            values["optimizer/" + v.path.split("/", 1)[1]] = np.asarray(v.value)
    return values


def _assert_equal(got, want):
    assert sorted(got) == sorted(want)
    different = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not different, different


@functools.cache
def _presets(root):
    """The tiny Llama, and presets of other models for the mismatch tests."""
    paths = {}
    for name, overrides in {
        "tiny": {}, "wider": dict(hidden_dim=32), "deeper": dict(num_layers=2),
    }.items():
        paths[name] = keras_hub_dist.write_synthetic_preset(
            os.path.join(root, name), keras_hub.models.LlamaBackbone, dtype="float32",
            tokenizer=True, seed=1, **dict(TINY, **overrides),
        )
    return paths


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    return _presets(str(tmp_path_factory.mktemp("restore_presets")))


def _adam(**kwargs):
    return lambda: keras.optimizers.Adam(1e-3, **kwargs)


def _lm(preset, mesh, optimizer=_adam(), **kwargs):
    """A causal LM on `mesh`, compiled with `optimizer()` (made under the
    model's distribution, not built yet)."""
    lm = load_sharded_preset(preset, mesh=mesh, task="causal_lm", progress=False, **kwargs)
    lm.preprocessor = None
    if optimizer is not None:
        lm.compile(optimizer=optimizer())
    return lm


class _Recorder(keras.callbacks.Callback):
    """The state after each step (`self.model` syncs JAX's state first)."""

    def __init__(self):
        super().__init__()
        self.states = {}

    def on_train_batch_end(self, batch, logs=None):
        model = self.model
        self.states[int(model.optimizer.iterations.value)] = _state(model)


@functools.cache
def _train(preset, mesh, root):
    """Fits 2 steps on `mesh` saving every step, then one step more.

    Returns the checkpoint, a weights-only checkpoint of the same run (on
    (1, 8) only), the state at steps 1 and 2, and after the third step."""
    keras.distribution.set_distribution(None)
    lm = _lm(preset, mesh, optimizer=_adam(name="adam"))
    directory = os.path.join(root, "x".join(map(str, mesh)))
    shutil.rmtree(directory, ignore_errors=True)
    recorder = _Recorder()
    callbacks = [
        keras.callbacks.OrbaxCheckpoint(directory, save_freq=1, max_to_keep=2, save_on_background=False),
        recorder,
    ]
    if mesh == (1, 8):  # the only weights-only checkpoint the tests read
        callbacks.append(keras.callbacks.OrbaxCheckpoint(
            directory + "_weights", save_freq=1, save_weights_only=True, save_on_background=False
        ))
    lm.fit(*DATA, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    lm.fit(*NEXT, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = _state(lm)
    keras.distribution.set_distribution(None)
    return directory, directory + "_weights", recorder.states, after


@pytest.fixture(scope="module")
def trained(presets, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("restore_checkpoints"))
    return lambda mesh: _train(presets["tiny"], mesh, root)


@pytest.mark.parametrize(
    "saved_on, restored_on", list(zip(MESH_SHAPES, MESH_SHAPES[1:] + MESH_SHAPES[:1]))
)
def test_restores_every_value_bitwise_on_another_mesh(saved_on, restored_on, presets, trained):
    directory, _, states, _ = trained(saved_on)
    lm = _lm(presets["tiny"], restored_on)
    assert not lm.optimizer.built  # the usual restart: compiled, never fitted
    shardings = {v.path: v.value.sharding for v in lm.weights}

    assert restore_checkpoint(lm, directory) == 2

    _assert_equal(_state(lm), states[2])
    assert int(lm.optimizer.iterations.value) == 2
    # Every variable stays in the model's own layout, not the saved one.
    assert all(v.value.sharding == shardings[v.path] for v in lm.weights)
    for v in lm.optimizer.variables:
        assert len(v.value.sharding.device_set) == 8


def test_an_earlier_step_and_a_step_directory(presets, trained):
    directory, _, states, _ = trained((2, 4))
    lm = _lm(presets["tiny"], (2, 4))
    assert restore_checkpoint(lm, directory, step=1) == 1
    _assert_equal(_state(lm), states[1])
    assert restore_checkpoint(lm, os.path.join(directory, "2")) == 2  # optimizer built now
    _assert_equal(_state(lm), states[2])


def test_a_relative_directory(presets, trained, monkeypatch):
    """Orbax reads arrays by absolute path only (a relative one gave "every
    leaf ... NoneType" before the path was made absolute)."""
    directory, _, states, _ = trained((2, 4))
    monkeypatch.chdir(os.path.dirname(directory))
    lm = _lm(presets["tiny"], (2, 4))
    assert restore_checkpoint(lm, os.path.basename(directory), step=1) == 1
    _assert_equal(_state(lm), states[1])


def test_a_fit_step_after_restoring_equals_the_uninterrupted_one(presets, trained):
    directory, _, _, after = trained((2, 4))
    lm = _lm(presets["tiny"], (2, 4))
    restore_checkpoint(lm, directory)
    lm.fit(*NEXT, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_equal(_state(lm), after)
    assert int(lm.optimizer.iterations.value) == 3


def test_weights_only_into_a_model_whose_optimizer_has_no_state(presets, trained):
    _, weights_only, states, _ = trained((1, 8))
    want = {k: v for k, v in states[2].items() if not k.startswith("optimizer/")}
    lm = _lm(presets["tiny"], (8, 1))  # compiled, never fitted
    restore_checkpoint(lm, weights_only)
    assert not lm.optimizer.built
    _assert_equal({k: v for k, v in _state(lm).items() if not k.startswith("optimizer/")}, want)
    lm = _lm(presets["tiny"], (2, 4), optimizer=None)
    lm.optimizer = None
    restore_checkpoint(lm, weights_only)
    _assert_equal(_state(lm), want)


def _live_model_bytes(baseline):
    gc.collect()
    return {d: b - baseline.get(d, 0) for d, b in memory.live_bytes_per_device().items()}


def _measure(run, baseline, ours=True):
    """Runs `run`, sampling per-device bytes after every placement Orbax
    makes (`jax.device_put` per device, the assembled array) and after each
    group; returns (max sample, final) per device, without `baseline`."""
    with memory.MemorySampler(interval_s=1.0) as sampler, \
            sampling_after_calls(sampler, jax, "device_put") as puts, \
            sampling_after_calls(sampler, jax, "make_array_from_single_device_arrays") as arrays, \
            sampling_after_calls(sampler, orbax_checkpoint, "read_arrays") as groups:
        run()
    samples = puts + arrays + groups
    assert len(puts) > 100 and (len(groups) > 3 or not ours)
    final = _live_model_bytes(baseline)
    peak = {d: max(s[d] for s in samples) - baseline.get(d, 0) for d in final}
    return peak, final


# Keras's own Orbax loader (stock, measured below) calls a deprecated name.
@pytest.mark.filterwarnings("ignore:Use `metadata` instead:DeprecationWarning")
def test_no_device_holds_more_than_its_final_bytes(presets, trained, monkeypatch):
    directory, _, states, _ = trained((1, 8))
    monkeypatch.setattr(restore, "GROUP_BYTES", 8 << 10)  # many groups
    gc.collect()
    baseline = memory.live_bytes_per_device()  # other tests' cached models
    # Named as when saved: stock (below) skips an optimizer named otherwise.
    lm = _lm(presets["tiny"], (2, 4), optimizer=_adam(name="adam"))

    # Optimizer not built: its variables are filled straight from the file.
    peak, final = _measure(lambda: restore_checkpoint(lm, directory), baseline)
    assert max(peak[d] / final[d] for d in final) <= 1.05, (peak, final)
    # Built: each variable's old array is freed before its new one is read.
    lm.fit(*NEXT, batch_size=8, epochs=1, shuffle=False, verbose=0)
    peak, final = _measure(lambda: restore_checkpoint(lm, directory), baseline)
    assert max(peak[d] / final[d] for d in final) <= 1.05, (peak, final)
    _assert_equal(_state(lm), states[2])

    # Stock Keras, same model, same checkpoint: twice the final bytes.
    peak, final = _measure(lambda: lm.load_weights(directory), baseline, ours=False)
    assert min(peak[d] / final[d] for d in final) >= 1.9, (peak, final)
    _assert_equal(_state(lm), states[2])


# --- bad inputs: refused before anything changes ------------------------------


@pytest.fixture(scope="module")
def untouched_model(presets):
    """One model for every refusal (each must leave it as it was)."""
    keras.distribution.set_distribution(None)
    lm = _lm(presets["tiny"], (1, 8))
    yield lm
    keras.distribution.set_distribution(None)


def _refused(lm, directory, match, **kwargs):
    arrays = {id(v): _compat.variable_array(v) for v in lm.variables}
    values = _state(lm)
    optimizer_variables = len(lm.optimizer.variables) if lm.optimizer is not None else 0
    gc.collect()
    before = memory.live_bytes_per_device()
    with pytest.raises(CheckpointError, match=match):
        restore_checkpoint(lm, directory, **kwargs)
    gc.collect()
    assert memory.live_bytes_per_device() == before
    assert all(_compat.variable_array(v) is arrays[id(v)] for v in lm.variables)
    assert not any(a.is_deleted() for a in arrays.values())
    _assert_equal(_state(lm), values)
    if lm.optimizer is not None:
        assert len(lm.optimizer.variables) == optimizer_variables


def test_not_a_checkpoint(untouched_model, presets, tmp_path):
    lm = untouched_model
    _refused(lm, tmp_path / "nowhere", "which does not exist")
    (tmp_path / "file").write_text("x")
    _refused(lm, tmp_path / "file", "which is a file")
    (tmp_path / "empty").mkdir()
    _refused(lm, tmp_path / "empty", r"with no saved step \(it holds: nothing\)")
    _refused(lm, presets["tiny"], r"config.json.*a KerasHub preset: load it with load_sharded_preset")
    (tmp_path / "killed" / "3.orbax-checkpoint-tmp-1234").mkdir(parents=True)
    _refused(lm, tmp_path / "killed", r"only unfinished steps \(3.orbax-checkpoint-tmp-1234\)")


def test_a_step_that_was_not_saved_lists_the_saved_ones(untouched_model, trained):
    directory = trained((1, 8))[0]
    _refused(untouched_model, directory, r"one of the steps saved in .*: \[1, 2\]. Received: step=5", step=5)
    _refused(untouched_model, os.path.join(directory, "2"), "Received: the directory of step 2", step=1)


@pytest.mark.parametrize(
    "preset, kwargs, match",
    [
        ("wider", {}, r"'token_embedding/embeddings' in .* step 2 to have shape \(256, 32\) "
                      r"and dtype float32.*Received: shape \(256, 64\)"),
        ("deeper", {}, r"variables of the model not in it \('transformer_layer_1/"),
        ("tiny", dict(dtype="bfloat16"), r"dtype bfloat16, as variable .* Received: shape .*, dtype float32"),
    ],
)
def test_a_checkpoint_of_another_model(preset, kwargs, match, presets, trained):
    directory = trained((1, 8))[0]
    lm = _lm(presets[preset], (1, 8), **kwargs)
    _refused(lm, directory, match)
    assert not lm.optimizer.built


@pytest.mark.parametrize(
    "optimizer, match",
    [
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), r"variables of SGD '.*' not in it \('sgd.*momentum"),
        (lambda: keras.optimizers.Adam(amsgrad=True), r"variables of Adam .*velocity_hat"),
    ],
)
def test_an_optimizer_that_differs(optimizer, match, presets, trained):
    directory = trained((1, 8))[0]
    lm = _lm(presets["tiny"], (1, 8), optimizer=optimizer)
    _refused(lm, directory, match)
    assert not lm.optimizer.built


def test_optimizer_state_missing(presets, trained):
    lm = _lm(presets["tiny"], (1, 8))
    lm.optimizer.build(lm.trainable_variables)  # it has state of its own now
    _refused(lm, trained((1, 8))[1], "Expected optimizer state .* save_weights_only=True")


def test_a_failed_read_says_what_is_left_and_a_retry_restores(presets, trained, monkeypatch):
    directory, _, states, _ = trained((1, 8))
    lm = _lm(presets["tiny"], (1, 8))
    monkeypatch.setattr(restore, "GROUP_BYTES", 8 << 10)
    real = orbax_checkpoint.read_arrays
    calls = []

    def failing(step_dir, targets):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk gone")
        return real(step_dir, targets)

    monkeypatch.setattr(orbax_checkpoint, "read_arrays", failing)
    with pytest.raises(CheckpointError, match="disk gone. The .* variables before them are restored"):
        restore_checkpoint(lm, directory)
    assert lm.optimizer.built and all(_compat.variable_array(v) is not None for v in lm.optimizer.variables)
    monkeypatch.setattr(orbax_checkpoint, "read_arrays", real)
    restore_checkpoint(lm, directory)
    _assert_equal(_state(lm), states[2])


def test_prints_nothing(presets, trained, capfd):
    directory = trained((1, 8))[0]
    lm = _lm(presets["tiny"], (1, 8))
    capfd.readouterr()
    restore_checkpoint(lm, directory)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_loss_scale_state(presets, tmp_path):
    """A LossScaleOptimizer's own state (scale, step counter) beside its
    inner Adam's, restored into a fresh model on another mesh."""

    def loss_scaled():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**8)

    keras.distribution.set_distribution(None)
    lm = _lm(presets["tiny"], (1, 8), optimizer=loss_scaled)
    directory = str(tmp_path / "loss_scaled")
    lm.fit(*NEXT, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.OrbaxCheckpoint(directory, save_freq=1, save_on_background=False)
    ])
    saved = _state(lm)
    assert any("step_counter" in k for k in saved) and any("velocity" in k for k in saved)
    keras.distribution.set_distribution(None)
    restored = _lm(presets["tiny"], (2, 4), optimizer=loss_scaled)
    restore_checkpoint(restored, directory)
    _assert_equal(_state(restored), saved)
