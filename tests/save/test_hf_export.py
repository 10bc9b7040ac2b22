"""`save_sharded_preset(..., format="huggingface")` in one process: every
tensor bitwise what stock `export_to_transformers` writes for the families
it exports (and right where stock is wrong), what KerasHub's own importer
reads back into the same model for the families it cannot export, no device
memory used, reloadable on another mesh, checksummed, crash-safe, clear
errors. (Transformers itself reads them in test_hf_transformers.py.)"""

import functools
import json
import os

import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES, failing_on_call, quantize_collecting_once
from safetensors.numpy import load_file

from keras_hub_dist import PresetError, SaveError, load_sharded_preset, save_sharded_preset
from keras_hub_dist import write_synthetic_preset
from keras_hub_dist.formats import checksums
from keras_hub_dist.save import hf_export
from keras_hub_dist.measure import memory
from tests.formats.hf import dense, moe, recent
from tests.formats.hf.writer import write_hf_checkpoint

pytestmark = pytest.mark.usefixtures("short_delta_chunks")

MODULES = {case: module for module in (dense, moe, recent) for case in module.CASES}
# The families stock exports, with the mesh each is loaded on.
STOCK = {"llama": (1, 8), "mistral": (2, 4), "qwen2": (8, 1), "gemma3_text": (2, 4), "gemma4_text": (1, 8)}
# The families KerasHub imports but cannot export (and Gemma 2, which it
# exports as Gemma 1).
OURS = {"qwen3": (1, 8), "qwen3_moe": (2, 4), "mixtral": (1, 8), "gpt_oss": (2, 4), "smollm3": (8, 1), "gemma2": (1, 8)}
# config.json keys where ours differs from stock's, and why (README).
CONFIG_FIXES = {
    "qwen2": {"architectures", "use_sliding_window", "sliding_window"},  # KerasHub needs the last two
    "gemma3_text": set(),
    # Gemma4ForCausalLM; "proportional" RoPE; no global K/V heads of its own
    "gemma4_text": {"architectures", "rope_parameters", "num_global_key_value_heads"},
    "llama": set(),
    "mistral": set(),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_export")


@functools.cache
def _hf_dir(root, case, tied=False):
    config, tensors = MODULES[case].hf_checkpoint(case, tied=tied, dtype="float32")
    if case == "gpt_oss":
        config["sliding_window"] = 64  # KerasHub attends one position more than Transformers
    return write_hf_checkpoint(str(root / f"{case}_{tied}"), config, tensors, num_shards=2)


def _tensors(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _export(model, path, **kwargs):
    """Exports; returns the most bytes any device held above its start.
    Nothing is computed on a device: a few bytes are scalars KerasHub's
    builders make while the copy of the model is mapped."""
    with memory.MemorySampler() as sampler:
        save_sharded_preset(model, path, format="huggingface", progress=False, **kwargs)
    return max(sampler.peak_per_device[d] - sampler.start_per_device[d] for d in sampler.start_per_device)


def _assert_same_weights(a, b):
    for x, y in zip(a.weights, b.weights, strict=True):
        assert x.shape == y.shape, x.path
        assert np.asarray(x.value).tobytes() == np.asarray(y.value).tobytes(), x.path


def _stock_export(backbone, path):
    """Stock `CausalLM.export_to_transformers` of the same model."""
    cls = next(
        c for c in vars(keras_hub.models).values()
        if isinstance(c, type) and issubclass(c, keras_hub.models.CausalLM)
        and getattr(c, "backbone_cls", None) is type(backbone) and "Assistant" not in c.__name__
    )
    cls(backbone=backbone, preprocessor=None).export_to_transformers(path)
    return _tensors(path), json.loads(open(os.path.join(path, "config.json")).read())


@pytest.mark.parametrize("case", list(STOCK))
def test_families_stock_exports_write_what_stock_writes(case, root, tmp_path):
    tied = case == "llama"  # stock repeats a tied head as lm_head.weight
    model = load_sharded_preset(_hf_dir(root, case, tied), mesh=STOCK[case], progress=False)
    assert _export(model, str(tmp_path / "ours")) <= 64  # no device computes anything
    ours = _tensors(tmp_path / "ours")
    stock, stock_config = _stock_export(model, str(tmp_path / "stock"))
    assert set(stock) - set(ours) == ({"lm_head.weight"} if tied else set())
    assert set(ours) <= set(stock)
    for name, value in ours.items():
        assert (value.dtype, value.shape) == (stock[name].dtype, stock[name].shape), name
        assert value.tobytes() == stock[name].tobytes(), name
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    differ = {k for k in set(config) | set(stock_config) if config.get(k) != stock_config.get(k)}
    assert differ == CONFIG_FIXES[case]
    assert sorted(os.listdir(tmp_path / "ours")) == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors",
        "model.safetensors.index.json"]

    keras.distribution.set_distribution(None)
    again = load_sharded_preset(str(tmp_path / "ours"), mesh=STOCK[case][::-1], verify=True, progress=False)
    _assert_same_weights(model, again)


@pytest.mark.parametrize("case", list(OURS))
def test_families_kerashub_cannot_export_read_back_by_its_importer(case, root, tmp_path):
    source = _hf_dir(root, case)
    model = load_sharded_preset(source, mesh=OURS[case], progress=False)
    assert _export(model, str(tmp_path / "out")) <= 64
    ours = _tensors(tmp_path / "out")
    original = _tensors(source)
    if case == "gpt_oss":  # MXFP4 experts in, unquantized out
        original = {k: v for k, v in original.items() if not k.endswith(("_blocks", "_scales"))}
        assert {k for k in ours if k not in original} == {
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    for name, value in original.items():  # KerasHub's import is lossless here
        assert ours[name].tobytes() == value.tobytes(), name

    keras.distribution.set_distribution(None)
    again = load_sharded_preset(str(tmp_path / "out"), mesh=OURS[case][::-1], verify=True, progress=False)
    _assert_same_weights(model, again)
    config = {k: v for k, v in model.get_config().items() if k not in ("name", "dtype")}
    assert {k: v for k, v in again.get_config().items() if k not in ("name", "dtype")} == config
    keras.distribution.set_distribution(None)
    if case == "gpt_oss":  # KerasHub reads gpt-oss experts only as MXFP4
        with pytest.raises(KeyError, match="gate_up_proj_blocks"):
            keras_hub.models.Backbone.from_preset(str(tmp_path / "out"))
    else:
        _assert_same_weights(model, keras_hub.models.Backbone.from_preset(str(tmp_path / "out")))


GEMMA = dict(vocabulary_size=128, num_layers=2, hidden_dim=64, intermediate_dim=128)


@pytest.mark.parametrize("kv_heads, head_dim", [(1, 16), (4, 24)], ids=["gemma_2b_shape", "gemma_7b_shape"])
def test_gemma_with_one_and_several_kv_heads(kv_heads, head_dim, tmp_path):
    """gemma_2b: 1 K/V head, heads x head_dim = hidden; gemma_7b: as many K/V
    heads as query heads, heads x head_dim != hidden. Stock's map is only
    right for the first; ours is KerasHub's importer inverted, for both."""
    keras.utils.set_random_seed(0)
    model = keras_hub.models.GemmaBackbone(
        num_query_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim, **GEMMA)
    save_sharded_preset(model, str(tmp_path / "ours"), format="huggingface", progress=False)
    ours = _tensors(tmp_path / "ours")
    stock, _ = _stock_export(model, str(tmp_path / "stock"))
    wrong = {n for n in stock if stock[n].shape != ours[n].shape or stock[n].tobytes() != ours[n].tobytes()}
    if kv_heads == 1:
        assert wrong == set()
    else:
        assert wrong == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkv"}
        assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (kv_heads * head_dim, 64)
    _assert_same_weights(model, keras_hub.models.Backbone.from_preset(str(tmp_path / "ours")))


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_meshes_shard_files_and_the_index(mesh_shape, root, tmp_path):
    """Several shard files as Transformers splits them; every mesh writes
    the same bytes."""
    model = load_sharded_preset(_hf_dir(root, "qwen3_moe"), mesh=mesh_shape, progress=False)
    save_sharded_preset(model, str(tmp_path / "out"), format="huggingface", max_shard_size="40KB",
                        progress=False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    assert set(index["metadata"][checksums.METADATA_KEY]["checksums"]) == set(files)
    for name in files:
        assert os.path.getsize(tmp_path / "out" / name) <= 40_000 + 1000  # + header
    reference = root / "qwen3_moe_reference"
    if not reference.exists():
        keras.distribution.set_distribution(None)
        single = keras_hub.models.Backbone.from_preset(_hf_dir(root, "qwen3_moe"))
        save_sharded_preset(single, str(reference), format="huggingface", max_shard_size="40KB",
                            progress=False)
    for name in files:
        assert (tmp_path / "out" / name).read_bytes() == (reference / name).read_bytes(), name


def test_task_with_tokenizer_lora_merged_and_bfloat16(tmp_path):
    path = write_synthetic_preset(
        str(tmp_path / "src"), keras_hub.models.Llama3Backbone, dtype="float32", tokenizer=True,
        seed=1, vocabulary_size=320, num_layers=2, num_query_heads=8, num_key_value_heads=2,
        hidden_dim=64, intermediate_dim=128)
    lm = load_sharded_preset(path, mesh=(2, 4), task="causal_lm", progress=False)
    lm.backbone.enable_lora(rank=2)
    rng = np.random.default_rng(0)
    for variable in lm.backbone.trainable_variables:
        variable.assign(rng.standard_normal(variable.shape).astype("float32") * 0.1)
    save_sharded_preset(lm, str(tmp_path / "out"), format="huggingface", dtype="bfloat16", progress=False)
    files = set(os.listdir(tmp_path / "out"))
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= files
    ours = _tensors(tmp_path / "out")
    assert {str(v.dtype) for v in ours.values()} == {"bfloat16"}
    # The merged kernel, as Keras computes it, cast.
    query = lm.backbone.get_layer("transformer_layer_0")._self_attention_layer._query_dense
    merged = np.asarray(query.kernel).reshape(64, -1).T.astype("bfloat16")
    assert not np.array_equal(merged, np.asarray(query._kernel).reshape(64, -1).T.astype("bfloat16"))
    assert ours["model.layers.0.self_attn.q_proj.weight"].tobytes() == merged.tobytes()
    tokenizer = lm.preprocessor.tokenizer
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["bos_token_id"] == tokenizer.token_to_id(tokenizer.start_token)


def test_backbone_with_untied_head_exports_it(tmp_path):
    """Stock `Backbone.export_to_transformers` leaves an untied head out."""
    keras.utils.set_random_seed(0)
    model = keras_hub.models.Llama3Backbone(num_query_heads=4, num_key_value_heads=2, **GEMMA)
    save_sharded_preset(model, str(tmp_path / "ours"), format="huggingface", progress=False)
    model.export_to_transformers(str(tmp_path / "stock"))
    ours, stock = _tensors(tmp_path / "ours"), _tensors(tmp_path / "stock")
    assert "lm_head.weight" in ours and "lm_head.weight" not in stock
    assert ours["lm_head.weight"].tobytes() == np.asarray(
        model.token_embedding.reverse_embeddings).T.tobytes()


def test_failed_write_publishes_nothing(root, tmp_path, monkeypatch):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("old")
    model = load_sharded_preset(_hf_dir(root, "qwen3"), mesh=(1, 8), progress=False)
    monkeypatch.setattr(os, "pwritev", failing_on_call(os.pwritev, 3, OSError(28, "No space left on device")))
    with pytest.raises(SaveError, match="Writing the weights failed.*No space left"):
        save_sharded_preset(model, str(target), format="huggingface", overwrite=True, progress=False)
    monkeypatch.undo()
    assert os.listdir(target) == ["keep"] and sorted(os.listdir(tmp_path)) == ["target"]


def test_verify_detects_a_changed_byte(root, tmp_path):
    model = load_sharded_preset(_hf_dir(root, "qwen3"), mesh=(1, 8), progress=False)
    save_sharded_preset(model, str(tmp_path / "out"), format="huggingface", progress=False)
    (name,) = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    data = bytearray((tmp_path / "out" / name).read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "out" / name).write_bytes(bytes(data))
    with pytest.raises(PresetError, match="not the one that was saved"):
        load_sharded_preset(str(tmp_path / "out"), mesh=(1, 8), verify=True, progress=False)


def test_bad_inputs(root, tmp_path, monkeypatch):
    keras.utils.set_random_seed(0)
    llama2 = keras_hub.models.LlamaBackbone(num_query_heads=4, num_key_value_heads=2, **GEMMA)
    with pytest.raises(SaveError, match=r"Cannot export a LlamaBackbone.*Expected one of the families that export: .*Qwen3MoeBackbone"):
        save_sharded_preset(llama2, str(tmp_path / "a"), format="huggingface")
    qwen3 = load_sharded_preset(_hf_dir(root, "qwen3"), mesh=(1, 8), progress=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(SaveError, match="non-empty directory.*overwrite=True"):
        save_sharded_preset(qwen3, str(tmp_path / "full"), format="huggingface")
    with pytest.raises(SaveError, match="Expected a floating-point dtype the huggingface format can hold"):
        save_sharded_preset(qwen3, str(tmp_path / "b"), format="huggingface", dtype="int8")
    with pytest.raises(SaveError, match="Expected format to be one of"):
        save_sharded_preset(qwen3, str(tmp_path / "c"), format="onnx")
    keras.distribution.set_distribution(None)
    quantized = keras_hub.models.Llama3Backbone(num_query_heads=4, num_key_value_heads=2, **GEMMA)
    quantize_collecting_once(quantized, "int8")
    with pytest.raises(SaveError, match="Expected an unquantized model.*quantized layer"):
        save_sharded_preset(quantized, str(tmp_path / "d"), format="huggingface")
    # An untied head where the family ties (Gemma's converter never reads one).
    real_init = keras.layers.ReversibleEmbedding.__init__
    monkeypatch.setattr(keras.layers.ReversibleEmbedding, "__init__",
                        lambda self, *a, **k: real_init(self, *a, **{**k, "tie_weights": False}))
    untied = keras_hub.models.GemmaBackbone(num_query_heads=4, num_key_value_heads=1, head_dim=16, **GEMMA)
    with pytest.raises(SaveError, match=r"reverse_embeddings.*no tensor of the checkpoint holds it"):
        save_sharded_preset(untied, str(tmp_path / "e"), format="huggingface")
    assert sorted(os.listdir(tmp_path)) == ["full"]  # nothing was created


def test_silent_unless_asked(root, tmp_path, capsys):
    model = load_sharded_preset(_hf_dir(root, "qwen3"), mesh=(1, 8), progress=False)
    capsys.readouterr()
    save_sharded_preset(model, str(tmp_path / "quiet"), format="huggingface")
    assert capsys.readouterr() == ("", "")
    save_sharded_preset(model, str(tmp_path / "loud"), format="huggingface", progress=True)
    assert "Exporting loud" in capsys.readouterr().err


def test_plan_writes_each_block_once_over_processes(root):
    """The plan with fake 2 x 4 devices: every byte of every tensor is
    written by exactly one process, replicated blocks spread over both."""
    model = load_sharded_preset(_hf_dir(root, "qwen3"), mesh=(1, 8), progress=False)
    mapping = hf_export._mapping_of(model, None, None)
    layout = hf_export.plan_files(mapping.tensors)
    weight_set = hf_export.weight_set_of(model, (), "", None)
    class OtherProcess:  # devices 4..7 on process 1
        def __init__(self, device):
            self.id, self.process_index = device.id, int(device.id >= 4)

    def indices(name):
        real = hf_export._device_indices(weight_set.shardings[name], mapping.shapes[name])
        return {OtherProcess(d): i for d, i in real.items()}

    written = {}
    totals = []
    for process in (0, 1):
        plans, load = hf_export.plan_blocks(
            mapping, layout, "/x", {d: indices(d) for d in mapping.pieces},
            process_index=process, process_count=2)
        totals.append(load)
        for blocks in plans.values():
            for block in blocks:
                for path, write, _ in block.writes:
                    for offset, length in write.runs():
                        for b in range(offset, offset + length):
                            assert (path, b) not in written
                            written[(path, b)] = process
    assert totals[0] == totals[1]
    assert len(written) == sum(t.nbytes for t in mapping.tensors)
    assert 0.3 < sum(1 for p in written.values() if p == 1) / len(written) < 0.7


def test_gemma_lora_is_merged_where_stock_drops_it(tmp_path):
    """Stock's Gemma map reads `weights[0]`, the kernel without its LoRA
    update; the export writes what `save_to_preset` saves: merged."""
    keras.utils.set_random_seed(0)
    model = keras_hub.models.GemmaBackbone(num_query_heads=4, num_key_value_heads=1, head_dim=16, **GEMMA)
    model.enable_lora(rank=2)
    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:
        variable.assign(rng.standard_normal(variable.shape).astype("float32") * 0.1)
    save_sharded_preset(model, str(tmp_path / "ours"), format="huggingface", progress=False)
    stock, _ = _stock_export(model, str(tmp_path / "stock"))
    query = model.get_layer("decoder_block_0").attention.query_dense

    def as_hf(kernel):
        return np.transpose(np.asarray(kernel), (0, 2, 1)).reshape(-1, 64)

    name = "model.layers.0.self_attn.q_proj.weight"
    assert _tensors(tmp_path / "ours")[name].tobytes() == as_hf(query.kernel).tobytes()
    assert stock[name].tobytes() == as_hf(query._kernel).tobytes() != as_hf(query.kernel).tobytes()
