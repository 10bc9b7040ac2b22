"""Hugging Face checkpoints: per-device reads, hf:// handles, the fallback,
and every bad input named before device memory is used.

Equality with stock KerasHub for every family is in
test_huggingface_families.py; this file uses one tiny Llama.
"""

import functools
import json
import os
import shutil

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES

from keras_hub_dist import PresetError, load_sharded_preset
from keras_hub_dist.formats import huggingface
from tests.formats.hf import dense
from tests.formats.hf.writer import write_hf_checkpoint


def llama_checkpoint(seed=0):
    """The tiny untied float32 Llama of the family fixtures."""
    return dense.hf_checkpoint("llama", tied=False, dtype="float32", seed=seed)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """Written once for the module: no test writes into it."""
    config, tensors = llama_checkpoint()
    return write_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "llama"), config, tensors, num_shards=2)


@functools.cache
def _stock(path, dtype=None):
    """Stock `Backbone.from_preset(path, dtype=dtype)`, built once for the
    module's tests of the same files and dtype (it does not depend on the
    mesh, nor on what a test patches in our loader: each test takes it
    before patching)."""
    return keras_hub.models.Backbone.from_preset(path, dtype=dtype)


def _bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8)
    )


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_each_device_reads_only_its_block_and_memory_stays_at_the_floor(llama_dir, mesh_shape):
    reference = _stock(llama_dir)
    model, report = load_sharded_preset(
        llama_dir, mesh=mesh_shape, memory_report=True, progress=False
    )
    assert report.format == "huggingface" and report.fallbacks == ()
    # One process: each byte of the files is read once, whatever the mesh
    # (a block several local devices share is read once).
    assert report.bytes_read == report.file_bytes == sum(
        os.path.getsize(os.path.join(llama_dir, f)) - _header_bytes(os.path.join(llama_dir, f))
        for f in os.listdir(llama_dir) if f.endswith(".safetensors")
    )
    assert report.peak_over_final <= 1.05
    for ref, var in zip(reference.weights, model.weights):
        assert ref.path == var.path and _bitwise_equal(ref.value, var.value), ref.path
        layout = var.value.sharding
        for shard in var.value.addressable_shards:
            assert shard.data.shape == layout.shard_shape(var.shape)
    q = model.get_layer("transformer_layer_0")._self_attention_layer._query_dense.kernel
    assert "model" in q.value.sharding.spec  # sharded, not replicated


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_large_transposes_run_on_the_device_bitwise_equal(llama_dir, mesh_shape, dtype, monkeypatch):
    from keras_hub_dist.storage import host_io
    from keras_hub_dist.load import block_plan, execute, loader

    reference = _stock(llama_dir, dtype)
    monkeypatch.setattr(block_plan, "DEVICE_TRANSPOSE_MIN_BYTES", 0)  # every block
    # Every host buffer is one the pool may take back once its values are
    # consumed (by a transpose, or by a cast to bfloat16) and hand out again;
    # one variable read ahead, and each transpose's inputs taken back as soon
    # as it has run, so the tiny model's later reads find them.
    monkeypatch.setattr(host_io, "_HUGE_PAGE_MIN_BYTES", 1)
    monkeypatch.setattr(execute, "_RETIRING", 0)
    monkeypatch.setattr(loader, "execute_plan", functools.partial(execute.execute_plan, prefetch_bytes=1))
    calls = []
    transposer = execute._transposer
    monkeypatch.setattr(
        execute, "_transposer", lambda perm, sharding: calls.append(perm) or transposer(perm, sharding)
    )
    model, report = load_sharded_preset(
        llama_dir, mesh=mesh_shape, dtype=dtype, memory_report=True, progress=False
    )
    assert calls and report.bytes_read == report.file_bytes
    # The second block's kernels were read into the first one's buffers.
    assert report.host_bytes_reused > 0
    for ref, var in zip(reference.weights, model.weights):
        assert _bitwise_equal(ref.value, var.value), ref.path


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_expert_banks_transpose_on_the_device_bitwise_equal(tmp_path, case, monkeypatch):
    from keras_hub_dist.load import block_plan
    from tests.formats.hf import moe

    monkeypatch.setattr(block_plan, "DEVICE_TRANSPOSE_MIN_BYTES", 0)
    config, tensors = moe.hf_checkpoint(case, tied=False, dtype="bfloat16")
    path = write_hf_checkpoint(str(tmp_path / case), config, tensors, num_shards=2)
    reference = keras_hub.models.Backbone.from_preset(path)
    model = load_sharded_preset(path, mesh=(2, 4), progress=False)
    for ref, var in zip(reference.weights, model.weights):
        assert _bitwise_equal(ref.value, var.value), ref.path


def _header_bytes(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_hf_handle_from_the_cache(llama_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    reference = _stock(llama_dir)
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-llama" / "snapshots" / ("a" * 40)
    shutil.copytree(llama_dir, snapshot)
    (cache / "models--someone--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = load_sharded_preset("hf://someone/tiny-llama", mesh=(2, 4), progress=False)
    for ref, var in zip(reference.weights, model.weights):
        assert _bitwise_equal(ref.value, var.value), ref.path


def test_a_hook_without_block_form_falls_back_and_is_named(llama_dir, monkeypatch):
    from keras_hub.src.utils.transformers import convert_llama3

    reference = _stock(llama_dir)  # stock's own converter, unpatched
    original = convert_llama3.convert_weights

    def convert_weights(backbone, loader, config):
        port_weight = loader.port_weight

        def rolled(keras_variable, hf_weight_key, hook_fn=None):
            if hf_weight_key == "model.layers.1.mlp.down_proj.weight":
                def hook_fn(tensor, shape, inner=hook_fn):  # np.roll: no block form
                    return np.roll(inner(tensor, shape), 0, axis=0)
            port_weight(keras_variable, hf_weight_key, hook_fn)

        loader.port_weight = rolled
        return original(backbone, loader, config)

    monkeypatch.setattr(convert_llama3, "convert_weights", convert_weights)
    model, report = load_sharded_preset(llama_dir, memory_report=True, progress=False)
    assert len(report.fallbacks) == 1
    assert "transformer_layer_1/feedforward_output_dense/kernel" in report.fallbacks[0]
    assert "host fallback" in str(report)
    for ref, var in zip(reference.weights, model.weights):
        assert _bitwise_equal(ref.value, var.value), ref.path


# --- bad inputs: a clear error naming the file or tensor, nothing left behind


def _write(tmp_path, edit_tensors=None, edit_config=None, num_shards=2):
    config, tensors = llama_checkpoint()
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    return write_hf_checkpoint(str(tmp_path / "bad"), config, tensors, num_shards=num_shards)


def _load_fails(path, clean_state, match):
    with clean_state(), pytest.raises(PresetError, match=match) as info:
        load_sharded_preset(path, progress=False)
    return str(info.value)


def test_tensor_missing_from_files_and_index(tmp_path, clean_state):
    path = _write(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), num_shards=1)
    message = _load_fails(path, clean_state, "model.layers.1.mlp.up_proj.weight")
    assert "missing from 'model.safetensors'" in message
    assert "transformer_layer_1/feedforward_intermediate_dense/kernel" in message


def test_tensor_missing_from_the_index_only(tmp_path, clean_state):
    path = _write(tmp_path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    del index["weight_map"]["model.norm.weight"]
    json.dump(index, open(index_path, "w"))
    _load_fails(path, clean_state, r"'model.norm.weight' is missing from the index .*the index is stale")


def test_index_naming_a_shard_that_does_not_exist(tmp_path, clean_state):
    path = _write(tmp_path)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    _load_fails(path, clean_state, r"names the shard file 'model-00002-of-00002.safetensors', which does not exist")


def test_shape_that_disagrees_with_config(tmp_path, clean_state):
    def wrong(t):
        t["model.layers.0.mlp.gate_proj.weight"] = t["model.layers.0.mlp.gate_proj.weight"][:96]

    message = _load_fails(_write(tmp_path, wrong), clean_state, "model.layers.0.mlp.gate_proj.weight")
    assert "Expected (64, 128)" in message and "of shape [96, 64]" in message
    assert "transformer_layer_0/feedforward_gate_dense/kernel" in message


@pytest.mark.parametrize("damage", ["truncated", "header_length", "header_json", "offsets"])
def test_truncated_or_corrupt_file(tmp_path, clean_state, damage):
    path = _write(tmp_path, num_shards=1)
    file = os.path.join(path, "model.safetensors")
    data = bytearray(open(file, "rb").read())
    header = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "header_length":
        data[:8] = (len(data) * 2).to_bytes(8, "little")
    elif damage == "header_json":
        data[8:12] = b"\xff\xfe{["
    else:
        text = data[8 : 8 + header].decode()
        first = json.loads(text)
        name = next(k for k in first if k != "__metadata__")
        begin, end = first[name]["data_offsets"]
        text = text.replace(f"[{begin},{end}]", f"[{begin},{end + 4}]", 1)
        data[8 : 8 + header] = text.encode()
    open(file, "wb").write(bytes(data))
    _load_fails(path, clean_state, r"'.*model.safetensors' is truncated or corrupt")


def test_invalid_config_json_names_the_file(tmp_path, clean_state):
    path = _write(tmp_path)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"model_type": "llama",\n "vocab_size": }')
    _load_fails(path, clean_state, r"config.json' is not valid JSON.*line 2")


def test_model_type_kerashub_cannot_convert(tmp_path, clean_state):
    path = _write(tmp_path, edit_config=lambda c: c.update(model_type="falcon_mamba"))
    message = _load_fails(path, clean_state, "model_type='falcon_mamba'")
    assert all(t in message for t in ("llama", "gemma3", "qwen3_moe", "gpt_oss"))


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "eetq", "gguf"])
def test_quantization_method_not_read_is_refused(tmp_path, clean_state, method):
    path = _write(tmp_path, edit_config=lambda c: c.update(quantization_config={"quant_method": method}))
    message = _load_fails(path, clean_state, f"quantized with quant_method='{method}': this method is not read")
    assert all(m in message for m in ("'fp8'", "'compressed-tensors'", "'gptq'", "'awq'", "'mxfp4'"))


def test_quantized_config_over_float_weights_is_refused(tmp_path, clean_state):
    """config.json says FP8, the files hold float weights: no silent float load."""
    quantization = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    path = _write(tmp_path, edit_config=lambda c: c.update(quantization_config=quantization))
    _load_fails(path, clean_state, "says the weights are quantized \\(fp8, fp8\\).*no quantized Linear weight")


def test_no_weights_at_all(tmp_path, clean_state):
    path = _write(tmp_path)
    for f in os.listdir(path):
        if f != "config.json":
            os.remove(os.path.join(path, f))
    _load_fails(path, clean_state, "has no weights. Expected 'model.safetensors' or 'model.safetensors.index.json'")


def test_untraceable_direct_assignment_is_an_error(llama_dir, clean_state, monkeypatch):
    from keras_hub.src.utils.transformers import convert_llama3

    original = convert_llama3.convert_weights

    def convert_weights(backbone, loader, config):
        original(backbone, loader, config)
        norm = loader.get_tensor("model.norm.weight")
        backbone.get_layer("sequence_output_layernorm").scale.assign(np.sort(norm))

    monkeypatch.setattr(convert_llama3, "convert_weights", convert_weights)
    _load_fails(llama_dir, clean_state, r"sequence_output_layernorm/scale: .*\['model.norm.weight'\].*cannot\s+split")


def test_model_type_list_is_what_the_converters_handle():
    import keras_hub.src.utils.transformers.preset_loader as preset_loader

    for model_type in huggingface.TESTED_MODEL_TYPES:
        preset_loader.TransformersPresetLoader(None, {"model_type": model_type})
    assert jax.device_count() == 8 and keras.config.backend() == "jax"


@pytest.mark.parametrize(
    "cls_name, config",
    [
        ("GemmaBackbone", dict(vocabulary_size=256, num_layers=2, num_query_heads=8,
                               num_key_value_heads=1, hidden_dim=64, intermediate_dim=256, head_dim=16)),
        ("Llama3Backbone", dict(vocabulary_size=256, num_layers=2, num_query_heads=8,
                                num_key_value_heads=2, hidden_dim=64, intermediate_dim=128,
                                tie_word_embeddings=False)),
    ],
)
def test_synthetic_hf_checkpoint_is_read_by_stock_and_loads_equal(tmp_path, cls_name, config):
    from keras_hub_dist import write_synthetic_hf_checkpoint

    cls = getattr(keras_hub.models, cls_name)
    path = str(tmp_path / cls_name)
    hf_config = write_synthetic_hf_checkpoint(path, cls, config, dtype="bfloat16", shard_bytes=40_000)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    assert hf_config["model_type"] == ("gemma" if cls_name == "GemmaBackbone" else "llama")
    cls_back, converted = huggingface.backbone_config(hf_config, path)
    assert cls_back is cls
    assert {k: converted[k] for k in config} == config  # the converter inverts the writer
    stock = keras_hub.models.Backbone.from_preset(path)
    model = load_sharded_preset(path, mesh=(2, 4), progress=False)
    for ref, var in zip(stock.weights, model.weights):
        assert _bitwise_equal(ref.value, var.value), ref.path
    with pytest.raises(PresetError, match="exists"):
        write_synthetic_hf_checkpoint(path, cls, config)
    with pytest.raises(PresetError, match="No Hugging Face layout for GptOssBackbone"):
        write_synthetic_hf_checkpoint(str(tmp_path / "x"), keras_hub.models.GptOssBackbone, config)


def _byte_level_tokenizer(path, vocab_size):
    """tokenizer.json + tokenizer_config.json of a byte-level BPE: a token per
    byte, two merges, and Llama 3's special tokens."""
    from keras_hub_dist.formats.synthetic import _bytes_to_unicode

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode())}
    vocab.update({"he": 256, "ll": 257})
    specials = [{"id": vocab_size - 5 + i, "content": c} for i, c in enumerate(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )]
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"model": {"type": "BPE", "vocab": vocab, "merges": ["h e", "l l"]},
                   "added_tokens": specials}, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)


def test_causal_lm_task_from_an_hf_checkpoint_generates_like_stock(tmp_path):
    config, tensors = llama_checkpoint(seed=7)
    config["vocab_size"] = 264
    rng = np.random.default_rng(7)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = rng.standard_normal((264, dense.HIDDEN), dtype=np.float32) * 0.5
    path = write_hf_checkpoint(str(tmp_path / "lm"), config, tensors)
    _byte_level_tokenizer(path, 264)

    stock = keras_hub.models.CausalLM.from_preset(path)
    stock.compile(sampler="greedy")
    prompts = ["hello", "he fell"]  # a batch the mesh's batch axis divides
    expected = stock.generate(prompts, max_length=12)
    lm = load_sharded_preset(path, mesh=(2, 4), task="causal_lm", progress=False)
    assert type(lm) is type(stock)
    for ref, var in zip(stock.backbone.weights, lm.backbone.weights):
        assert _bitwise_equal(ref.value, var.value), ref.path
    lm.compile(sampler="greedy")
    assert list(lm.generate(prompts, max_length=12)) == list(expected)
