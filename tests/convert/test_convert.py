"""`convert_checkpoint` / `keras-hub-dist convert`: file to file, equal to
load-then-save both ways, host memory bounded by the tile size whatever the
model, crash-safe, clear errors."""

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_dist import SaveError, load_sharded_preset, save_sharded_preset, write_synthetic_preset
from keras_hub_dist.formats import checksums
from keras_hub_dist.convert import file_to_file as convert
from keras_hub_dist.convert.file_to_file import convert_checkpoint
from keras_hub_dist.save.piece_write import CHUNK_BYTES
from keras_hub_dist.measure import host_rss
from keras_hub_dist.cli import main as cli
from tests.formats.hf import dense, moe
from tests.formats.hf.writer import write_hf_checkpoint


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for case, module in (("qwen3", dense), ("smollm3", dense), ("mixtral", moe), ("gpt_oss", moe)):
        config, tensors = module.hf_checkpoint(case, tied=False, dtype="bfloat16")
        out[case] = write_hf_checkpoint(str(root / case), config, tensors, num_shards=3)
    return root, out


@pytest.fixture
def xla_transposes(monkeypatch):
    """Every transposed view the converter writes goes through XLA, in
    several slabs (the tiny tiles here are under the sizes it starts and
    splits at); the reference save's go through NumPy, so the two paths are
    checked against each other. Returns the list of permutations run."""
    from keras_hub_dist.save import piece_write

    monkeypatch.setattr(piece_write, "XLA_TRANSPOSE_MIN_BYTES", 0)
    monkeypatch.setattr(piece_write, "XLA_SLAB_BYTES", 1024)  # several slabs per tile
    perms, transposer = [], piece_write._transposer
    monkeypatch.setattr(piece_write, "_transposer", lambda perm: perms.append(perm) or transposer(perm))
    return perms


def _datasets(folder):
    entry = [n for n in os.listdir(folder) if n.startswith("model.weights")][0]
    files = [entry] if entry.endswith(".h5") else sorted(n for n in os.listdir(folder) if n.endswith(".weights.h5"))
    out = {}
    for name in files:
        with h5py.File(os.path.join(folder, name)) as h5:
            h5.visititems(lambda n, o: out.__setitem__(n, (name, o[()].tobytes(), o.dtype.str))
                          if isinstance(o, h5py.Dataset) else None)
    return out


def _without_names(path):
    """config.json without the model's name (a second model built in one
    process gets a suffixed one)."""
    config = json.loads(open(path).read())
    config["config"].pop("name")
    return config


@pytest.mark.parametrize("case", ["qwen3", "smollm3", "mixtral", "gpt_oss"])
def test_to_keras_equals_load_then_save(case, sources, tmp_path, xla_transposes):
    """Dense, a buffer the checkpoint lacks (SmolLM3's rotary inv_freq),
    experts stacked from per-expert tensors, MXFP4 experts dequantized."""
    _, paths = sources
    stats = convert_checkpoint(paths[case], str(tmp_path / "converted"), to="keras", task=None, progress=False)
    assert stats.bytes_written > 0
    # SmolLM3's checkpoint here is cast (bfloat16 tensors, a float32 config):
    # casts stay on NumPy.
    assert bool(xla_transposes) == (case != "smollm3")
    model = load_sharded_preset(paths[case], mesh=(2, 4), dtype="bfloat16", progress=False)
    save_sharded_preset(model, str(tmp_path / "saved"))
    assert sorted(os.listdir(tmp_path / "converted")) == sorted(os.listdir(tmp_path / "saved"))
    assert _datasets(tmp_path / "converted") == _datasets(tmp_path / "saved")
    assert _without_names(tmp_path / "converted" / "config.json") == _without_names(tmp_path / "saved" / "config.json")
    keras.distribution.set_distribution(None)
    if case == "smollm3":  # its paths repeat per layer: no layout map can address them
        keras_hub.models.Backbone.from_preset(str(tmp_path / "converted"))
    else:
        load_sharded_preset(str(tmp_path / "converted"), mesh=(1, 8), verify=True, progress=False)


def test_to_huggingface_equals_load_then_save_byte_for_byte(sources, tmp_path, xla_transposes):
    """From a multi-file KerasHub preset (Keras's own sharding)."""
    _, paths = sources
    model = load_sharded_preset(paths["mixtral"], mesh=(1, 8), dtype="float32", progress=False)
    save_sharded_preset(model, str(tmp_path / "keras"), max_shard_size=0.0001)
    assert "model.weights.json" in os.listdir(tmp_path / "keras") and not xla_transposes
    convert_checkpoint(str(tmp_path / "keras"), str(tmp_path / "converted"), to="huggingface",
                       max_shard_size="60KB", progress=False)
    assert xla_transposes
    save_sharded_preset(model, str(tmp_path / "saved"), format="huggingface", max_shard_size="60KB")
    names = sorted(os.listdir(tmp_path / "saved"))
    assert sorted(os.listdir(tmp_path / "converted")) == names and len(names) > 5
    for name in names:  # the index's checksums included
        assert (tmp_path / "converted" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name


def test_dtype_and_a_task_with_its_tokenizer(tmp_path):
    path = write_synthetic_preset(
        str(tmp_path / "src"), keras_hub.models.Llama3Backbone, dtype="float32", tokenizer=True,
        vocabulary_size=320, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
        intermediate_dim=64)
    convert_checkpoint(path, str(tmp_path / "hf"), to="huggingface", dtype="bfloat16", progress=False)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "hf"))
    lm = load_sharded_preset(path, mesh=(1, 8), task="causal_lm", progress=False)
    save_sharded_preset(lm, str(tmp_path / "saved"), format="huggingface", dtype="bfloat16")
    for name in os.listdir(tmp_path / "saved"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "saved" / name).read_bytes(), name
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "back"), to="keras", progress=False)
    assert {"task.json", "preprocessor.json", "tokenizer.json"} <= set(os.listdir(tmp_path / "back"))
    keras.distribution.set_distribution(None)
    back = keras_hub.models.CausalLM.from_preset(str(tmp_path / "back"))
    assert back.preprocessor.tokenizer("the fox") is not None
    with h5py.File(tmp_path / "back" / "model.weights.h5") as h5:
        assert h5["layers/reversible_embedding/vars/0"].attrs["dtype"] == "bfloat16"


def test_host_memory_stays_under_the_tiles(tmp_path, monkeypatch):
    """Sampled as each tile is written: while the weights are converted,
    anonymous memory grows by at most a tile buffer, its transposed copy
    (XLA's output) and a copy buffer per worker thread, plus XLA's CPU
    runtime and compiled transposes (once per process), not by the model
    (here ~120 tiles); planning adds a few MiB."""
    monkeypatch.setattr(convert, "TILE_BYTES", 4 << 20)
    path = write_synthetic_preset(
        str(tmp_path / "src"), keras_hub.models.Llama3Backbone, dtype="float32", vocabulary_size=16384,
        num_layers=6, num_query_heads=8, num_key_value_heads=8, hidden_dim=1024, intermediate_dim=2816)
    model_bytes = sum(os.path.getsize(tmp_path / "src" / n) for n in os.listdir(tmp_path / "src"))
    samples, start = [], []
    write, write_all = convert.PieceWriter.write, convert._write_all

    def sampled(self, *args):
        samples.append(host_rss.anon_rss_bytes())
        result = write(self, *args)
        samples.append(host_rss.anon_rss_bytes())
        return result

    def started(*args, **kwargs):
        start.append(host_rss.anon_rss_bytes())
        return write_all(*args, **kwargs)

    monkeypatch.setattr(convert.PieceWriter, "write", sampled)
    monkeypatch.setattr(convert, "_write_all", started)
    before = host_rss.anon_rss_bytes()
    convert_checkpoint(path, str(tmp_path / "hf"), to="huggingface", progress=False)
    assert model_bytes > 400 << 20 and len(samples) > 200
    workers, xla_runtime = 2, 40 << 20
    assert max(samples) - start[0] < workers * (2 * (4 << 20) + CHUNK_BYTES) + xla_runtime, (max(samples) - start[0]) >> 20
    assert max(samples) - before < model_bytes / 4, (max(samples) - before) >> 20


def test_killed_midway_leaves_the_target_untouched(sources, tmp_path):
    _, paths = sources
    target = tmp_path / "target"
    target.mkdir()
    (target / "old").write_text("previous")
    script = (
        "import sys, time; sys.path.insert(0, {root!r})\n"
        "from keras_hub_dist.convert import file_to_file as convert\n"
        "write = convert.PieceWriter.write\n"
        "def slow(self, *a):\n"
        "    time.sleep(0.05); return write(self, *a)\n"
        "convert.PieceWriter.write = slow\n"
        "convert.convert_checkpoint({src!r}, {dst!r}, to='keras', overwrite=True, progress=False)\n"
    ).format(root=os.getcwd(), src=paths["mixtral"], dst=str(target))
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True,
                               stderr=subprocess.PIPE)
    deadline = time.time() + 120
    staging = []
    while time.time() < deadline and process.poll() is None:
        staging = [n for n in os.listdir(tmp_path) if n.startswith(".target.partial-")]
        if staging and any(os.listdir(tmp_path / staging[0])):
            time.sleep(0.5)  # well into the writes
            break
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()[-2000:]
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert os.listdir(target) == ["old"] and (target / "old").read_text() == "previous"


def test_bad_inputs(sources, tmp_path):
    _, paths = sources
    with pytest.raises(SaveError, match="already in the huggingface format"):
        convert_checkpoint(paths["qwen3"], str(tmp_path / "a"), to="huggingface")
    with pytest.raises(SaveError, match="Expected a floating-point dtype the keras format can hold"):
        convert_checkpoint(paths["qwen3"], str(tmp_path / "a"), to="keras", dtype="int8")
    with pytest.raises(SaveError, match="Expected to= one of"):
        convert_checkpoint(paths["qwen3"], str(tmp_path / "a"), to="onnx")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(SaveError, match="non-empty directory.*overwrite=True"):
        convert_checkpoint(paths["qwen3"], str(tmp_path / "full"), to="keras")
    llama2 = write_synthetic_preset(
        str(tmp_path / "llama2"), keras_hub.models.LlamaBackbone, dtype="float32", vocabulary_size=64,
        num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
    with pytest.raises(SaveError, match="Cannot export a LlamaBackbone.*families that export"):
        convert_checkpoint(llama2, str(tmp_path / "b"), to="huggingface")
    assert sorted(os.listdir(tmp_path)) == ["full", "llama2"]


def test_command_line(sources, tmp_path, capsys):
    _, paths = sources
    code = cli.main(["convert", paths["qwen3"], str(tmp_path / "k"), "--to", "keras", "--task", "none",
                     "--no-progress"])
    assert code == 0 and "model.weights.h5" in os.listdir(tmp_path / "k")
    assert capsys.readouterr() == ("", "")
    assert checksums.METADATA_KEY in json.loads((tmp_path / "k" / "metadata.json").read_text())
    code = cli.main(["convert", paths["qwen3"], str(tmp_path / "k"), "--to", "keras"])
    assert code == 2 and "non-empty directory" in capsys.readouterr().err


def test_chunks_are_hashed_as_they_are_completed(tmp_path, monkeypatch):
    """`HashingAsWritten` with 1000-byte chunks: runs inside and across
    chunk boundaries, strided, in any order; a chunk is hashed once its
    last byte is written, and every digest is the file's."""
    from keras_hub_dist.formats.base import ByteRuns

    monkeypatch.setattr(checksums, "CHUNK_BYTES", 1000)
    path = tmp_path / "f"
    data = np.random.default_rng(0).integers(0, 255, 3500, dtype=np.uint8)
    path.write_bytes(data[:120].tobytes() + bytes(3380))  # a header, then a hole
    hasher = checksums.HashingAsWritten([str(path)], {str(path): [(120, 3500)]})
    # Bytes 120:3500, each once: 150 of every 300 one run at a time, the
    # others as one strided run (870:1020 and 2970:3120 cross chunk
    # boundaries), and the tail.
    runs = [ByteRuns(120 + 300 * i, 150, (), ()) for i in range(11)]
    runs += [ByteRuns(270, 150, (11,), (300,)), ByteRuns(3420, 80, (), ())]
    covered = sorted(o for run in runs for o, n in run for o in range(o, o + n))
    assert covered == list(range(120, 3500))
    fd = os.open(path, os.O_WRONLY)
    completed = []
    for run in reversed(runs):
        for offset, length in run:
            os.pwrite(fd, data[offset : offset + length].tobytes(), offset)
        hasher.written(str(path), run)
        completed.append(len(hasher._futures))
    os.close(fd)
    table = hasher.table()
    expected = checksums.chunk_digests([str(path)], checksums.all_chunks([3500]), chunk_bytes=[1000])
    assert [bytes(row) for row in table] == [expected[(0, c)] for c in range(4)]
    assert completed[0] == 0 and completed[-1] == 4  # hashed as completed, not all at the end
